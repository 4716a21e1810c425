"""Preference contract, pair build (filtering with reasons, prefix identity, prompt-grouped splits),
packing, and the benchmark-format readers on small files built here."""

import json
import os

import numpy as np
import pytest
from PIL import Image

from rm_jax.rm import benchmarks, build, pair_loader, pair_records, synth_prefs
from rm_jax.rm import data as data_lib
from rm_jax.rm.prefs import expand_ranking
from rm_jax.rm.render import RMRenderer


def test_expand_ranking():
    pairs = expand_ranking([0, 1, None, 0])
    got = {(q.a, q.b): q.p for q in pairs}
    assert got == {(0, 1): 1.0, (0, 3): 0.5, (1, 3): 0.0}


def _line(pid, responses, **extra):
    return {"id": pid, "prompt_id": pid, "messages": [{"role": "user", "content": "draw a red star please"}],
            "candidates": [{"response": {"content": r}} for r in responses], **extra}


@pytest.fixture(scope="module")
def mcfg_text(tiny_cfg):
    from rm_jax.run_config import model_config, parse
    return model_config(parse(tiny_cfg))


@pytest.fixture(scope="module")
def built(renderer, tmp_path_factory):
    d = tmp_path_factory.mktemp("prefs")
    long = "word " * 400
    lines = [_line(f"q{k}", ["Done: a red star.", "Here is a blue star.", "A red star, 2K."],
                   pairs=[{"a": 0, "b": 1, "p": 1}, {"a": 0, "b": 2, "p": 0.5}, {"a": 2, "b": 1, "p": 0.8, "weight": 2}])
             for k in range(30)]
    lines.append(_line("long", ["short answer", long], pairs=[{"a": 0, "b": 1, "p": 1}]))
    lines.append(_line("ranked", ["a", "b", "c"]) | {"candidates": [
        {"response": {"content": "x"}, "rank": 0}, {"response": {"content": "y"}, "rank": 1},
        {"response": {"content": "z"}, "rank": 1}]})
    bad = [_line("bad_pair", ["a", "b"], pairs=[{"a": 0, "b": 0, "p": 1}]),
           _line("one", ["a"], pairs=[]), _line("no_labels", ["a", "b"])]
    with open(d / "prefs.jsonl", "w") as f:
        for x in lines + bad:
            f.write(json.dumps(x) + "\n")
        f.write("{not json\n")
    out = d / "built"
    stats = build.build(str(d / "prefs.jsonl"), str(out), RMRenderer(renderer),
                        build.PairBuildOptions(max_len=512, heldout_fraction=0.2, calibration_fraction=0.2))
    return str(out), stats


def test_build_counts_and_reasons(built):
    out, stats = built
    assert stats["read"] == 36 and stats["kept"] == 31 and stats["rejected"] == 5
    assert stats["rejected_by_reason"] == {"bad_pair": 1, "too_few_candidates": 1, "no_pairs": 1, "bad_json": 1,
                                           "no_pairs_kept": 1}
    # the long candidate's pair is filtered, never truncated, and counted on the rejected side
    assert stats["pairs_filtered_by_reason"] == {"overlength": 1}
    assert stats["overlength_filter_rate"] == pytest.approx(1 / stats["pairs_read"])
    assert stats["rejected_truncation_rate"] == pytest.approx(1 / stats["pairs_read"])
    assert stats["chosen_truncation_rate"] == 0 and stats["missing_eos_rate"] == 0
    assert sum(s["prompts"] for s in stats["splits"].values()) == 31   # "long" kept no pair: rejected
    rejects = [json.loads(x) for x in open(os.path.join(out, "rejects.jsonl"))]
    assert {r["reason"] for r in rejects} >= {"bad_pair", "bad_json", "no_pairs_kept"}


def test_splits_grouped_and_prefix_shared(built, renderer):
    out, stats = built
    seen = {}
    for s in build.SPLITS:
        sp = data_lib.load_split(out, s)
        for g in sp.groups:
            assert g["prompt_id"] not in seen
            seen[g["prompt_id"]] = s
        for g, cands in enumerate(sp.group_candidates()):
            prompts = [sp.ids(c)[:sp.prompt_len[c]] for c in cands]
            assert all(np.array_equal(p, prompts[0]) for p in prompts)
            for c in cands:
                assert sp.ids(c)[-1] == renderer.eos_id            # the reward position's token
        assert np.all(sp.group[sp.pair_a] == sp.pair_group) and np.all(sp.group[sp.pair_b] == sp.pair_group)
    assert {"train", "calibration", "heldout"} == set(seen.values())


def _loader_cfg(**kw):
    base = dict(groups=4, rows=16, pairs=12, length=512, max_patches=64, max_images=4, frame_capacity=64, seed=3)
    return pair_loader.PairLoaderConfig(**(base | kw))


def _ids(batch):
    return [g["id"] for g in batch]


def test_split_round_trips_through_records(built):
    """The flat split read back from the group records holds every kept pair with its own group's
    candidates, and the index counts what the records hold."""
    out, stats = built
    for s in build.SPLITS:
        sp = data_lib.load_split(out, s)
        idx = pair_records.load_index(out, s)
        assert len(sp.groups) == len(idx["n_candidates"]) == stats["splits"][s]["prompts"]
        assert len(sp.pair_a) == idx["n_pairs"].sum() == stats["splits"][s]["pairs"]
        assert sp.n_candidates == idx["n_candidates"].sum() == stats["splits"][s]["candidates"]
        for c in range(sp.n_candidates):
            assert sp.length(c) == sp.prompt_len[c] + sp.response_len[c]


def test_loader_processes_slice_the_one_process_stream(built):
    """Two processes' microbatches, in process order, are the one-process microbatches (ids and
    the token rows they place), over more than one epoch."""
    out, _ = built
    one = pair_loader.make_iterator(pair_loader.make_dataset(out, "train", _loader_cfg()))
    two = [pair_loader.make_iterator(pair_loader.make_dataset(out, "train", _loader_cfg(process_index=p,
                                                                                        process_count=2)))
           for p in range(2)]
    n_groups = len(pair_records.load_index(out, "train")["n_candidates"])
    seen = []
    for _ in range(2 * n_groups // 4 + 1):
        whole, halves = next(one), [next(it) for it in two]
        assert _ids(whole) == _ids(halves[0]) + _ids(halves[1])
        seen += _ids(whole)
    assert set(seen[:n_groups]) == set(seen[n_groups:2 * n_groups])   # epochs cover every group once
    assert seen[:n_groups] != seen[n_groups:2 * n_groups]             # and are reshuffled


def test_micro_arrays_keep_groups_in_their_slots(built, mcfg_text):
    out, _ = built
    cfg = _loader_cfg()
    groups = next(pair_loader.make_iterator(pair_loader.make_dataset(out, "train", cfg)))
    pdim = pair_loader.patch_dim(mcfg_text)
    m = pair_loader.micro_arrays(groups, cfg, mcfg_text, pad_id=0, patch_dim=pdim, micro_index=1)
    ids, resp = np.asarray(m["inputs"].input_ids_bt), m["response_mask"]
    R, Q = cfg.rows_per_group, cfg.pairs_per_group
    for k, g in enumerate(groups):
        for c in range(len(g["prompt_len"])):
            seq = g["tokens"][g["offsets"][c]:g["offsets"][c + 1]]
            assert np.array_equal(ids[k * R + c, :len(seq)], seq)
            assert resp[k * R + c].sum() == g["response_len"][c]
        n = len(g["pair_a"])
        assert np.array_equal(m["pair_a"][k * Q:k * Q + n], k * R + g["pair_a"])
        assert m["pair_valid"][k * Q:k * Q + n].all() and not m["pair_valid"][k * Q + n:(k + 1) * Q].any()
        assert set(m["pair_group"][k * Q:k * Q + n]) == {1 * cfg.groups + k}
    # process 1 of 2 places the second half of the groups at the global rows after process 0's
    half = _loader_cfg(process_index=1, process_count=2)
    m1 = pair_loader.micro_arrays(groups[2:], half, mcfg_text, pad_id=0, patch_dim=pdim)
    assert np.array_equal(np.asarray(m1["inputs"].input_ids_bt), ids[8:])
    assert np.array_equal(m1["pair_a"], m["pair_a"][6:])


def test_loader_resume_is_exact(built):
    out, _ = built
    ds = pair_loader.make_dataset(out, "train", _loader_cfg())
    it = pair_loader.make_iterator(ds)
    for _ in range(3):
        next(it)
    state = it.get_state()
    want = [_ids(next(it)) for _ in range(4)]
    resumed = pair_loader.make_iterator(pair_loader.make_dataset(out, "train", _loader_cfg()), state)
    assert [_ids(next(resumed)) for _ in range(4)] == want


def test_loader_refuses_a_group_over_its_slot(built):
    out, _ = built
    with pytest.raises(ValueError, match="over the slot of rows/groups=2.*raise rm.rows"):
        pair_loader.make_dataset(out, "train", _loader_cfg(rows=8))
    with pytest.raises(ValueError, match="multiples of rm.groups"):
        _loader_cfg(rows=10)


def test_synth_groups_become_rankings(synth_dir):
    samples = [json.loads(x) for x in open(os.path.join(synth_dir, "samples.jsonl"))]
    lines = synth_prefs.preference_lines(samples)
    assert lines and all(len(x["candidates"]) >= 2 for x in lines)
    for x in lines[:20]:
        group = [s for s in samples if s["prompt_id"] == x["prompt_id"]]
        assert [c["rank"] for c in x["candidates"]] == [int(s["label"]["l3"] == "fail") for s in group]


def _png(path):
    Image.new("RGB", (32, 24), (200, 20, 20)).save(path)


def test_benchmark_readers(tmp_path):
    score = lambda samples: np.asarray([len(s.response.content) for s in samples], float)   # longer = better
    rows = {
        "rewardbench": [{"id": "1", "prompt": "q", "chosen": "long answer", "rejected": "no", "subset": "chat"},
                        {"id": "2", "prompt": "q", "chosen": "no", "rejected": "long answer", "subset": "chat"},
                        {"id": "3", "prompt": "q", "chosen": "longer", "rejected": "short", "subset": "math"},
                        {"id": "4", "prompt": "q", "rejected": "x", "subset": "math"}],
        "rewardbench2": [{"id": "1", "prompt": "q", "chosen": ["the best one"], "rejected": ["a", "bb", "ccc"],
                          "subset": "Focus"},
                         {"id": "2", "prompt": "q", "chosen": ["ok"], "rejected": ["a", "much longer", "c"],
                          "subset": "Focus"},
                         {"id": "tied:3", "prompt": "q", "chosen": ["tie one", "tie two"], "rejected": ["t"],
                          "subset": "Ties"},
                         {"id": "3", "prompt": "q", "chosen": ["a"], "rejected": ["b"], "subset": "Ties"}],
        "vl_rewardbench": [{"id": "1", "query": "what?", "image": "img.png", "response": ["short", "a long one"],
                            "human_ranking": [1, 0]},
                           {"id": "2", "query": "what?", "image": "missing.png", "response": ["a", "b"],
                            "human_ranking": [0, 1]}],
        "mm_rewardbench": [{"id": "1", "Text": "q", "Image": "img.png", "Output1": "yes indeed", "Output2": "no",
                            "Better": "Output2", "Category": "coco"},
                           {"id": "2", "Text": "q", "Image": "img.png", "Output1": "yes indeed", "Output2": "no",
                            "Better": "Output1", "Category": "coco"},
                           {"id": "3", "Text": "q", "Image": "img.png", "Output1": "a", "Output2": "b", "Better": "3"}],
    }
    _png(tmp_path / "img.png")
    expect = {"rewardbench": (3, 1, 2 / 3, 0.5), "rewardbench2": (3, 1, 2 / 3, 2 / 4),
              "vl_rewardbench": (1, 1, 1.0, 0.5), "mm_rewardbench": (2, 1, 0.5, 1 / 3)}
    for fmt, data in rows.items():
        path = tmp_path / f"{fmt}.jsonl"
        with open(path, "w") as f:
            for r in data:
                f.write(json.dumps(r) + "\n")
            if fmt == "rewardbench":
                f.write("{broken\n")
        items, failures = benchmarks.read(fmt, str(path))
        res = benchmarks.accuracy(fmt, items, failures, score)
        n, n_fail, acc, acc_all = expect[fmt]
        if fmt == "rewardbench":
            n_fail += 1
            acc_all = 2 / 5
        assert (res["n"], res["parse_failures"]) == (n, n_fail), fmt
        assert res["accuracy"] == pytest.approx(acc), fmt
        assert res["accuracy_counting_failures"] == pytest.approx(acc_all), fmt
    items, _ = benchmarks.read("rewardbench", str(tmp_path / "rewardbench.jsonl"))
    res = benchmarks.accuracy("rewardbench", items, [], score)
    assert res["by_subset"] == {"chat": {"accuracy": 0.5, "n": 2}, "math": {"accuracy": 1.0, "n": 1}}
    assert res["subset_mean"] == pytest.approx(0.75)
    _, failures = benchmarks.read("rewardbench2", str(tmp_path / "rewardbench2.jsonl"))
    assert [f["reason"] for f in failures] == ["bad_ties_id"]
    vl, _ = benchmarks.read("vl_rewardbench", str(tmp_path / "vl_rewardbench.jsonl"))
    assert vl[0].samples[0].images and vl[0].chosen == [1]


def _item(rid, subset, n_chosen, n_rejected):
    return benchmarks.BenchItem(rid, subset, [None] * (n_chosen + n_rejected), list(range(n_chosen)),
                                list(range(n_chosen, n_chosen + n_rejected)))


def test_rewardbench_sections_weight_by_leaderboard_counts():
    """Each section is its subsets' accuracies weighted by the leaderboard's example counts (math-prm
    at 984, as much as the six code subsets); the score is the mean of the four sections."""
    rng = np.random.default_rng(0)
    acc = {s: float(rng.uniform()) for s in benchmarks.RB1_EXAMPLE_COUNTS}
    got = benchmarks.rewardbench_sections(acc | {"shp": 0.0})
    hep = [s for s in acc if s.startswith("hep-")]
    reasoning = (984 * acc["math-prm"] + 164 * sum(acc[s] for s in hep)) / (984 + 164 * 6)
    assert got["sections"]["Reasoning"] == pytest.approx(reasoning)
    assert got["sections"]["Reasoning"] == pytest.approx(0.5 * acc["math-prm"] + 0.5 * np.mean([acc[s] for s in hep]))
    chat = ["alpacaeval-easy", "alpacaeval-length", "alpacaeval-hard", "mt-bench-easy", "mt-bench-med"]
    w = np.asarray([100, 95, 95, 28, 40])
    assert got["sections"]["Chat"] == pytest.approx(float(np.dot(w, [acc[s] for s in chat]) / w.sum()))
    assert got["score"] == pytest.approx(np.mean(list(got["sections"].values())))
    assert got["outside_sections"] == ["shp"]                       # a prior set: never in the score
    partial = benchmarks.rewardbench_sections({"math-prm": 1.0, "hep-go": 0.0})
    assert partial["sections"] == {"Reasoning": pytest.approx(984 / (984 + 164))} and np.isnan(partial["score"])
    # through accuracy(): a plain subset mean differs from the weighted section
    items = [_item(f"{s}{k}", s, 1, 1) for s, n in (("math-prm", 1), ("hep-go", 3)) for k in range(n)]
    rewards = {"math-prm": [1.0, 0.0], "hep-go": [0.0, 1.0]}
    res = benchmarks.accuracy("rewardbench", items, [], lambda xs: np.concatenate(
        [rewards[it.subset] for it in items]))
    assert res["subset_mean"] == pytest.approx(0.5)
    assert res["leaderboard"]["sections"]["Reasoning"] == pytest.approx(984 / 1148)


def test_rewardbench2_ties_score_by_hand():
    """Two prompts, each as ref (1 correct, 2 wrong) and tied (2 correct, 2 wrong)."""
    items = [_item("ref:0", "Ties", 1, 2), _item("tied:0", "Ties", 2, 2),
             _item("ref:1", "Ties", 1, 2), _item("tied:1", "Ties", 2, 2), _item("f", "Focus", 1, 3)]
    r = [np.array([3.0, 1.0, 0.5]),            # ref gap 2
         np.array([5.0, 4.0, 2.0, 1.0]),       # tied: spread 1, gap 2
         np.array([1.0, 2.0, 0.0]),            # ref wrong: gap -1
         np.array([3.0, 2.5, 2.0, 0.0]),       # tied: spread 0.5, gap 0.5
         np.array([1.0, 0.0, 0.5, 2.0])]       # Focus wrong
    res = benchmarks.accuracy("rewardbench2", items, [], lambda xs: np.concatenate(r))
    t = res["ties"]
    assert (t["ref_accuracy"], t["tied_accuracy"]) == (0.5, 1.0)
    # tied gap > spread: prompt 0 (2 > 1) yes, prompt 1 (0.5 > 0.5) no; with min(ref, tied) gap: 0 yes, 1 no
    assert (t["correctness_preferred"], t["correctness_preferred_hard"]) == (0.5, 0.5)
    margin = np.mean([np.tanh(2 / 1 - 1), np.tanh(-1 / 0.5 - 1)])
    assert t["correctness_margin_score"] == pytest.approx(margin)
    assert t["score"] == pytest.approx(0.3 * 1.0 + 0.3 * 0.5 + 0.2 * 0.5 + 0.2 * 0.5 + 0.01 * margin)
    assert res["subset_scores"] == {"Focus": 0.0, "Ties": pytest.approx(t["score"])}
    assert res["score"] == pytest.approx(t["score"] / 2)
