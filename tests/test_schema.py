"""The sample contract: typed parsing, errors that name line/id/field, argument decoding."""

import json

import pytest

from rm_jax.data import schema
from rm_jax.data.schema import Reject, Sample
from rm_jax.data.tool_content import ImageField, parse_tool_content


def _good(i=1, **over):
    s = {"id": f"s{i}", "prompt_id": f"p{i}",
         "messages": [{"role": "user", "content": "make a 2K image"}],
         "response": {"content": None, "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "generate_image", "arguments": {"resolution": "2K"}}}]},
         "label": {"l3": "pass", "reason": "ok", "issues": [], "img": None}}
    s.update(over)
    return s


def _encode(obj, times):
    out = obj
    for _ in range(times):
        out = json.dumps(out)
    return out


@pytest.mark.parametrize("times", [1, 2, 3, 4])
def test_arguments_decoded_up_to_four_times(times):
    value, depth, ok = schema.decode_arguments(_encode({"count": 2}, times))
    assert ok and value == {"count": 2} and depth == times


def test_arguments_five_times_kept_raw_and_flagged(tmp_path):
    raw = _encode({"count": 2}, 5)
    value, _, ok = schema.decode_arguments(raw)
    assert not ok and value == raw
    obj = _good(response={"content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "generate_image", "arguments": raw}}]})
    got = schema.parse_sample(obj, line=1, base_dir=str(tmp_path))
    assert got.flags == ("args_undecodable",) and got.response.tool_calls[0].arguments == raw


def test_bad_rows_each_get_a_reason(tmp_path):
    (tmp_path / "ok.png").write_bytes(b"not checked here")
    lines = [
        json.dumps(_good(1)).encode(),
        b'{"id": "s2", "messages": [',                                                       # malformed
        json.dumps({"id": "s3", "messages": [{"role": "user", "content": "x"}]}).encode(),   # no response
        json.dumps(_good(4, messages=[{"role": "critic", "content": "x"}])).encode(),        # unknown role
        json.dumps(_good(5, messages=[{"role": "user", "content": [
            {"type": "image", "image": "missing.png"}]}])).encode(),                          # missing image
        b'{"id": "s6", "text": "\xff\xfe"}',                                                  # non-UTF-8
        json.dumps(_good(7, response={"content": "  ", "tool_calls": []})).encode(),        # empty response
        json.dumps(_good(8, label={"l3": "maybe"})).encode(),                               # bad verdict
        json.dumps(_good(9, label={"l3": "pass", "img": 11})).encode(),                     # img out of range
        json.dumps(_good(1)).encode(),                                                       # duplicate id
        b"",                                                                                  # blank: not a row
        json.dumps(_good(10, messages=[{"role": "user", "content": [
            {"type": "image", "image": "ok.png"}]}])).encode(),
        json.dumps(_good(11, label={"l3": "pass", "img": float("nan")})).encode(),          # NaN img
        json.dumps(_good(12, messages=[{"role": "tool", "tool_call_id": {"a": 1},
                                        "content": "{}"}])).encode(),                        # id not a string
        b"[" * 100_000 + b"]" * 100_000,                                                      # nested too deep
    ]
    path = tmp_path / "samples.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    items = list(schema.read_samples(str(path)))
    assert len(items) == 14
    kept = [x for x in items if isinstance(x, Sample)]
    rejects = {x.line: x for x in items if isinstance(x, Reject)}
    assert [s.id for s in kept] == ["s1", "s10"]
    want = {2: "malformed_json", 3: "missing_field", 4: "unknown_role", 5: "missing_image", 6: "non_utf8",
            7: "empty_response", 8: "invalid_label", 9: "invalid_label", 10: "duplicate_id",
            13: "invalid_label", 14: "bad_type", 15: "malformed_json"}
    assert {k: r.reason for k, r in rejects.items()} == want
    assert "field response" in rejects[3].detail and "line 3" in rejects[3].detail and "s3" in rejects[3].detail
    assert "messages[0].role" in rejects[4].detail
    assert "messages[0].content[0].image" in rejects[5].detail
    assert "label.img" in rejects[9].detail and "label.img" in rejects[13].detail
    assert "messages[0].tool_call_id" in rejects[14].detail


def test_image_paths_relative_to_jsonl_and_data_uri(tmp_path):
    sub = tmp_path / "d"
    sub.mkdir()
    (sub / "images").mkdir()
    (sub / "images" / "a.png").write_bytes(b"x")
    obj = _good(messages=[{"role": "user", "content": [
        {"type": "text", "text": "like this"}, {"type": "image", "image": "images/a.png"},
        {"type": "image", "image": "data:image/png;base64,AAAA"}]}])
    s = schema.parse_sample(obj, line=1, base_dir=str(sub))
    assert s.images[0].source == str(sub / "images" / "a.png")
    assert s.images[1].is_data_uri
    # img survives only when the conversation has an image
    obj["label"]["img"] = 8
    assert schema.parse_sample(obj, line=1, base_dir=str(sub)).label.img == 8
    assert schema.parse_sample(_good(label={"l3": "pass", "img": 8}), line=1, base_dir=str(sub)).label.img is None


def test_tool_content_compact_with_image_fields():
    content = json.dumps({"status": "ok", "images": [{"image": "images/g.png", "width": 2048}], "note": "two\nlines"})
    tc = parse_tool_content(content)
    assert tc.segments == ("status: ok, images: [{image: images/g.png ", ImageField("images/g.png"),
                           ", width: 2048}], note: two lines")
    assert tc.images == ("images/g.png",)
    # a double-encoded JSON string is decoded too; plain text is kept verbatim
    assert parse_tool_content(json.dumps(content)).images == ("images/g.png",)
    assert parse_tool_content("Image ready: 2048x2048").segments == ("Image ready: 2048x2048",)
    # an inline data URI is shown as the image only (no base64 text)
    uri = "data:image/png;base64,AAAA"
    assert parse_tool_content(json.dumps({"image": uri})).segments == ("image: ", ImageField(uri))


def test_key_fields_and_bom(tmp_path):
    """A BOM before the first row is not part of it; prompt_id and label.issues get type checks
    (a falsy wrong value is not taken for "absent")."""
    lines = [json.dumps(_good(1)).encode(),
             json.dumps(_good(2, prompt_id={"a": 1})).encode(),
             json.dumps(_good(3, prompt_id="")).encode(),
             json.dumps(_good(4, label={"l3": "pass", "reason": "ok", "issues": ""})).encode(),
             json.dumps(_good(5, label={"l3": "pass", "reason": "ok", "issues": 0})).encode(),
             json.dumps(_good(6, prompt_id=7)).encode()]
    path = tmp_path / "samples.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines) + b"\n")
    items = list(schema.read_samples(str(path)))
    assert isinstance(items[0], Sample) and items[0].id == "s1"
    assert [(x.reason, x.detail.split(",")[2].strip()) for x in items[1:5]] == [
        ("bad_type", "field prompt_id: prompt_id must be a non-empty string"),
        ("bad_type", "field prompt_id: prompt_id must be a non-empty string"),
        ("bad_type", "field label.issues: expected a list of strings"),
        ("bad_type", "field label.issues: expected a list of strings")]
    assert items[5].prompt_id == "7"
