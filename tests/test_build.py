"""Build: counts add up, no split leakage, oversampling recorded, bad input gets reasons."""

import dataclasses
import json
import os

import numpy as np
import pytest

from rm_jax.data import build, records


def _ids(data_dir, split):
    import grain
    src = grain.sources.ArrayRecordDataSource(records.shard_paths(data_dir, split))
    return [records.decode(src[i]) for i in range(len(src))]


def test_build_stats_and_splits(built_shards, synth_dir):
    out, result = built_shards
    s = result.stats
    n_lines = sum(1 for line in open(os.path.join(synth_dir, "samples.jsonl")) if line.strip())
    assert s["read"] == n_lines == s["kept"] + s["rejected"]
    assert sum(s["rejected_by_reason"].values()) == s["rejected"]
    assert len(open(os.path.join(out, "rejects.jsonl")).readlines()) == s["rejected"]
    train, held = _ids(out, "train"), _ids(out, "heldout")
    assert len(train) + len(held) == s["kept"] and held
    assert not ({r["prompt_id"] for r in train} & {r["prompt_id"] for r in held})
    assert len({r["id"] for r in train + held}) == s["kept"]          # stored once, never duplicated
    o = s["oversampling"]
    n_fail = sum(r["label"] for r in train)
    assert (o["train_fail"], o["stream_fail"], o["factor"]) == (n_fail, 3 * n_fail, 3)
    bal = s["label_balance"]
    assert sum(b["pass"] + b["fail"] for b in bal.values()) == s["kept"]
    m = json.load(open(os.path.join(out, "manifest.json")))
    assert m["verdict_tokens"]["pass_id"] != m["verdict_tokens"]["fail_id"]
    assert len(m["input_sha256"]) == 64 and len(m["tokenizer_sha256"]) == 64 and len(m["chat_template_sha256"]) == 64
    for r in train[:20]:   # loss mask covers exactly the target, which starts with the slot prefix
        assert r["target_mask"][r["verdict_pos"]] == 1 and r["target_mask"][: r["verdict_pos"] - 8].sum() == 0
        assert r["input_ids"][r["verdict_pos"]] == (m["verdict_tokens"]["fail_id"] if r["label"]
                                                   else m["verdict_tokens"]["pass_id"])


def _bad_input(synth_dir, tmp_path):
    good = [json.loads(line) for line in open(os.path.join(synth_dir, "samples.jsonl"))][:6]
    os.symlink(os.path.join(synth_dir, "images"), tmp_path / "images")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    lines = [json.dumps(g) for g in good]
    bad = []
    bad.append('{"id": "bad-json", "messages": [')
    bad.append(json.dumps({"id": "no-response", "messages": [{"role": "user", "content": "x"}],
                           "label": {"l3": "pass"}}))
    g = dict(good[0], id="bad-role", messages=[{"role": "narrator", "content": "x"}])
    bad.append(json.dumps(g))
    g = dict(good[0], id="no-image", messages=[{"role": "user", "content": [{"type": "image", "image": "nope.png"}]}])
    bad.append(json.dumps(g))
    g = dict(good[0], id="corrupt-image",
             messages=[{"role": "user", "content": [{"type": "image", "image": "broken.png"}]}])
    bad.append(json.dumps(g))
    g = dict(good[0], id="empty-response", response={"content": "", "tool_calls": []})
    bad.append(json.dumps(g))
    g = dict(good[0], id="bad-verdict", label={"l3": "ok", "reason": "", "issues": [], "img": None})
    bad.append(json.dumps(g))
    g = dict(good[0], id="bad-img", label={"l3": "pass", "reason": "", "issues": [], "img": 12})
    bad.append(json.dumps(g))
    args = {"prompt": "a red circle"}
    for _ in range(5):
        args = json.dumps(args)
    five = dict(good[0], id="five-times", response={"content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "generate_image", "arguments": args}}]})
    body = "\n".join(lines + bad + [json.dumps(five)]).encode() + b'\n{"id": "latin1", "x": "caf\xe9"}\n'
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(body)
    return str(path), [g["id"] for g in good]


def test_bad_input_every_row_accounted(tiny_cfg, synth_dir, renderer, tmp_path):
    path, good_ids = _bad_input(synth_dir, tmp_path)
    out = tmp_path / "shards"
    # Room for every good row: this test is about malformed rows, not length (test_too_long_...).
    opts = dataclasses.replace(build.BuildOptions.from_config(tiny_cfg.data), max_len=1024)
    result = build.build(path, str(out), renderer, opts, progress=False)
    s = result.stats
    assert s["read"] == 6 + 8 + 1 + 1 == s["kept"] + s["rejected"]
    assert s["rejected_by_reason"] == {"corrupt_image": 1, "empty_response": 1, "invalid_label": 2,
                                       "malformed_json": 1, "missing_field": 1, "missing_image": 1,
                                       "non_utf8": 1, "unknown_role": 1}
    assert s["flagged_by_reason"] == {"args_undecodable": 1}
    rejects = [json.loads(line) for line in open(out / "rejects.jsonl")]
    assert len(rejects) == s["rejected"] and all(r["reason"] and r["line"] for r in rejects)
    assert {r["id"] for r in rejects if r["id"]} >= {"bad-role", "no-image", "corrupt-image", "empty-response",
                                                     "bad-verdict", "bad-img", "no-response"}
    kept = {r["id"] for split in records.SPLITS for r in _ids(str(out), split)}
    assert kept == set(good_ids) | {"five-times"}


def test_too_long_rejected_not_truncated(tiny_cfg, synth_dir, renderer, tmp_path):
    full = build.build(os.path.join(synth_dir, "samples.jsonl"), str(tmp_path / "all"), renderer,
                       build.BuildOptions.from_config(tiny_cfg.data), progress=False).stats
    limit = full["lengths"]["total_tokens_max"] - 1      # the longest sample no longer fits
    opts = dataclasses.replace(build.BuildOptions.from_config(tiny_cfg.data), max_len=limit)
    s = build.build(os.path.join(synth_dir, "samples.jsonl"), str(tmp_path / "cut"), renderer, opts, progress=False).stats
    assert s["rejected_by_reason"].get("too_long", 0) > 0
    assert 0 < s["over_max_len_share"] <= 1
    assert s["lengths"]["total_tokens_max"] <= limit
    assert s["kept"] + s["rejected_by_reason"]["too_long"] == full["kept"]


def test_no_valid_rows_fails_clearly(renderer, tiny_cfg, tmp_path):
    import pytest
    p = tmp_path / "bad.jsonl"
    p.write_text("{nope\n")
    with pytest.raises(ValueError, match="no valid rows"):
        build.build(str(p), str(tmp_path / "o"), renderer, build.BuildOptions.from_config(tiny_cfg.data),
                    progress=False)
    assert (tmp_path / "o" / "rejects.jsonl").read_text().count("malformed_json") == 1


def test_shards_are_bounded(tiny_cfg, synth_dir, renderer, tmp_path):
    import dataclasses
    opts = dataclasses.replace(build.BuildOptions.from_config(tiny_cfg.data), shard_max_bytes=200_000)
    build.build(os.path.join(synth_dir, "samples.jsonl"), str(tmp_path), renderer, opts, progress=False)
    paths = records.shard_paths(str(tmp_path), "train")
    assert len(paths) > 1
    assert np.sum([len(_ids(str(tmp_path), "train"))]) == len(records.load_index(str(tmp_path), "train")["label"])


def test_rebuild_into_the_same_folder_leaves_no_stale_shards(tiny_cfg, synth_dir, renderer, tmp_path):
    """Readers take every shard file in the folder, so a rebuild (here: fewer, larger shards)
    must remove the earlier build's; files that are not build outputs stay. A file as --out is
    refused."""
    src = os.path.join(synth_dir, "samples.jsonl")
    out = tmp_path / "shards"
    small = dataclasses.replace(build.BuildOptions.from_config(tiny_cfg.data), shard_max_examples=4)
    build.build(src, str(out), renderer, small, progress=False)
    assert len(records.shard_paths(str(out), "train")) > 1
    (out / "notes.txt").write_text("mine")
    build.build(src, str(out), renderer, build.BuildOptions.from_config(tiny_cfg.data), progress=False)
    for split in records.SPLITS:
        assert len(records.shard_paths(str(out), split)) == 1
        assert len(_ids(str(out), split)) == len(records.load_index(str(out), split)["label"])
    assert (out / "notes.txt").read_text() == "mine"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        build.build(src, str(tmp_path / "afile"), renderer, small, progress=False)


def _tree_hashes(root) -> dict[str, str]:
    import hashlib
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def chunked_input(synth_dir, tmp_path_factory):
    """60 synthetic rows plus a blank line, a bad row and an id that repeats one of an earlier
    chunk, cut into 16-line chunks (so 2 hosts each build several)."""
    rows = open(os.path.join(synth_dir, "samples.jsonl")).read().splitlines()[:60]
    rows[20:20] = ["", "{broken"]
    rows.append(rows[3])              # chunk 3 repeats an id of chunk 0: the first occurrence wins
    d = tmp_path_factory.mktemp("chunked")
    os.symlink(os.path.join(synth_dir, "images"), d / "images")
    path = d / "samples.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def test_output_identical_whatever_workers_and_hosts(tiny_cfg, renderer, chunked_input, tmp_path):
    """The acceptance equality: N=1 vs N=2 worker processes and k=1 vs k=2 hosts write the same
    bytes (shards, indexes, stats, rejects, manifest, parts), and a later slice's duplicate of an
    earlier slice's id is rejected as one reader would."""
    opts = dataclasses.replace(build.BuildOptions.from_config(tiny_cfg.data), shard_max_examples=16)
    ref = build.build(chunked_input, str(tmp_path / "n1k1"), renderer, opts, progress=False)
    assert ref.stats["chunks"] == 4 and ref.stats["read"] == 60 + 1 + 1
    assert ref.stats["rejected_by_reason"] == {"duplicate_id": 1, "malformed_json": 1}
    assert build.build(chunked_input, str(tmp_path / "n2k1"), renderer, opts, progress=False, num_workers=2)
    # Slice 1 finishes first (nothing to merge yet); slice 0 completes the set and merges.
    assert build.build(chunked_input, str(tmp_path / "n1k2"), renderer, opts, progress=False,
                       shard_index=1, num_shards=2) is None
    assert not (tmp_path / "n1k2" / "stats.json").exists()
    assert build.build(chunked_input, str(tmp_path / "n1k2"), renderer, opts, progress=False,
                       shard_index=0, num_shards=2)
    want = _tree_hashes(tmp_path / "n1k1")
    assert sum(records.is_shard_file(f, "train") for f in want) == 4
    assert _tree_hashes(tmp_path / "n2k1") == want
    assert _tree_hashes(tmp_path / "n1k2") == want
    # The same split as a one-pass reading: every kept id once, prompts never in both splits.
    kept = {s: [r["id"] for r in _ids(str(tmp_path / "n1k1"), s)] for s in records.SPLITS}
    rows = [json.loads(line) for line in open(chunked_input) if line.strip() and line != "{broken\n"]
    assert sorted(kept["train"] + kept["heldout"]) == sorted({r["id"] for r in rows})
    for s in records.SPLITS:
        assert all(build.split_of(r["prompt_id"], opts.heldout_fraction, opts.split_seed) == s
                   for r in rows if r["id"] in kept[s])


def test_merge_alone_and_refusals(tiny_cfg, renderer, chunked_input, tmp_path):
    """`merge` rebuilds the reports from the slices' parts; it refuses while a chunk is missing or
    was built from another input."""
    opts = dataclasses.replace(build.BuildOptions.from_config(tiny_cfg.data), shard_max_examples=16)
    out = tmp_path / "out"
    assert build.build(chunked_input, str(out), renderer, opts, progress=False, shard_index=0, num_shards=2) is None
    with pytest.raises(ValueError, match=r"chunks \[1, 3\] of 4 are not built"):
        build.merge(chunked_input, str(out), renderer, opts)
    whole = build.build(chunked_input, str(out), renderer, opts, progress=False, shard_index=1, num_shards=2)
    want = _tree_hashes(out)
    for name in ("stats.json", "manifest.json", "rejects.jsonl", "train_index.npz", "heldout_index.npz"):
        (out / name).unlink()
    assert build.merge(chunked_input, str(out), renderer, opts).stats == whole.stats
    assert _tree_hashes(out) == want
    # A changed input: every part is stale, so nothing is merged from the earlier build.
    other = tmp_path / "other.jsonl"
    other.write_text(open(chunked_input).read().replace('"pass"', '"fail"', 1))
    with pytest.raises(ValueError, match=r"chunks \[0, 1, 2, 3\] of 4 are not built"):
        build.merge(str(other), str(out), renderer, opts)
