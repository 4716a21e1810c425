"""Ranking and calibration metrics against scipy / scikit-learn and brute force."""

import itertools

import numpy as np
import pytest
from scipy import stats
from sklearn.metrics import brier_score_loss, log_loss

from rm_jax.eval.calibration import calibration_metrics, fit_temperature, sigmoid
from rm_jax.eval.ranking import best_of_n, length_bias, pairwise_by_slice, ranking_metrics


def _data(seed=0):
    rng = np.random.default_rng(seed)
    pids, r, u = [], [], []
    for k in range(12):
        n = int(rng.integers(2, 7))
        util = rng.integers(0, 3, n).astype(float)            # ties in utility
        rew = np.round(util + rng.normal(0, 1.0, n), 1)       # rounding makes some reward ties
        pids += [f"p{k}"] * n
        u += util.tolist()
        r += rew.tolist()
    return pids, np.asarray(r), np.asarray(u)


def test_ranking_metrics_match_scipy():
    pids, r, u = _data()
    got = ranking_metrics(pids, r, u)
    taus, rhos, credits = [], [], []
    for pid in dict.fromkeys(pids):
        sel = np.asarray(pids) == pid
        rr, uu = r[sel], u[sel]
        if len(set(uu)) < 2:
            continue
        taus.append(stats.kendalltau(rr, uu).statistic)       # scipy's default variant is b
        rhos.append(stats.spearmanr(rr, uu).statistic)
        for i, j in itertools.combinations(range(len(rr)), 2):
            if uu[i] == uu[j]:
                continue
            credits.append(0.5 if rr[i] == rr[j] else float((rr[i] - rr[j]) * (uu[i] - uu[j]) > 0))
    assert got["n_prompts"] == len(taus) and got["n_pairs"] == len(credits)
    np.testing.assert_allclose(got["kendall_tau_b"], np.mean(taus), rtol=1e-12)
    np.testing.assert_allclose(got["spearman"], np.mean(rhos), rtol=1e-12)
    np.testing.assert_allclose(got["pairwise_accuracy"], np.mean(credits), rtol=1e-12)
    assert any(c == 0.5 for c in credits), "the data must exercise the reward-tie rule"


def test_ranking_is_within_prompt():
    # a per-prompt shift of the rewards changes nothing
    pids, r, u = _data(1)
    shift = np.asarray([hash(p) % 97 for p in pids], float)
    a, b = ranking_metrics(pids, r, u), ranking_metrics(pids, r + shift, u)
    for k in ("pairwise_accuracy", "kendall_tau_b", "spearman"):
        assert a[k] == pytest.approx(b[k])


def test_calibration_matches_sklearn():
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 1, 400)
    y = (rng.uniform(0, 1, 400) < p ** 1.5).astype(int)
    got = calibration_metrics(p, y, n_bins=15)
    np.testing.assert_allclose(got["brier"], brier_score_loss(y, p), rtol=1e-12)
    np.testing.assert_allclose(got["nll"], log_loss(y, p), rtol=1e-9)
    ece = 0.0
    for b in range(15):
        lo, hi = b / 15, (b + 1) / 15
        sel = (p >= lo) & ((p < hi) if b < 14 else (p <= hi))
        if sel.any():
            ece += sel.sum() / len(p) * abs(y[sel].mean() - p[sel].mean())
    np.testing.assert_allclose(got["ece"], ece, rtol=1e-12)


def test_temperature_recovers_the_generating_scale():
    rng = np.random.default_rng(0)
    delta = rng.normal(0, 3, 20000)
    y = (rng.uniform(size=delta.shape) < sigmoid(delta / 2.5)).astype(float)
    assert fit_temperature(delta, y) == pytest.approx(2.5, rel=0.05)


def test_best_of_n_equals_enumeration():
    pids, r, u = _data(2)
    got = best_of_n(pids, r, u)
    for n_idx, n in enumerate(got["n"]):
        vals = []
        for pid in dict.fromkeys(pids):
            sel = np.asarray(pids) == pid
            rr, uu = r[sel], u[sel]
            if len(rr) < n:
                continue
            picks = []
            for sub in itertools.combinations(range(len(rr)), n):
                best = max(rr[list(sub)])
                tied = [i for i in sub if rr[i] == best]
                picks.append(min(uu[i] for i in tied))    # ties broken against the pick
            vals.append(np.mean(picks))
        np.testing.assert_allclose(got["reward_pick"][n_idx], np.mean(vals), rtol=1e-12)
    assert got["oracle_pick"][-1] >= got["reward_pick"][-1]


def test_pairwise_by_slice_and_length_bias():
    r_a = np.array([1.0, 0.0, 2.0, 1.0, 3.0])
    r_b = np.array([0.0, 1.0, 2.0, 0.0, 1.0])
    p = np.array([1.0, 1.0, 1.0, 0.5, 0.0])
    sl = np.array(["x", "x", "y", "y", "y"])
    got = pairwise_by_slice(sl, r_a, r_b, p)
    assert got["by_slice"]["x"] == {"accuracy": 0.5, "n": 2}
    assert got["by_slice"]["y"] == {"accuracy": 0.25, "n": 2}     # a reward tie (0.5) and a wrong one
    assert got["macro"] == pytest.approx(0.375)
    lb = length_bias(["a"] * 4, [1, 2, 3, 4], [10, 20, 30, 40], r_a, r_b, np.array([10, 30, 20, 5, 50]),
                     np.array([10, 10, 40, 5, 10]), p)
    assert lb["spearman_reward_length"] == pytest.approx(1.0)
    assert lb["n_equal_length"] == 1 and lb["equal_length_accuracy"] == 1.0
    # preferred shorter: pair 2 (20 vs 40) and pair 4 (b=10 preferred vs 50)
    assert lb["n_length_conflict"] == 2 and lb["length_conflict_accuracy"] == pytest.approx(0.25)
    assert lb["length_only_accuracy"] == pytest.approx((0.5 + 1 + 0 + 0) / 4)
