"""The judge's optional P(pass) calibration (none / prior / temperature) and the sweep's
robustness gate.

The prior shift is checked against Bayes' rule on a simulated judge whose training prior differs
from the held-out one; the temperature fit lowers held-out NLL of an over-confident judge; the
label shares equal the counts re-read from the shards; score rows carry the calibrated P(pass)
into the reward. The sweep runs end to end (slow) with the gate and the calibration table.
"""

import json
import math
import os

import numpy as np
import pytest

from rm_jax.eval import calibration as cal
from rm_jax.score import calibration_files
from rm_jax.eval.selection import SweepRow
from serve_fixtures import make_judge_workdir


def _logit(q):
    return np.log(q) - np.log1p(-q)


def test_none_is_the_identity_and_methods_are_checked():
    p = np.array([0.0, 0.2, 0.5, 1.0])
    assert cal.IDENTITY.p_pass(p) is p
    with pytest.raises(ValueError, match="not one of"):
        cal.Calibration("platt")
    with pytest.raises(ValueError, match="temperature > 0"):
        cal.Calibration("temperature", temperature=0.0)


def test_prior_shift_recovers_the_heldout_posterior():
    """A judge trained where failures are oversampled (stream fail share t) reports posterior odds
    with the stream prior; shifting by logit(t) - logit(h) gives the posterior under the held-out
    prior h (Bayes' rule), which we know exactly in this simulation."""
    rng = np.random.default_rng(0)
    lik_ratio = np.exp(rng.normal(0, 2, 5000))          # P(x | pass) / P(x | fail)
    h, t = 0.35, 0.6
    judge_p = 1 / (1 + (t / (1 - t)) / lik_ratio)       # P(pass | x) under the stream prior
    true_p = 1 / (1 + (h / (1 - h)) / lik_ratio)        # ... under the held-out prior
    shares = {"train_stream_fail_share": t, "heldout_fail_share": h}
    c = cal.Calibration("prior", shift=cal.prior_shift(shares))
    np.testing.assert_allclose(c.p_pass(judge_p), true_p, rtol=1e-9, atol=1e-12)
    assert c.shift == pytest.approx(math.log(0.6 / 0.4) - math.log(0.35 / 0.65))


def test_temperature_fit_lowers_nll_on_the_other_half():
    rng = np.random.default_rng(1)
    z_true = rng.normal(0, 1.5, 4000)
    y = (rng.random(4000) < 1 / (1 + np.exp(-z_true))).astype(float)
    p_overconfident = 1 / (1 + np.exp(-3.0 * z_true))
    mask = cal.calibration_split([f"p{i}" for i in range(4000)])
    assert 0.4 < mask.mean() < 0.6
    table = cal.calibration_table(p_overconfident, y, mask, {"train_stream_fail_share": 0.5, "heldout_fail_share": 0.5})
    assert table["temperature"] == pytest.approx(3.0, rel=0.15)
    rows = table["rows"]
    assert rows["temperature"]["nll"] < rows["none"]["nll"] and rows["temperature"]["ece"] < rows["none"]["ece"]
    ev = ~mask
    assert rows["none"] == cal.calibration_metrics(p_overconfident[ev], y[ev])
    assert table["n_calibration"] + table["n_evaluation"] == 4000


def test_label_shares_equal_the_shards(built_shards):
    from rm_jax.eval.sweep import split_samples
    data_dir = built_shards[0]
    splits = split_samples(data_dir)
    n_fail = sum(s.label.l3 == "fail" for s in splits["train"])
    n_pass = len(splits["train"]) - n_fail
    shares = calibration_files.label_shares(data_dir, 3)
    assert shares["train_stream_fail_share"] == pytest.approx(3 * n_fail / (n_pass + 3 * n_fail))
    assert shares["heldout_fail_share"] == pytest.approx(np.mean([s.label.l3 == "fail" for s in splits["heldout"]]))


def test_score_rows_carry_the_calibrated_p_pass(synth_dir):
    from rm_jax.data.schema import Sample, read_samples
    from rm_jax.score.run import p_pass_row
    from rm_jax.score.scorer import VerdictScore
    sample = next(s for s in read_samples(os.path.join(synth_dir, "samples.jsonl")) if isinstance(s, Sample))
    v = VerdictScore(sample.id, 0.3, 0.0, 0.0, float(-_logit(0.3)))
    c = cal.Calibration("temperature", temperature=2.0, shift=0.5)
    raw, calibrated = p_pass_row(sample, v), p_pass_row(sample, v, calibration=c)
    expected = 1 / (1 + np.exp(-(_logit(0.3) / 2.0 + 0.5)))
    assert calibrated["p_pass"] == pytest.approx(expected) and raw["p_pass"] == 0.3
    # reward = rules + w * (2 P(pass) - 1) + ...: only the P(pass) term moves.
    assert calibrated["reward"] - raw["reward"] == pytest.approx(2 * (expected - 0.3))


def test_load_calibration_reads_the_frozen_temperature(tmp_path):
    with pytest.raises(FileNotFoundError, match="launch.sweep"):
        calibration_files.load_calibration(str(tmp_path), "temperature")
    calibration_files.save_temperature(str(tmp_path), 1.7, step=5, n=40)
    assert calibration_files.load_calibration(str(tmp_path), "temperature") == cal.Calibration("temperature", temperature=1.7)
    assert calibration_files.load_calibration(str(tmp_path), "none") is cal.IDENTITY


def test_gate_excludes_steps_whose_worst_attack_exceeds_it():
    from rm_jax.eval.sweep import gate_rows
    rows = [SweepRow(s, 0.8, 0.5, 0.5, 0.5, 0.8, 0.1) for s in (10, 20, 30)]
    audits = {10: {"worst_attack": {"name": "injection", "flip_rate": 0.30}},
              20: {"worst_attack": {"name": "padding", "flip_rate": 0.02}},
              30: {"worst_attack": None}}
    kept, excluded = gate_rows(rows, audits, 0.02)
    assert [r.step for r in kept] == [20, 30] and list(excluded) == [10] and "injection" in excluded[10]
    assert gate_rows(rows, audits, None) == (rows, {})


@pytest.mark.slow   # two random-init steps scored and attacked: ~2 min on 2 cores
def test_sweep_with_gate_and_calibration(tiny_cfg, built_shards, renderer, tmp_path):
    from rm_jax.eval.selection import SelectionRule
    from rm_jax.eval.sweep import Robustness, run_sweep
    workdir = make_judge_workdir(tmp_path, tiny_cfg, built_shards[0], renderer, steps=(1, 2))
    out = run_sweep(workdir, built_shards[0], rule=SelectionRule(auc_tolerance=None, min_middle_zone=None),
                    decode=False, batch_size=8, calibration="temperature",
                    robustness=Robustness(samples=6, gate=0.0))
    rob = out["robustness"]
    worst = {int(s): a["worst_attack"] for s, a in rob["by_step"].items()}
    assert {int(s) for s in rob["excluded"]} == {s for s, w in worst.items() if w and w["flip_rate"] > 0.0}
    if len(rob["excluded"]) < 2:
        assert str(out["chosen"]["step"]) not in {str(s) for s in rob["excluded"]}
    md = open(os.path.join(workdir, "sweep.md")).read()
    assert "worst attack flip" in md and "| temperature |" in md
    frozen = json.load(open(os.path.join(workdir, "calibration.json")))
    assert frozen["step"] == out["chosen"]["step"] and frozen["temperature"] == out["calibration"]["applied"]["temperature"]
    assert os.path.isfile(out["plots"]["calibration"])


def test_server_engine_rows_use_the_calibration(tiny_cfg, built_shards, renderer, synth_dir, tmp_path):
    """launch.serve --calibration: the engine's rows (/v1/score, /get_reward) carry the calibrated
    P(pass) into the reward, as launch.score's do."""
    from rm_jax.data.schema import Sample, read_samples
    from rm_jax.score.run import p_pass_row
    from rm_jax.score.scorer import ScoreMode, VerdictScore
    from rm_jax.serve.engine import Engine
    workdir = make_judge_workdir(tmp_path, tiny_cfg, built_shards[0], renderer)
    c = calibration_files.load_calibration(workdir, "prior")
    assert c.shift == pytest.approx(cal.prior_shift(calibration_files.run_label_shares(workdir)))
    engine = Engine.load(workdir, max_batch=8, calibration=c)
    sample = next(s for s in read_samples(os.path.join(synth_dir, "samples.jsonl")) if isinstance(s, Sample))
    v = VerdictScore(sample.id, 0.25, 0.0, 0.0, float(-_logit(0.25)))
    row = engine.rows(ScoreMode.P_PASS, [sample], [v])[0]
    assert row == p_pass_row(sample, v, engine.reward, c) and row["p_pass"] == pytest.approx(c.p_pass(0.25))
