"""The teacher labeller (rm_jax.label, launch.label).

Fast tests cover what needs no teacher: routing and contracts, the request the teacher gets
(every image, in order, as thumbnails), reply parsing, retry classification, the output store
(torn-line repair), rejects and resume bookkeeping. The `slow` tests label against the stand-in
teacher (a real OpenAI-compatible HTTP server on loopback) behind `FaultProxy`, a loopback proxy that fails 20% of requests (500, 429 with
Retry-After, a stall past the timeout, a dropped connection, a truncated body).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import httpx2   # the openai SDK's HTTP client
import openai
import pytest
import tenacity
from PIL import Image

from configs import judge_contracts
from rm_jax.data import schema, synth
from rm_jax.data.render import ROUTE_TEXT_ONLY, ROUTE_TOOL_CALL, build_transcript
from rm_jax.label import client as client_lib
from rm_jax.label import store
from rm_jax.label.contracts import IMAGE_CONTRACT, VERDICT_CONTRACTS
from rm_jax.label.replies import parse_image_score, parse_verdict
from rm_jax.label.request import TEACHER_GUARD, build_requests, request_images
from rm_jax.label.rebase import ImageRebase
from rm_jax.label.run import LabelSettings, Tally, label_file, label_stream, read_tasks
from rm_jax.label.standin import StandinTeacher

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNREACHABLE = "http://127.0.0.1:9/v1"     # discard port: any request would fail the test's counts


def _png(path, size, colour):
    Image.new("RGB", size, colour).save(path)


def _decode(uri: str) -> Image.Image:
    assert uri.startswith("data:image/jpeg;base64,")
    return Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB")


def _mean(img: Image.Image) -> tuple[int, ...]:
    px = list(img.get_flattened_data()) if hasattr(img, "get_flattened_data") else list(img.getdata())
    return tuple(round(sum(p[c] for p in px) / len(px)) for c in range(3))


COLOURS = [(220, 30, 30), (30, 200, 30), (30, 30, 220), (230, 200, 20), (150, 40, 190), (20, 190, 200),
           (240, 120, 20), (90, 90, 90), (250, 250, 250)]


@pytest.fixture()
def many_images(tmp_path):
    """A sample with 8 conversation images (parts and tool results, non-square, > the thumbnail
    edge) and a response that names one more image and one that does not exist."""
    (tmp_path / "images").mkdir()
    sizes = [(300, 120), (90, 200), (256, 256), (400, 100), (120, 330), (64, 48), (500, 260), (210, 90), (180, 240)]
    for i, (size, colour) in enumerate(zip(sizes, COLOURS)):
        _png(tmp_path / "images" / f"i{i}.png", size, colour)
    tool = lambda names: json.dumps({"status": "ok", "images": [{"image": f"images/{n}.png"} for n in names]})  # noqa: E731
    obj = {"id": "m1", "messages": [
        {"role": "user", "content": [{"type": "image", "image": "images/i0.png"}, {"type": "text", "text": "like these"},
                                     {"type": "image", "image": "images/i1.png"}, {"type": "image", "image": "images/i2.png"}]},
        {"role": "assistant", "content": "Generating."},
        {"role": "tool", "content": tool(["i3", "i4", "i5"])},                      # orphan, JSON string
        {"role": "tool", "tool_call_id": "nope", "content": json.dumps(tool(["i6"]))},  # double-encoded
        {"role": "user", "content": [{"type": "text", "text": "and this"}, {"type": "image", "image": "images/i7.png"}]}],
        "tools": [{"type": "function", "function": {"name": "edit_image", "parameters": {"type": "object",
                   "properties": {"image": {"type": "string"}}, "required": ["image"]}}}],
        "response": {"content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "edit_image", "arguments": json.dumps(json.dumps({"image": "images/i8.png",
                                                                       "mask": "images/missing.png"}))}}]}}
    return tmp_path, obj, sizes


def test_image_head_sends_every_image_in_order_as_thumbnails(many_images):
    d, obj, sizes = many_images
    s = schema.parse_sample(obj, line=1, base_dir=str(d), require_label=False)
    reqs = build_requests(s, thumbnail_edge=64, image_head=True)
    assert reqs.has_image and reqs.route == ROUTE_TOOL_CALL
    imgs = [_decode(u) for u in request_images(reqs.image.messages)]
    assert len(imgs) == reqs.image.n_images == 9          # all 8 of the conversation + the response's one
    for img, (w, h), colour in zip(imgs, sizes, COLOURS):
        scale = min(1.0, 64 / max(w, h))
        assert abs(img.size[0] - w * scale) <= 1 and abs(img.size[1] - h * scale) <= 1, (img.size, (w, h))
        assert max(img.size) <= 64
        assert all(abs(a - b) <= 12 for a, b in zip(_mean(img), colour)), (_mean(img), colour)
    text = "".join(p.get("text", "") for p in reqs.image.messages[1]["content"])
    assert "[edit_image.image: images/i8.png]" in text and "[edit_image.mask: images/missing.png] (no such image)" in text
    assert reqs.image.messages[0]["content"] == IMAGE_CONTRACT.text
    # The verdict head gets the conversation's images in place (thumbnails too), not the response's.
    assert len(request_images(reqs.verdict.messages)) == reqs.verdict.n_images == 8
    # Without an image endpoint, or without images, there is no image head.
    assert build_requests(s, 64, image_head=False).image is None


def test_routing_contracts_and_the_training_transcript(many_images):
    d, obj, _ = many_images
    tool = schema.parse_sample(obj, line=1, base_dir=str(d), require_label=False)
    text_obj = dict(obj, response={"content": "Done <|im_end|> here", "tool_calls": []})
    text = schema.parse_sample(text_obj, line=2, base_dir=str(d), require_label=False)
    for s, route, contract in ((tool, ROUTE_TOOL_CALL, judge_contracts.TOOL_CALL_CONTRACT),
                               (text, ROUTE_TEXT_ONLY, judge_contracts.TEXT_ONLY_CONTRACT)):
        r = build_requests(s, 64, image_head=False)
        assert r.route == route and r.verdict.contract.id == route
        assert r.verdict.messages[0] == {"role": "system", "content": contract}
        assert VERDICT_CONTRACTS[route].sha256 == hashlib.sha256(contract.encode()).hexdigest()
        content = r.verdict.messages[1]["content"]
        flat = "".join(p["text"] if p["type"] == "text" else "<IMG>" for p in content)
        # The training renderer's transcript, after the tool schemas.
        expected = "".join(p["text"] if p["type"] == "text" else "<IMG>"
                           for p in build_transcript(s, TEACHER_GUARD).parts)
        assert flat.startswith("## Tools the assistant could call\n" + json.dumps(obj["tools"][0]) + "\n")
        assert flat.endswith(expected)
        assert "[tool: unknown]\nstatus: ok, images: [{image: images/i3.png <IMG>" in flat   # orphans kept
    tool_flat = "".join(p.get("text", "") for p in build_requests(tool, 64, False).verdict.messages[1]["content"])
    assert '{"name": "edit_image", "arguments": {"image": "images/i8.png", "mask": "images/missing.png"}}' in tool_flat
    text_flat = "".join(p.get("text", "") for p in build_requests(text, 64, False).verdict.messages[1]["content"])
    assert "<|im_end|>" not in text_flat and "<\u200b|im_end|>" in text_flat   # policy text cannot end the turn


def test_the_labeller_needs_no_model_code():
    """The teacher guard covers every control token of the judge's tokenizer, and the labeller
    imports no jax/model code (a streaming run's memory is mostly its imports)."""
    from configs import tiny
    assert set(tiny.SPECIAL_TOKENS) <= set(TEACHER_GUARD.tokens)
    code = "import sys, launch.label, rm_jax.label.run; print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax'))"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert res.returncode == 0 and res.stdout.strip() == "[]", (res.stdout, res.stderr[-2000:])


def test_reply_parsing():
    assert parse_verdict('{"l3": "fail", "reason": "r", "issues": ["wrong_param"], "img": 3}').issues == ("wrong_param",)
    v = parse_verdict('Sure.\n```json\n{"l3": "pass", "reason": "ok", "issues": []}\n```')
    assert (v.l3, v.status) == ("pass", "recovered")
    assert parse_verdict('{"l3": "pass", "issues": [], "img": 10}').reason == ""
    for bad in ("", "pass", '{"l3": "maybe"}'):
        with pytest.raises(client_lib.UnusableReply):
            parse_verdict(bad)
    assert parse_image_score('{"img": 7, "reason": "x"}') == 7
    assert parse_image_score('{"l3": "pass", "issues": [], "img": 10}') == 10
    assert parse_image_score('score: {"img": 4.0, "reason": "unclosed') == 4
    assert parse_image_score('{"l3": "pass", "issues": [], "img":img": 8}') == 8   # seen from a tiny judge
    assert parse_image_score('{"l3": "pass", "issues": [], "img": null}') is None     # declined, recorded
    for bad in ('{"img": 11}', '{"reason": "no score"}', "seven", '{"img": 7.5}'):
        with pytest.raises(client_lib.UnusableReply):
            parse_image_score(bad)


def _status_error(cls, code, headers=None):
    req = httpx2.Request("POST", "http://x/v1/chat/completions")
    resp = httpx2.Response(code, headers=headers or {}, request=req)
    return cls("boom", response=resp, body=None)


def test_retry_classification_and_retry_after():
    req = httpx2.Request("POST", "http://x")
    assert client_lib.retryable(_status_error(openai.InternalServerError, 500))
    assert client_lib.retryable(_status_error(openai.InternalServerError, 503))
    assert client_lib.retryable(_status_error(openai.RateLimitError, 429))
    assert client_lib.retryable(openai.APITimeoutError(request=req))
    assert client_lib.retryable(openai.APIConnectionError(request=req))
    assert client_lib.retryable(client_lib.UnusableReply("x"))
    for cls, code in ((openai.BadRequestError, 400), (openai.NotFoundError, 404), (openai.AuthenticationError, 401)):
        assert not client_lib.retryable(_status_error(cls, code))
    wait = client_lib.RetryAfterWait(client_lib.RetryPolicy(backoff_initial_s=0.01, backoff_max_s=0.02,
                                                            retry_after_max_s=5))

    def failed_with(exc) -> tenacity.RetryCallState:      # tenacity's record of a first attempt that raised
        state = tenacity.RetryCallState(tenacity.Retrying(), None, (), {})
        state.set_exception((type(exc), exc, None))
        return state
    assert 2.0 <= wait(failed_with(_status_error(openai.RateLimitError, 429, {"Retry-After": "2"}))) <= 2.0
    assert wait(failed_with(_status_error(openai.RateLimitError, 429, {"Retry-After": "600"}))) == 5   # capped
    assert wait(failed_with(_status_error(openai.InternalServerError, 500))) <= 0.02


def test_store_repairs_a_torn_tail_and_refuses_damage(tmp_path):
    out = tmp_path / "labels.jsonl"
    good = [{"id": f"a{i}", "response": {"content": "x", "tool_calls": []}, "label": {"l3": "pass"}} for i in range(3)]
    w = store.JsonlAppender(str(out))
    for row in good:
        w.write(row)
    w.close()
    intact = out.read_bytes()
    torn = b'{"id": "a3", "response": {"con'          # a kill -9 mid-write
    with open(out, "ab") as f:
        f.write(torn)
    got = store.scan_and_repair(str(out))
    assert set(got.labelled) == {"a0", "a1", "a2"} and got.repaired_bytes == len(torn)
    assert out.read_bytes() == intact
    assert store.scan_and_repair(str(out)).repaired_bytes == 0
    out.write_bytes(intact + b"garbage\n")
    with pytest.raises(store.OutputCorrupt, match=r"labels.jsonl:4"):
        store.scan_and_repair(str(out))
    out.write_bytes(intact + json.dumps(good[1]).encode() + b"\n")
    with pytest.raises(store.OutputCorrupt, match="appears twice"):
        store.scan_and_repair(str(out))


def _settings(**kw) -> LabelSettings:
    base = dict(endpoints=(UNREACHABLE,), model="m", progress=False,
                policy=client_lib.RetryPolicy(max_retries=0, timeout_s=2))
    base.update(kw)
    return LabelSettings(**base)


def test_bad_rows_are_rejected_with_the_build_reasons(tmp_path):
    """No row reaches the (unreachable) teacher: each is bad input, rejected with its reason."""
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "broken.png").write_bytes(b"not a png")
    ok = {"id": "a", "messages": [{"role": "user", "content": "hi"}], "response": {"content": "hello", "tool_calls": []}}
    lines = ["{not json", json.dumps({"id": "b", "messages": [], "response": {"content": "x"}}),
             json.dumps(dict(ok, id="c", response={"content": None, "tool_calls": []})),
             json.dumps(dict(ok, id="d", messages=[{"role": "user", "content": [{"type": "image", "image": "images/nope.png"}]}])),
             json.dumps(dict(ok, id="e", messages=[{"role": "tool", "content": json.dumps({"image": "images/broken.png"})}])),
             json.dumps(dict(ok, id="e"))]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n\n")
    out = tmp_path / "out.jsonl"
    stats = label_file(str(inp), str(out), _settings())
    assert (stats["read"], stats["labelled"], stats["failed"], stats["rejected"]) == (6, 0, 0, 6)
    assert stats["rejected_by_reason"] == {"malformed_json": 1, "missing_field": 1, "empty_response": 1,
                                           "missing_image": 1, "corrupt_image": 1, "duplicate_id": 1}
    rejects = [json.loads(x) for x in open(store.rejects_path(str(out)))]
    assert sorted(r["line"] for r in rejects) == [1, 2, 3, 4, 5, 6]
    assert all(r["detail"] for r in rejects)
    assert json.load(open(store.stats_path(str(out)))) == stats
    assert out.read_text() == ""


def test_resume_skips_labelled_ids_and_holds_one_labeller_per_out(tmp_path):
    d = tmp_path / "data"
    samples = synth.generate(synth.SynthConfig(n=12, seed=4), str(d))
    inp = d / "samples.jsonl"
    inp.write_text("".join(json.dumps(s) + "\n" for s in samples))
    out = d / "labels.jsonl"
    out.write_text("".join(json.dumps(dict(s, label_meta={})) + "\n" for s in samples[:11]))
    # One left: the unreachable teacher fails it (connection error), and it is recorded, not lost.
    stats = label_file(str(inp), str(out), _settings())
    assert (stats["read"], stats["labelled"], stats["failed"], stats["already_labelled"]) == (12, 11, 1, 11)
    assert stats["failed_by_reason"] == {"connection_error": 1}
    err = [json.loads(x) for x in open(store.errors_path(str(out)))]
    assert [e["id"] for e in err] == [samples[11]["id"]] and err[0]["attempts"] == 1
    assert len(out.read_text().splitlines()) == 11             # nothing written twice or half
    n_tool = sum(bool(s["response"]["tool_calls"]) for s in samples[:11])
    assert stats["by_route"]["tool_call"]["labelled"] == n_tool
    stats = label_file(str(inp), str(out), _settings(limit=11))
    assert (stats["read"], stats["labelled"], stats["failed"]) == (11, 11, 0)
    held = store.RunLock(str(out))          # another labeller on the same OUT
    try:
        with pytest.raises(ValueError, match="another labeller"):
            label_file(str(inp), str(out), _settings())
    finally:
        held.release()
    assert label_file(str(inp), str(out), _settings(limit=11))["labelled"] == 11


# ================================================================ streaming, folders, URLs (stand-in teacher)


@pytest.fixture(scope="module")
def standin():
    """The instant stand-in teacher over real HTTP (uvicorn on loopback): the labeller's own
    behaviour (streaming, paths) does not depend on what the teacher thinks."""
    with StandinTeacher() as teacher:
        yield teacher


def _standin_settings(teacher, **kw) -> LabelSettings:
    return LabelSettings(**dict(dict(endpoints=(teacher.base_url,), model=teacher.model, progress=False,
                                     thumbnail_edge=32, policy=client_lib.RetryPolicy(max_retries=0, timeout_s=30)),
                                **kw))


def test_rows_are_read_as_workers_free_up(tmp_path, standin):
    """The reader runs ahead of the finished results by at most the workers and their queue
    (memory bounded by concurrency), and every row still ends labelled exactly once."""
    d = tmp_path / "data"
    samples = synth.generate(synth.SynthConfig(n=60, seed=5), str(d))
    inp = d / "samples.jsonl"
    inp.write_text("".join(json.dumps(s) + "\n" for s in samples))
    out = d / "labels.jsonl"
    settings = _standin_settings(standin, concurrency=3)
    tally = Tally()
    ahead = []

    def counted():
        for item in read_tasks(str(inp), ImageRebase(str(d), str(d))):
            finished = tally.labelled_this_run + sum(tally.failed.values()) + sum(tally.rejected.values())
            ahead.append(tally.read - finished)
            yield item

    writers = [store.JsonlAppender(p) for p in (str(out), store.errors_path(str(out)), store.rejects_path(str(out)))]
    try:
        asyncio.run(label_stream(counted(), None, store.ExistingOutput({}, 0), settings, tally, *writers))
    finally:
        for w in writers:
            w.close()
    n_workers = 3
    assert tally.read == tally.labelled_this_run == 60
    assert max(ahead) <= 2 * n_workers + 1, ahead       # in flight + queued + the one being handed over
    assert max(ahead) >= n_workers                      # and the workers did run concurrently
    assert sorted(_ids(out)) == sorted(s["id"] for s in samples)


def test_kill9_mid_stream_then_resume_equals_uninterrupted(tmp_path, standin):
    """launch.label killed with SIGKILL mid-stream, then rerun: every id exactly once, the counts
    add up, and the labels equal an uninterrupted run's (the stand-in is deterministic)."""
    d = tmp_path / "data"
    samples = synth.generate(synth.SynthConfig(n=160, seed=6), str(d))
    lines = [json.dumps(s) for s in samples]
    lines.insert(70, "{broken")
    inp = d / "samples.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    reference = label_file(str(inp), str(tmp_path / "ref" / "labels.jsonl"), _standin_settings(standin))
    assert (reference["read"], reference["labelled"], reference["rejected"]) == (161, 160, 1)

    out = tmp_path / "out" / "labels.jsonl"
    cmd = [sys.executable, "-m", "launch.label", f"--input={inp}", f"--out={out}", f"--endpoint={standin.base_url}",
           f"--model={standin.model}", "--concurrency=2", "--thumbnail_edge=32"]
    env = dict(os.environ, PYTHONPATH=REPO)
    n_before = _kill9_once_written(cmd, env, out, rows=30, timeout_s=120)
    assert 30 <= n_before < 160
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    stats = json.load(open(store.stats_path(str(out))))
    assert (stats["read"], stats["labelled"], stats["failed"], stats["rejected"], stats["pending"]) == (161, 160, 0, 1, 0)
    assert stats["already_labelled"] == n_before and stats["labelled_this_run"] == 160 - n_before
    ids = _ids(out)
    assert len(ids) == len(set(ids)) == 160
    label = lambda path: {r["id"]: r["label"] for r in map(json.loads, open(path))}  # noqa: E731
    assert label(out) == label(tmp_path / "ref" / "labels.jsonl")


def _image_strings_of(row: dict) -> list[str]:
    """Every image reference a row names (parts, tool-result fields, call arguments), in order."""
    from rm_jax.data.schema import decode_arguments
    from rm_jax.data.tool_content import parse_tool_content
    found = []
    for m in row["messages"]:
        if isinstance(m["content"], list):
            found += [p["image"] for p in m["content"] if p["type"] == "image"]
        elif m["role"] == "tool":
            found += list(parse_tool_content(m["content"]).images)
    for c in row["response"].get("tool_calls") or []:
        args, _, _ = decode_arguments(c["function"]["arguments"])
        found += [v for v in args.values() if isinstance(v, str) and v.endswith(".png")]
    return found


def test_out_in_another_folder_rewrites_image_paths_and_builds(tmp_path, standin, renderer, tiny_cfg, synth_dir):
    """OUT in another folder: relative image paths are rewritten against OUT's folder (parts,
    double-encoded tool results, call arguments, alike), URLs, data URIs and absolute paths are
    kept, and the labelled file builds from where it is."""
    from rm_jax.data import build
    from rm_jax.data.render import judge_chat
    from rm_jax.label.contracts import TEACHER_RENDER

    d = tmp_path / "data"
    samples = synth.generate(synth.SynthConfig(n=16, seed=4), str(d))
    _png(d / "images" / "photo.png", (32, 24), (200, 40, 40))      # small: the tiny judge's 320 tokens hold 5
    absolute = tmp_path / "abs.png"
    _png(absolute, (24, 32), (40, 200, 40))
    tiny_uri = "data:image/png;base64," + base64.b64encode(_png_bytes((20, 20), (9, 9, 200))).decode()
    extra = {"id": "parts", "prompt_id": "parts", "messages": [
        {"role": "user", "content": [{"type": "image", "image": "images/photo.png"},
                                     {"type": "image_url", "image_url": {"url": "./images/photo.png"}},
                                     {"type": "image", "image": str(absolute)},
                                     {"type": "image", "image": tiny_uri},
                                     {"type": "image", "image": "https://cdn.example.com/a/photo.png"},
                                     {"type": "text", "text": "edit images/photo.png please"}]},
        {"role": "tool", "tool_call_id": "t1", "content": json.dumps(json.dumps(
            {"status": "ok", "images": [{"image": "images/photo.png"}, {"image": "gs://bucket/x.png"}]}))}],
        "response": {"content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "edit_image", "arguments": json.dumps({"image": "images/photo.png", "ref": "s3://b/y.png"})}}]},
        "label": {"l3": "pass", "reason": "", "issues": [], "img": 5}}
    rows = samples + [extra]
    inp = d / "samples.jsonl"
    inp.write_text("".join(json.dumps(s) + "\n" for s in rows))
    out = tmp_path / "labelled" / "run1" / "labels.jsonl"
    stats = label_file(str(inp), str(out), _standin_settings(standin))
    assert (stats["read"], stats["labelled"], stats["failed"], stats["rejected"]) == (17, 17, 0, 0)

    got = {r["id"]: r for r in map(json.loads, open(out))}
    moved = json.loads(json.dumps(extra))
    # What a user would write by hand: each relative path named from the new folder.
    moved["messages"][0]["content"][0]["image"] = "../../data/images/photo.png"
    moved["messages"][0]["content"][1]["image_url"]["url"] = "../../data/images/photo.png"
    row = got["parts"]
    assert row["messages"][0]["content"] == moved["messages"][0]["content"]      # abs, data URI, URL, text kept
    tool_value = json.loads(json.loads(row["messages"][1]["content"]))           # still encoded twice
    assert tool_value == {"status": "ok", "images": [{"image": "../../data/images/photo.png"},
                                                     {"image": "gs://bucket/x.png"}]}
    assert json.loads(row["response"]["tool_calls"][0]["function"]["arguments"]) == {
        "image": "../../data/images/photo.png", "ref": "s3://b/y.png"}
    for s in samples:    # one path, one new name: a call still names the file its tool returned
        rel = [p for p in _image_strings_of(s)]
        assert _image_strings_of(got[s["id"]]) == [os.path.join("../../data", p) for p in rel]

    # The rows resolve from OUT's folder to the very files the input named.
    inputs = {x.id: x for x in schema.read_samples(str(inp), require_label=False)}
    outputs = list(schema.read_samples(str(out)))
    assert all(isinstance(x, schema.Sample) for x in outputs) and len(outputs) == 17
    for x in outputs:
        refs_in = judge_chat(inputs[x.id], TEACHER_RENDER)[1]
        refs_out = judge_chat(x, TEACHER_RENDER)[1]
        assert [r.source for r in refs_out] == [r.source for r in refs_in]
    assert len(judge_chat(inputs["parts"], TEACHER_RENDER)[1]) == 5     # 2 parts + abs + data URI + tool field

    result = build.build(str(out), str(tmp_path / "shards"), renderer, build.BuildOptions.from_config(tiny_cfg.data),
                         tokenizer_dir=os.path.join(synth_dir, "tokenizer"), progress=False)
    assert (result.stats["read"], result.stats["rejected"]) == (17, 0), result.stats["rejected_by_reason"]


def _png_bytes(size, colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def test_a_url_is_never_read_as_a_path(tmp_path, standin):
    """Remote image references reach the teacher as `[image: URL]` text, as build and score show
    them to the judge: never fetched, never resolved against a folder, never a missing file."""
    (tmp_path / "images").mkdir()
    _png(tmp_path / "images" / "local.png", (90, 60), (30, 30, 220))
    url_only = {"id": "u1", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                                     {"type": "text", "text": "make it blue"}]},
        {"role": "tool", "content": json.dumps({"images": [{"image": "gs://bucket/cat_blue.png"}]})}],
        "response": {"content": "Here it is: https://example.com/cat_blue.png", "tool_calls": []}}
    mixed = {"id": "u2", "messages": [
        {"role": "user", "content": [{"type": "image", "image": "images/local.png"},
                                     {"type": "image", "image": "HTTPS://example.com/b.jpg"}]}],
        "tools": [{"type": "function", "function": {"name": "edit_image", "parameters": {"type": "object"}}}],
        "response": {"content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "edit_image", "arguments": {"image": "https://example.com/b.jpg"}}}]}}
    s1 = schema.parse_sample(url_only, line=1, base_dir=str(tmp_path), require_label=False)
    r1 = build_requests(s1, 64, image_head=True)
    flat = "".join(p.get("text", "") for p in r1.verdict.messages[1]["content"])
    assert "[image: https://example.com/cat.png]" in flat and "[image: gs://bucket/cat_blue.png]" in flat
    assert request_images(r1.verdict.messages) == [] and not r1.has_image and r1.image is None
    s2 = schema.parse_sample(mixed, line=2, base_dir=str(tmp_path), require_label=False)
    r2 = build_requests(s2, 64, image_head=True)
    assert r2.verdict.n_images == r2.image.n_images == 1                    # only the local file is an image
    head = "".join(p.get("text", "") for p in r2.image.messages[1]["content"])
    assert "[edit_image.image: https://example.com/b.jpg] (remote image, not fetched)" in head
    assert "no such image" not in head

    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(url_only) + "\n" + json.dumps(mixed) + "\n")
    out = tmp_path / "elsewhere" / "out.jsonl"
    stats = label_file(str(inp), str(out), _standin_settings(standin, image_endpoint=standin.base_url))
    assert (stats["read"], stats["labelled"], stats["rejected"]) == (2, 2, 0)
    got = {r["id"]: r for r in map(json.loads, open(out))}
    assert got["u1"]["messages"] == url_only["messages"] and got["u1"]["label"]["img"] is None
    assert got["u2"]["messages"][0]["content"][1]["image"] == "HTTPS://example.com/b.jpg"
    assert got["u2"]["messages"][0]["content"][0]["image"] == "../images/local.png"
    assert got["u2"]["response"]["tool_calls"][0]["function"]["arguments"] == {"image": "https://example.com/b.jpg"}
    assert got["u2"]["label_meta"]["image"]["n_images"] == 1


# ================================================================ against the real server


class FaultProxy:
    """Loopback HTTP proxy in front of the teacher. Every `every`-th POST (from the `offset`-th)
    is a fault, in turn: 500, 429 with Retry-After, a stall past the client's timeout, a dropped
    connection, a truncated body (the real reply, cut in half). Records every POST body."""

    KINDS = ("http_500", "http_429", "stall", "drop", "truncate")

    def __init__(self, upstream: str, *, stall_s: float, every: int = 5, offset: int = 2, first_kind: int = 0):
        self.upstream, self.stall_s, self.every, self.offset = upstream, stall_s, every, offset
        self.first_kind = first_kind
        self.lock = threading.Lock()
        self.n = 0
        self.posts: list[tuple[str, dict]] = []      # (fault kind or "ok", request body)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _reply(self, code: int, body: bytes, headers: dict | None = None, cut: bool = False):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                try:
                    self.wfile.write(body[: len(body) // 2] if cut else body)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    return       # the client gave up first (its timeout): nothing to deliver
                if cut:
                    self._hang_up()

            def _hang_up(self):
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def _forward(self, method: str, body: bytes = b"") -> tuple[int, bytes]:
                r = httpx.request(method, proxy.upstream + self.path, content=body or None,
                                  headers={"Content-Type": "application/json"}, timeout=300)
                return r.status_code, r.content

            def do_GET(self):
                self._reply(*self._forward("GET"))

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                kind = proxy.next_kind()
                with proxy.lock:
                    proxy.posts.append((kind, json.loads(body)))
                if kind == "http_500":
                    self._reply(500, b'{"error": {"message": "injected"}}')
                elif kind == "http_429":
                    self._reply(429, b'{"error": {"message": "slow down"}}', {"Retry-After": "1"})
                elif kind == "stall":
                    time.sleep(proxy.stall_s)
                    self._hang_up()
                elif kind == "drop":
                    self._hang_up()
                elif kind == "truncate":
                    code, data = self._forward("POST", body)
                    self._reply(code, data, cut=True)
                else:
                    self._reply(*self._forward("POST", body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def next_kind(self) -> str:
        """The fault for the next POST ("ok" most of the time), in a fixed rotation."""
        with self.lock:
            n, self.n = self.n, self.n + 1
        if n % self.every == self.offset:
            return self.KINDS[(n // self.every + self.first_kind) % len(self.KINDS)]
        return "ok"

    def kinds(self) -> collections.Counter:
        return collections.Counter(k for k, _ in self.posts)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


TIMEOUT_S = 8.0      # the teacher answers at once; the injected stall is longer


@dataclasses.dataclass(frozen=True)
class Teacher:
    url: str          # the server root; the proxy forwards request paths under it
    model_id: str


@pytest.fixture(scope="module")
def teacher():
    """The stand-in teacher over real HTTP: the fault guarantees are the labeller's, whatever the
    teacher thinks (a tiny judge trained for a few steps no longer writes verdict JSON reliably)."""
    with StandinTeacher() as standin_teacher:
        yield Teacher(url=standin_teacher.base_url.removesuffix("/v1"), model_id=standin_teacher.model)


@pytest.fixture(scope="module")
def label_input(tmp_path_factory):
    d = tmp_path_factory.mktemp("label_data")
    samples = synth.generate(synth.SynthConfig(n=30, seed=11), str(d))
    lines = [json.dumps(s) for s in samples]
    lines.insert(7, '{"id": "broken", "messages": [')          # bad rows are rejected, not lost
    lines.insert(15, json.dumps(dict(samples[0])))              # a duplicate id
    (d / "samples.jsonl").write_text("\n".join(lines) + "\n")
    return d, samples


def _ids(path) -> list[str]:
    return [json.loads(x)["id"] for x in open(path)]


@pytest.fixture(scope="module")
def reference_run(teacher, label_input):
    """An uninterrupted, fault-free run: the labels the faulty and killed runs must reproduce."""
    d, _ = label_input
    out = d / "reference.jsonl"
    settings = LabelSettings(endpoints=(teacher.url + "/v1",) * 2, model=teacher.model_id,
                             image_endpoint=teacher.url + "/v1", concurrency=1, thumbnail_edge=40,
                             progress=False, policy=client_lib.RetryPolicy(timeout_s=300))
    stats = label_file(str(d / "samples.jsonl"), str(out), settings)
    return out, stats


@pytest.mark.slow
def test_every_sample_labelled_once_through_faults(teacher, label_input, reference_run):
    d, samples = label_input
    ref_out, ref_stats = reference_run
    assert (ref_stats["read"], ref_stats["labelled"], ref_stats["failed"], ref_stats["rejected"]) == (32, 30, 0, 2)
    stall = TIMEOUT_S + 2
    # Different first faults, so that the three together meet every kind in a short run.
    proxies = [FaultProxy(teacher.url, stall_s=stall, offset=k, first_kind=2 * k) for k in (0, 1, 2)]
    try:
        settings = LabelSettings(endpoints=(proxies[0].url, proxies[1].url), model=teacher.model_id,
                                 image_endpoint=proxies[2].url, concurrency=1, thumbnail_edge=40, progress=False,
                                 policy=client_lib.RetryPolicy(max_retries=12, timeout_s=TIMEOUT_S,
                                                               backoff_initial_s=0.1, backoff_max_s=2.0))
        out = d / "faulty.jsonl"
        stats = label_file(str(d / "samples.jsonl"), str(out), settings)
    finally:
        for p in proxies:
            p.close()
    kinds = sum((p.kinds() for p in proxies), collections.Counter())
    print("proxy requests by outcome", dict(kinds), "stats", {k: stats[k] for k in ("requests", "retried_samples")})
    assert set(FaultProxy.KINDS) <= set(kinds), kinds                   # every fault happened
    n_faults = sum(kinds[k] for k in FaultProxy.KINDS)
    assert 0.15 <= n_faults / sum(kinds.values()) <= 0.25
    assert (stats["read"], stats["labelled"], stats["failed"], stats["rejected"]) == (32, 30, 0, 2)
    ids = _ids(out)
    assert sorted(ids) == sorted(s["id"] for s in samples) and len(set(ids)) == len(ids)
    assert stats["retried_samples"] >= 1 and stats["requests"] > 30
    # Both verdict endpoints took work; the image head only went to its own.
    assert all(sum(1 for _, b in p.posts if b["messages"][0]["content"] != IMAGE_CONTRACT.text) > 3 for p in proxies[:2])
    assert all(b["messages"][0]["content"] == IMAGE_CONTRACT.text for _, b in proxies[2].posts)
    # Same labels as the fault-free run (greedy decoding), with the contract and attempts recorded.
    ref = {json.loads(x)["id"]: json.loads(x) for x in open(ref_out)}
    rows = [json.loads(x) for x in open(out)]
    for row in rows:
        assert row["label"]["l3"] == ref[row["id"]]["label"]["l3"]
        meta = row["label_meta"]
        route = ROUTE_TOOL_CALL if row["response"]["tool_calls"] else ROUTE_TEXT_ONLY
        assert meta["contract_id"] == route and meta["contract_sha256"] == VERDICT_CONTRACTS[route].sha256
        assert meta["teacher_model"] == teacher.model_id and meta["attempts"] >= 1 and meta["latency_s"] > 0
        has_image = meta["n_images"] > 0
        assert (meta["image"] is not None) == has_image
        if not has_image:
            assert row["label"]["img"] is None
        else:   # the image head's score, or null when it declined (recorded)
            assert (row["label"]["img"] is None) == meta["image"]["declined"]
            assert meta["image"]["contract_sha256"] == IMAGE_CONTRACT.sha256 and meta["image"]["attempts"] >= 1
    assert any(r["label_meta"]["attempts"] > 1 for r in rows)
    # What arrived at the image teacher: every image of the sample, as 40-px thumbnails, exactly
    # the request built for it.
    by_id = {s["id"]: s for s in samples}
    arrived = [b for k, b in proxies[2].posts if k == "ok"]
    checked = 0
    for s in samples:
        parsed = schema.parse_sample(s, line=1, base_dir=str(d), require_label=False)
        req = build_requests(parsed, 40, image_head=True).image
        if req is None:
            continue
        match = [b for b in arrived if b["messages"] == req.messages]
        assert match, f"{s['id']}: its image request never arrived intact"
        uris = request_images(match[0]["messages"])
        assert len(uris) == req.n_images >= 1
        assert all(max(_decode(u).size) == 40 for u in uris)   # synthetic images are 48-96 px
        checked += 1
    assert checked >= 5 and len(by_id) == 30


@pytest.mark.slow
def test_kill9_mid_run_then_resume_gives_the_same_set(teacher, label_input, reference_run, tmp_path):
    d, samples = label_input
    ref_out, _ = reference_run
    proxy = FaultProxy(teacher.url, stall_s=TIMEOUT_S + 2)
    out = d / "killed.jsonl"
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "launch.label", f"--input={d / 'samples.jsonl'}", f"--out={out}",
           f"--endpoint={proxy.url}", f"--model={teacher.model_id}", f"--image_endpoint={proxy.url}",
           "--concurrency=1", f"--timeout_s={TIMEOUT_S}", "--max_retries=12", "--thumbnail_edge=40"]
    try:
        n_before = _kill9_once_written(cmd, env, out, rows=8, timeout_s=240)
        assert 8 <= n_before < 30
        with open(out, "ab") as f:     # make sure the repair path runs: a torn tail as kill -9 leaves
            f.write(b'{"id": "p3-s1", "prompt_id": "p3", "mess')
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    finally:
        proxy.close()
    assert res.returncode == 0, res.stderr[-3000:]
    stats = json.load(open(store.stats_path(str(out))))
    assert stats["repaired_torn_bytes"] == len(b'{"id": "p3-s1", "prompt_id": "p3", "mess')
    assert stats["already_labelled"] == n_before and stats["labelled_this_run"] == 30 - n_before
    assert (stats["read"], stats["labelled"], stats["failed"], stats["rejected"]) == (32, 30, 0, 2)
    ids = _ids(out)
    assert len(ids) == len(set(ids)) == 30
    ref = {json.loads(x)["id"]: json.loads(x)["label"] for x in open(ref_out)}
    got = {json.loads(x)["id"]: json.loads(x)["label"] for x in open(out)}
    assert got.keys() == ref.keys()
    assert {k: v["l3"] for k, v in got.items()} == {k: v["l3"] for k, v in ref.items()}


def _kill9_once_written(cmd: list[str], env: dict, out, *, rows: int, timeout_s: float) -> int:
    """Start the labeller ``cmd``, SIGKILL it once ``out`` holds ``rows`` lines; the ids it had
    written whole."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= rows:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the labeller finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return len(_ids_safe(out))


def _ids_safe(path) -> list[str]:
    out = []
    for line in open(path, "rb").read().split(b"\n"):
        try:
            out.append(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError):
            pass
    return out


def test_progress_shows_the_running_fail_rate_by_route():
    t = Tally()
    for route, l3 in [(ROUTE_TEXT_ONLY, "fail")] * 3 + [(ROUTE_TEXT_ONLY, "pass")] + [(ROUTE_TOOL_CALL, "pass")] * 9 \
            + [(ROUTE_TOOL_CALL, "fail")]:
        t.add_labelled(route, l3, this_run=True)
    t.add_labelled(ROUTE_TOOL_CALL, "fail", this_run=False)     # an earlier run's: not in the running rate
    t.failed["timeout"] += 2
    assert t.progress_text() == "tool_call fail 10.0% of 10 | text_only fail 75.0% of 4 | errors 2 | rejected 0"
    assert t.routes[ROUTE_TOOL_CALL].labelled == 11


def test_reference_reply_never_reaches_judge_or_teacher(many_images):
    """validate_labels measures against reference_reply; neither the judge's input (the renderer)
    nor the teacher's request may contain it, or the check and the shortcut baseline break."""
    d, obj, _ = many_images
    text_obj = dict(obj, response={"content": "Done.", "tool_calls": []})
    plain = schema.parse_sample(text_obj, line=1, base_dir=str(d), require_label=False)
    with_ref = schema.parse_sample(dict(text_obj, reference_reply="ZQX-went-out-online"), line=1, base_dir=str(d),
                                   require_label=False)
    assert with_ref.reference_reply == "ZQX-went-out-online"
    assert build_transcript(with_ref).parts == build_transcript(plain).parts
    a, b = build_requests(with_ref, 64, True), build_requests(plain, 64, True)
    assert a.verdict.messages == b.verdict.messages and a.image.messages == b.image.messages
    assert "ZQX" not in json.dumps(a.verdict.messages + a.image.messages)


def test_connection_errors_use_the_whole_retry_budget():
    async def go():
        pool = client_lib.TeacherPool([UNREACHABLE, UNREACHABLE], "m", concurrency=1,
                                      policy=client_lib.RetryPolicy(max_retries=3, timeout_s=2, backoff_initial_s=0.01,
                                                                    backoff_max_s=0.02))
        try:
            with pytest.raises(client_lib.TeacherError) as e:
                await pool.complete([{"role": "user", "content": "x"}], parse_verdict)
            return e.value, pool.endpoint_stats()
        finally:
            await pool.aclose()
    err, eps = asyncio.run(go())
    assert (err.code, err.attempts) == ("connection_error", 4)
    assert [e["requests"] for e in eps] == [2, 2]          # attempts spread over both endpoints


def test_a_failing_endpoint_is_picked_last(standin):
    """After one failed attempt an endpoint gets no more work while another answers, even a busy
    one; healthy endpoints take turns."""
    policy = client_lib.RetryPolicy(max_retries=2, timeout_s=30, backoff_initial_s=0.01, backoff_max_s=0.02)
    messages = [{"role": "user", "content": "x"}]

    async def go(urls: list[str], concurrent: int) -> list[dict]:
        pool = client_lib.TeacherPool(urls, standin.model, concurrency=2, policy=policy)
        try:
            # The first attempt goes to the first endpoint (all equal, the turn starts there).
            first = await pool.complete(messages, parse_verdict)
            await asyncio.gather(*(pool.complete(messages, parse_verdict) for _ in range(concurrent)))
        finally:
            await pool.aclose()
        return [first.attempts, *pool.endpoint_stats()]
    attempts, dead, live = asyncio.run(go([UNREACHABLE, standin.base_url], concurrent=6))
    # one attempt on the dead endpoint, then every request on the live one, though it is busy
    assert attempts == 2
    assert (dead["requests"], dead["failed_requests"]) == (1, 1)
    assert (live["requests"], live["failed_requests"]) == (7, 0)
    _, *both = asyncio.run(go([standin.base_url, standin.base_url], concurrent=3))
    assert sorted(e["requests"] for e in both) == [2, 2]          # round robin among equals
