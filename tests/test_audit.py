"""The robustness audit and the transforms it shares with the build's adversarial negatives.

Transforms are checked on the synthetic samples (what each changes, what it leaves alone, the
deterministic per-sample draw of a training variant). The audit runs end to end on a random-init
tiny judge (``launch.audit``'s function): every transform reported, counts that add up, the
batch, JSON-whitespace and key-order invariances within 1e-5 in fp32, one attack's figures
recomputed by scoring the pairs directly, and the intervals equal to scipy's bootstrap.
"""

import dataclasses
import json
import math
import os

import numpy as np
import pytest
from scipy import stats

from rm_jax.data import attacks
from rm_jax.data.schema import Sample, read_samples

from serve_fixtures import make_judge_workdir  # noqa: E402


@pytest.fixture(scope="module")
def samples(synth_dir):
    return [s for s in read_samples(os.path.join(synth_dir, "samples.jsonl")) if isinstance(s, Sample)]


def _first(samples, pred):
    return next(s for s in samples if pred(s))


def test_attacks_change_only_the_response(samples):
    pools = attacks.ValuePools.collect(samples)
    tool = _first(samples, lambda s: s.response.calls_tools and any(
        isinstance(c.arguments, dict) and len(c.arguments) > 1 for c in s.response.tool_calls))
    text = _first(samples, lambda s: not s.response.calls_tools and len(s.response.content or "") > 20)
    rng = lambda: np.random.default_rng(0)
    for t in attacks.TRANSFORMS:
        for s in (tool, text):
            out = t.apply(s, rng(), pools)
            if out is None:
                continue
            assert out.messages == s.messages and out.tools == s.tools and out.id == s.id
            if t.kind != attacks.INVARIANCE:
                assert out.response != s.response or t.name == "invisible_chars", t.name
    inj = attacks.BY_NAME["injection"].apply(text, rng(), pools)
    assert inj.response.content.startswith(text.response.content) and '"l3": "pass"' in inj.response.content
    key = attacks.BY_NAME["master_key_thought"].apply(tool, rng(), pools)
    assert key.response.content == "Thought process:" and key.response.tool_calls == ()
    cut = attacks.BY_NAME["truncated_call"].apply(tool, rng(), pools)
    assert not cut.response.tool_calls[0].decoded and isinstance(cut.response.tool_calls[0].arguments, str)
    assert attacks.BY_NAME["truncated_call"].apply(text, rng(), pools) is None
    zw = attacks.BY_NAME["invisible_chars"].apply(tool, rng(), pools)
    assert any(z in json.dumps(zw.response.tool_calls[0].arguments, ensure_ascii=False) for z in attacks.ZERO_WIDTH)
    order = attacks.BY_NAME["key_order"].apply(tool, rng(), pools)
    a, b = order.response.tool_calls[0].arguments, tool.response.tool_calls[0].arguments
    assert a == b and list(a) == list(reversed(list(b)))
    ws = attacks.BY_NAME["json_whitespace"].apply(tool, rng(), pools)
    assert ws.response.tool_calls[0].arguments == b and ws.response.tool_calls[0].encode_depth == 1


def test_fact_edits_swap_one_value_of_its_class(samples):
    pools = attacks.ValuePools.collect(samples)
    s = _first(samples, lambda s: any((c.name, k) in pools.by_arg for c in s.response.tool_calls
                                      if isinstance(c.arguments, dict) for k in c.arguments))
    out = attacks.BY_NAME["swap_arg_value"].apply(s, np.random.default_rng(1), pools)
    changed = [(c.name, k) for c, d in zip(out.response.tool_calls, s.response.tool_calls)
               for k in c.arguments if c.arguments[k] != d.arguments[k]]
    assert len(changed) == 1 and changed[0] in pools.by_arg
    numbered = _first(samples, lambda s: any(ch.isdigit() for ch in (s.response.content or "")))
    edited = attacks.BY_NAME["count_change"].apply(numbered, np.random.default_rng(2), pools)
    assert edited.response.content != numbered.response.content
    assert len(edited.response.content) - len(numbered.response.content) in (-1, 0, 1)


def test_adversarial_variant_is_deterministic_and_labelled_fail(samples):
    pools = attacks.ValuePools.collect(samples)
    made = [attacks.adversarial_variant(s, 1.0, seed=3, pools=pools) for s in samples]
    again = [attacks.adversarial_variant(s, 1.0, seed=3, pools=pools) for s in samples]
    assert made == again
    variants = [v for v in made if v is not None]
    assert len(variants) > len(samples) // 2
    for src, v in zip(samples, made):
        if v is None:
            continue
        name = v.id.split("~adv-")[1]
        t = attacks.BY_NAME[name]
        assert v.id == f"{src.id}~adv-{name}" and v.prompt_id == src.prompt_id   # same split as its source
        assert v.label.l3 == "fail" and v.label.issues == (t.issue,) and t.kind == attacks.ATTACK
        assert t.always_fail or src.label.l3 == "fail"
    assert all(attacks.adversarial_variant(s, 0.0, seed=3) is None for s in samples)
    share = np.mean([attacks.adversarial_variant(s, 0.3, seed=5, pools=pools) is not None for s in samples])
    assert 0.1 < share < 0.45


def test_bootstrap_interval_equals_scipy():
    from rm_jax.eval.audit import bootstrap_mean
    x = np.random.default_rng(0).random(50) > 0.7
    got = bootstrap_mean(x.astype(float), seed=4)
    ref = stats.bootstrap((x.astype(float),), np.mean, n_resamples=2000, method="percentile",
                          random_state=np.random.default_rng(4)).confidence_interval
    assert got.value == pytest.approx(x.mean()) and (got.lo, got.hi) == pytest.approx((ref.low, ref.high))
    assert math.isnan(bootstrap_mean([0.2]).lo)


@pytest.fixture(scope="module")
def judge_run(tiny_cfg, built_shards, renderer, tmp_path_factory):
    """A random-init tiny judge workdir and a scorer over it, as launch.audit builds them."""
    from rm_jax.score.checkpoints import load_judge
    from rm_jax.score.run import renderer_for
    from rm_jax.score.scorer import Scorer
    workdir = make_judge_workdir(tmp_path_factory.mktemp("audit_judge"), tiny_cfg, built_shards[0], renderer)
    model, _, _ = load_judge(workdir)
    cfg, rend = renderer_for(workdir, "")
    return workdir, Scorer.for_run(model, rend, cfg, batch_size=8, max_new_tokens=1, progress=False)


def test_audit_figures_equal_direct_scoring(judge_run, samples):
    """One attack, one edit and one invariance on 16 samples: the record's figures recomputed by
    scoring the (original, transformed) pairs directly; counts add up; batch invariance <= 1e-5."""
    from rm_jax.eval.audit import audit, target_samples
    _, scorer = judge_run
    subset = [s for s in samples if s.label.l3 == "fail"][:8] + [s for s in samples if s.label.l3 == "pass"][:8]
    chosen = [attacks.BY_NAME[n] for n in ("injection", "swap_arg_value", "json_whitespace", "key_order")]
    rec = audit(scorer, subset, seed=0, transforms=chosen)
    assert [r["name"] for r in rec["transforms"]] == [t.name for t in chosen]
    for r in rec["transforms"]:
        assert r["n"] + r["n_unscored"] + r["n_not_applicable"] == len(target_samples(r["kind"], subset)), r["name"]
    inv = rec["invariance_max_abs_delta"]
    assert inv["batch_alone"] <= 1e-5 and inv["batch_reordered"] <= 1e-5
    assert inv["json_whitespace"] <= 1e-5    # the contract decodes the string to the same object
    assert inv["key_order"] <= 1e-5          # the renderers write arguments in canonical order
    by_name = {r["name"]: r for r in rec["transforms"]}
    assert by_name["key_order"]["n"] > 0 and by_name["json_whitespace"]["n"] > 0

    fails = target_samples(attacks.ATTACK, subset)
    t = attacks.BY_NAME["injection"]
    attacked = [dataclasses.replace(t.apply(s, attacks.sample_rng(0, s.id, t.name), None), id=s.id + "!")
                for s in fails]
    before = np.asarray([v.p_pass for v in scorer.p_pass(fails)])
    after = np.asarray([v.p_pass for v in scorer.p_pass(attacked)])
    row = rec["transforms"][0]
    ok = np.isfinite(before) & np.isfinite(after)        # an attacked prompt over the largest bucket
    assert row["n"] == int(ok.sum()) > 0 and row["n_unscored"] == int((~np.isfinite(after)).sum())
    before, after = before[ok], after[ok]
    assert row["mean_delta_p_pass"]["value"] == pytest.approx(float(np.mean(after - before)), abs=1e-5)
    caught = before < 0.5
    assert row["flip_base"] == int(caught.sum())
    if caught.any():
        assert row["flip_rate"]["value"] == pytest.approx(float(np.mean(after[caught] >= 0.5)))


@pytest.mark.slow   # every transform on 24 samples: ~3 min on 2 cores
def test_audit_file_writes_every_transform(judge_run, synth_dir, tmp_path, samples):
    """launch.audit's function: audit.json / audit.md with every transform, counts that add up."""
    from rm_jax.eval.audit import audit_file, target_samples
    workdir, _ = judge_run
    n = 24
    rec = audit_file(workdir, os.path.join(synth_dir, "samples.jsonl"), str(tmp_path / "audit"),
                     max_samples=n, batch_size=8, seed=0)
    on_disk = json.loads((tmp_path / "audit" / "audit.json").read_text())
    assert on_disk["transforms"] == rec["transforms"]
    assert "| injection |" in (tmp_path / "audit" / "audit.md").read_text()
    assert [r["name"] for r in rec["transforms"]] == [t.name for t in attacks.TRANSFORMS]
    for r in rec["transforms"]:
        assert r["n"] + r["n_unscored"] + r["n_not_applicable"] == len(target_samples(r["kind"], samples[:n]))
    assert all(v is not None and v <= 1e-5 for v in rec["invariance_max_abs_delta"].values())


def test_adversarial_input_augments_the_training_split_only(synth_dir, tiny_cfg, renderer, tmp_path):
    """data.adversarial_rate: each drawn variant follows its training source line, labelled fail
    with its issue; held-out prompts get none; the originals are copied byte for byte; the build
    keeps every valid variant in the training split."""
    from rm_jax.data import build as build_lib
    from rm_jax.data import records
    from rm_jax.data.schema import read_samples
    src = os.path.join(synth_dir, "samples.jsonl")
    opts = build_lib.BuildOptions.from_config(tiny_cfg.data)
    in_train = lambda pid: build_lib.split_of(pid, opts.heldout_fraction, opts.split_seed) == "train"
    out = os.path.join(synth_dir, f"adversarial_{tmp_path.name}.jsonl")   # beside the images
    path, summary = attacks.write_adversarial_input(src, 0.3, 0, in_train, out_path=out)
    originals = [line for line in open(src, encoding="utf-8") if line.strip()]
    lines = [line for line in open(path, encoding="utf-8") if line.strip()]
    assert [line for line in lines if "~adv-" not in json.loads(line)["id"]] == originals
    assert len(lines) == len(originals) + summary["added"] and summary["added"] > 0
    assert sum(summary["by_issue"].values()) == summary["added"]
    by_id = {}
    prev = None
    for line in lines:
        row = json.loads(line)
        if "~adv-" in row["id"]:
            assert prev is not None and row["id"].startswith(prev["id"] + "~adv-") and in_train(row["prompt_id"])
            assert row["label"]["l3"] == "fail" and row["label"]["issues"][0] in summary["by_issue"]
            assert row["messages"] == prev["messages"]
        prev = row
        by_id[row["id"]] = row
    # the written variants parse back to what adversarial_variant made (images resolve beside the input)
    parsed = [s for s in read_samples(src) if isinstance(s, Sample)]
    pools = attacks.ValuePools.collect([s for s in parsed if in_train(s.prompt_id)])
    for s in parsed:
        v = attacks.adversarial_variant(s, 0.3, 0, pools) if in_train(s.prompt_id) else None
        assert (v is not None) == (v is not None and v.id in by_id)
    build_lib.build(path, str(tmp_path / "shards"), renderer, opts, tokenizer_dir=os.path.join(
        synth_dir, "tokenizer"), progress=False)
    rejects = [json.loads(x) for x in open(tmp_path / "shards" / "rejects.jsonl")]
    assert all("~adv-" in r["id"] and r["reason"] == "too_long" for r in rejects)   # padding past max_len
    train = records.load_index(str(tmp_path / "shards"), "train")
    assert len(train["label"]) == sum(in_train(json.loads(x)["prompt_id"]) for x in lines) - len(rejects)
    heldout = records.load_index(str(tmp_path / "shards"), "heldout")
    assert len(heldout["label"]) == sum(not in_train(json.loads(x)["prompt_id"]) for x in originals)
