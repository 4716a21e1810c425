"""judge_metrics equals scikit-learn / scipy computed independently; edge cases; slices."""

import json
import math

import numpy as np
import pytest
from scipy.stats import pearsonr
from sklearn.metrics import accuracy_score, f1_score, precision_score, recall_score, roc_auc_score

from rm_jax.eval.metrics import METRIC_KEYS, judge_metrics, to_jsonable


def _random_set(seed: int, n: int = 300):
    rng = np.random.default_rng(seed)
    y_fail = (rng.random(n) < 0.2).astype(int)
    # Informative but noisy P(pass), with exact 0.5 / 0.2 / 0.8 values to pin boundary handling.
    p = np.clip(0.75 - 0.4 * y_fail + rng.normal(0, 0.25, n), 0, 1)
    p[:3] = [0.5, 0.2, 0.8]
    img_true = rng.integers(0, 11, n).astype(float)
    img_pred = np.clip(img_true + rng.normal(0, 2, n), 0, 10).round()
    missing = rng.random(n) < 0.3
    img_true_list = [None if m else v for m, v in zip(missing, img_true)]
    img_pred_list = [float("nan") if rng.random() < 0.1 else v for v in img_pred]
    return y_fail, p, img_pred_list, img_true_list


def _reference(y_fail, p, img_pred, img_true):
    pred_fail = (p < 0.5).astype(int)
    a = np.array([np.nan if v is None else v for v in img_pred], float)
    b = np.array([np.nan if v is None else v for v in img_true], float)
    both = ~np.isnan(a) & ~np.isnan(b)
    return {
        "n": len(y_fail), "n_fail": int(y_fail.sum()),
        "accuracy": accuracy_score(y_fail, pred_fail),
        "majority_baseline": max(y_fail.mean(), 1 - y_fail.mean()),
        "fail_precision": precision_score(y_fail, pred_fail, pos_label=1, zero_division=0),
        "fail_recall": recall_score(y_fail, pred_fail, pos_label=1, zero_division=0),
        "fail_f1": f1_score(y_fail, pred_fail, pos_label=1, zero_division=0),
        "auc": roc_auc_score(y_fail, 1 - p),
        "middle_zone": float(np.mean([0.2 <= x <= 0.8 for x in p])),
        "img_corr": pearsonr(a[both], b[both])[0],
    }


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("encoding", ["str", "int"])
def test_matches_sklearn_and_scipy(seed, encoding):
    y_fail, p, img_pred, img_true = _random_set(seed)
    labels = ["fail" if y else "pass" for y in y_fail] if encoding == "str" else list(y_fail)
    got = judge_metrics(labels, p, img_pred, img_true)
    assert set(got) == set(METRIC_KEYS)
    want = _reference(y_fail, p, img_pred, img_true)
    for k in METRIC_KEYS:
        assert got[k] == pytest.approx(want[k], abs=1e-12), k


def test_threshold_is_inclusive_pass_and_fail_is_positive():
    # p = 0.5 is a pass verdict; the only fail is caught by p = 0.1.
    got = judge_metrics(["pass", "fail", "pass"], [0.5, 0.1, 0.9])
    assert got["accuracy"] == 1.0 and got["fail_recall"] == 1.0 and got["fail_precision"] == 1.0
    assert got["auc"] == 1.0 and got["n_fail"] == 1
    assert got["majority_baseline"] == pytest.approx(2 / 3)


def test_single_class_auc_nan_and_no_fail_predictions():
    got = judge_metrics(["pass"] * 5, [0.9, 0.7, 0.95, 0.6, 0.99])
    assert math.isnan(got["auc"])
    assert got["fail_precision"] == 0 and got["fail_recall"] == 0 and got["fail_f1"] == 0
    assert got["majority_baseline"] == 1.0
    assert math.isnan(got["img_corr"])


def test_all_in_middle_zone_and_boundaries():
    got = judge_metrics(["pass", "fail", "pass", "fail"], [0.2, 0.8, 0.5, 0.3])
    assert got["middle_zone"] == 1.0
    assert judge_metrics(["pass", "fail"], [0.81, 0.19])["middle_zone"] == 0.0


def test_img_corr_nan_cases():
    labels = ["pass", "fail", "pass"]
    p = [0.9, 0.1, 0.8]
    assert math.isnan(judge_metrics(labels, p, [5, None, None], [6, 3, None])["img_corr"])   # one pair
    assert math.isnan(judge_metrics(labels, p, [5, 5, 5], [6, 3, 1])["img_corr"])            # constant
    assert judge_metrics(labels, p, [1, 2, 3], [2, 4, 6])["img_corr"] == pytest.approx(1.0)


def test_optional_rates_and_slices():
    y_fail, p, img_pred, img_true = _random_set(7, n=200)
    labels = ["fail" if y else "pass" for y in y_fail]
    tool_call = np.arange(200) % 3 != 0
    parse_ok = np.arange(200) % 10 != 0
    mass = np.full(200, 0.01)
    got = judge_metrics(labels, p, img_pred, img_true, parse_ok=parse_ok, off_vocab_mass=mass,
                        slices={"tool_call": tool_call, "text_only": ~tool_call, "empty": np.zeros(200, bool)})
    assert got["parse_failure_rate"] == pytest.approx(0.1)
    assert got["mean_off_vocab_mass"] == pytest.approx(0.01)
    for name, m in (("tool_call", tool_call), ("text_only", ~tool_call)):
        want = judge_metrics([labels[i] for i in np.flatnonzero(m)], p[m],
                             [img_pred[i] for i in np.flatnonzero(m)], [img_true[i] for i in np.flatnonzero(m)],
                             parse_ok=parse_ok[m], off_vocab_mass=mass[m])
        assert got["slices"][name] == pytest.approx(want, nan_ok=True)
        assert got["slices"][name]["parse_failure_rate"] == pytest.approx(np.mean(~parse_ok[m]))
    assert got["slices"]["tool_call"]["n"] + got["slices"]["text_only"]["n"] == 200
    assert got["slices"]["empty"]["n"] == 0 and math.isnan(got["slices"]["empty"]["auc"])
    # JSON-safe: NaN becomes null.
    text = json.dumps(to_jsonable(got), allow_nan=False)
    assert json.loads(text)["slices"]["empty"]["auc"] is None


@pytest.mark.parametrize("labels,p,match", [
    (["pass", "fail"], [0.5], "has 1 values"),
    (["pass", "fail"], [0.5, float("nan")], "NaN"),
    (["pass", "fail"], [0.5, 1.2], "outside"),
    (["pass", "maybe"], [0.5, 0.5], "'pass' or 'fail'"),
    ([0, 2], [0.5, 0.5], "0 \\(pass\\) or 1 \\(fail\\)"),
    (["pass", 1], [0.5, 0.5], "mix"),
    ([], [], "at least one"),
])
def test_validation_errors(labels, p, match):
    with pytest.raises(ValueError, match=match):
        judge_metrics(labels, p)


def test_img_length_mismatch():
    with pytest.raises(ValueError, match="img_true"):
        judge_metrics(["pass", "fail"], [0.9, 0.1], [1, 2], [1])


# ---------------------------------------------------------------- shortcut baseline


_GENERATE_TOOL = {"type": "function", "function": {"name": "generate_image", "parameters": {
    "type": "object", "properties": {"prompt": {"type": "string"}, "count": {"type": "integer"}}, "required": ["prompt"]}}}


def _fabricated_samples(n, seed, leak):
    """Tool-call samples whose fail labels are random, or (leak) tied to double-encoded arguments."""
    from rm_jax.data.schema import parse_sample
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        fail = rng.random() < 0.3
        args = {"prompt": "a cat " * int(rng.integers(1, 8)), "count": int(rng.integers(1, 5))}
        double = fail if leak else rng.random() < 0.3
        encoded = json.dumps(json.dumps(args)) if double else args
        obj = {"id": f"s{i}", "messages": [{"role": "user", "content": "draw"}], "tools": [_GENERATE_TOOL],
               "response": {"content": "ok" if rng.random() < 0.5 else None,
                            "tool_calls": [{"id": "c", "type": "function",
                                            "function": {"name": "generate_image", "arguments": encoded}}]},
               "label": {"l3": "fail" if fail else "pass", "reason": "", "issues": [], "img": None}}
        out.append(parse_sample(obj, line=i + 1, base_dir="/nonexistent"))
    return out


def test_shortcut_baseline_near_chance_without_leak_and_high_with_leak():
    from rm_jax.eval.baseline import FEATURES, shortcut_baseline
    clean = shortcut_baseline(_fabricated_samples(400, 0, False), _fabricated_samples(300, 1, False))
    assert abs(clean["auc"] - 0.5) < 0.12
    assert clean["n_train"] == 400 and clean["n_heldout"] == 300 and clean["features"] == list(FEATURES)
    leaky = shortcut_baseline(_fabricated_samples(400, 2, True), _fabricated_samples(300, 3, True))
    assert leaky["auc"] > 0.95 and leaky["feature_auc"]["max_encode_depth"] > 0.95
    json.dumps(to_jsonable(leaky), allow_nan=False)


def test_shortcut_baseline_single_class_train():
    from rm_jax.eval.baseline import shortcut_baseline
    train = [s for s in _fabricated_samples(50, 4, False) if s.label.l3 == "pass"]
    result = shortcut_baseline(train, _fabricated_samples(20, 5, False))
    assert math.isnan(result["auc"]) and "not fitted" in result["note"]


def test_failures_by_issue_equals_sklearn_per_failure_kind():
    from rm_jax.eval.metrics import failures_by_issue
    y_fail, p, _, _ = _random_set(7)
    rng = np.random.default_rng(8)
    codes = ("wrong_param", "missing_param", "image_mismatch")
    # Fails carry one code, two codes, or none; passes carry none (and anything on a pass is ignored).
    issues = [list(rng.choice(codes, size=rng.integers(0, 3), replace=False)) if f else
              (["wrong_param"] if rng.random() < 0.1 else []) for f in y_fail]
    got = failures_by_issue(["fail" if f else "pass" for f in y_fail], p, issues)
    passes = np.flatnonzero(y_fail == 0)
    expected_codes = {c for f, iss in zip(y_fail, issues) if f for c in (iss or ["(none)"])}
    assert set(got) == expected_codes
    assert [m["n"] for m in got.values()] == sorted((m["n"] for m in got.values()), reverse=True)
    for code, m in got.items():
        idx = np.array([i for i in np.flatnonzero(y_fail) if code in (issues[i] or ["(none)"])])
        assert m["n"] == len(idx)
        assert m["mean_p_pass"] == pytest.approx(p[idx].mean(), abs=1e-12)
        assert m["recall"] == pytest.approx(recall_score(np.ones(len(idx)), (p[idx] < 0.5).astype(int)), abs=1e-12)
        y = np.r_[np.zeros(len(passes)), np.ones(len(idx))]
        assert m["auc_vs_pass"] == pytest.approx(roc_auc_score(y, 1 - np.r_[p[passes], p[idx]]), abs=1e-12)
    # Without passes the AUC is undefined, not 0.5.
    only_fails = failures_by_issue(["fail"] * 3, [0.1, 0.9, 0.4], [["a"], ["a"], []])
    assert math.isnan(only_fails["a"]["auc_vs_pass"]) and only_fails["(none)"]["n"] == 1
    with pytest.raises(ValueError, match="teacher_issues"):
        failures_by_issue(["fail", "pass"], [0.1, 0.9], [["a"]])
