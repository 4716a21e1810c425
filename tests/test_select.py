"""Active selection (launch.select): middle zone first, then standardised disagreement, stratified
by route, near-duplicates of one prompt dropped; the output is a valid launch.label input.

The ordering rules run on score files written for the synthetic samples (P(pass) drawn so that
every rule has something to decide); one end-to-end test scores the samples with a real (random
init) judge through launch.score's function and selects from its output and sidecar.
"""

import json
import math
import os

import numpy as np
import pytest

from rm_jax.data.schema import Sample, read_samples
from rm_jax.eval import active
from serve_fixtures import make_judge_workdir


@pytest.fixture(scope="module")
def samples(synth_dir):
    return [s for s in read_samples(os.path.join(synth_dir, "samples.jsonl")) if isinstance(s, Sample)]


def _write_scores(path, scores):
    with open(path, "w") as f:
        for i, p in scores.items():
            f.write(json.dumps({"id": i, "p_pass": p} if p is not None else {"id": i, "error": "too_long"}) + "\n")


def test_allocate_and_near_duplicates():
    assert active.allocate(10, {"tool_call": 60, "text_only": 40}) == {"tool_call": 6, "text_only": 4}
    assert active.allocate(5, {"tool_call": 2, "text_only": 1}) == {"tool_call": 2, "text_only": 1}
    assert sum(active.allocate(7, {"tool_call": 33, "text_only": 34}).values()) == 7
    assert active.near_duplicate("done: 2 images of a red square.", "done: 2 images of a red square!")
    assert not active.near_duplicate("done: 2 images of a red square.", "sorry, i cannot do that today")


def test_disagreement_is_standardised_on_the_shared_ids():
    rng = np.random.default_rng(0)
    ids = [f"s{i}" for i in range(50)]
    z = rng.normal(size=50)
    first = {i: float(1 / (1 + np.exp(-v))) for i, v in zip(ids, z)}
    # the second judge: the same ranking, 3x as confident, shifted -> no disagreement once standardised
    second = {i: float(1 / (1 + np.exp(-(3 * v - 1)))) for i, v in zip(ids, z)}
    second["extra"] = 0.5
    gap = active.standardised_disagreement(first, second)
    assert set(gap) == set(ids) and max(gap.values()) < 1e-4


def test_selection_order_strata_and_label_input(samples, synth_dir, tmp_path):
    rng = np.random.default_rng(1)
    first = {s.id: float(rng.random()) for s in samples}
    second = {s.id: float(rng.random()) for s in samples}
    first[samples[0].id] = None                         # an error row is not a candidate
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write_scores(a, first)
    _write_scores(b, second)
    out = tmp_path / "picked" / "next.jsonl"             # another folder: image paths are rewritten
    budget = 30
    stats = active.select_file([str(a), str(b)], budget, str(out), input_path=os.path.join(synth_dir, "samples.jsonl"))
    picked = stats["picked"]
    assert stats["selected"] == len(picked) == budget and stats["not_scored"] == 1
    assert stats["candidates"] == len(samples) - 1
    # stratified: each route's share of the budget follows its share of the candidates (within 1)
    for route, n in stats["by_route"].items():
        assert abs(n - budget * stats["candidates_by_route"][route] / stats["candidates"]) <= 1
    by_id = {s.id: s for s in samples}
    for route in active.ROUTES:
        mine = [p for p in picked if p["route"] == route]
        whys = [p["why"] for p in mine]
        assert whys == sorted(whys, key=lambda w: w != "middle_zone")          # middle zone first
        mid = [abs(p["p_pass"] - 0.5) for p in mine if p["why"] == "middle_zone"]
        assert mid == sorted(mid) and all(0.2 <= p["p_pass"] <= 0.8 for p in mine if p["why"] == "middle_zone")
        dis = [p["disagreement"] for p in mine if p["why"] == "disagreement"]
        assert dis == sorted(dis, reverse=True)
        assert all((by_id[p["id"]].response.calls_tools) == (route == "tool_call") for p in mine)
    # no two picks of one prompt are near-duplicates
    texts: dict[str, list[str]] = {}
    for p in picked:
        s = by_id[p["id"]]
        t = active.response_text(s)
        assert not any(active.near_duplicate(t, u) for u in texts.get(s.prompt_id, []))
        texts.setdefault(s.prompt_id, []).append(t)
    # a launch.label input: every row parses from OUT's folder (images resolve), no label
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [p["id"] for p in picked] and not any("label" in r for r in rows)
    parsed = list(read_samples(str(out), require_label=False))
    assert all(isinstance(s, Sample) for s in parsed) and len(parsed) == budget


def test_select_from_a_real_score_file(tiny_cfg, built_shards, renderer, synth_dir, tmp_path, samples):
    """launch.score's output (a random-init judge) and its sidecar -> launch.select."""
    from rm_jax.score.run import score_file
    workdir = make_judge_workdir(tmp_path, tiny_cfg, built_shards[0], renderer)
    src = os.path.join(synth_dir, f"select_input_{tmp_path.name}.jsonl")     # beside the images
    with open(os.path.join(synth_dir, "samples.jsonl")) as f, open(src, "w") as dst:
        dst.writelines(f.readlines()[:24])
    scores = tmp_path / "scores.jsonl"
    score_file(workdir, src, str(scores), batch_size=8, max_new_tokens=2, progress=False)
    meta = json.loads((tmp_path / "scores.jsonl.meta.json").read_text())
    assert meta["input"] == os.path.abspath(src)
    stats = active.select_file([str(scores)], 6, str(tmp_path / "next.jsonl"))
    assert stats["selected"] == 6 and stats["input"] == os.path.abspath(src)
    p = {r["id"]: r["p_pass"] for r in map(json.loads, scores.read_text().splitlines())}
    ranked = sorted(p, key=lambda i: abs(p[i] - 0.5))
    assert all(math.isfinite(x["p_pass"]) for x in stats["picked"])
    # one route's picks are that route's most uncertain samples (after near-duplicates)
    assert all(x["p_pass"] == p[x["id"]] for x in stats["picked"]) and set(x["id"] for x in stats["picked"]) <= set(ranked)
