"""Judge metrics on a held-out set (docs/contracts.md, "Python API": `judge_metrics`).

What is measured and why:

* **Fail is the positive class.** Teacher labels are mostly "pass" (the field report: 8–9 %
  fail). A judge that says "pass" to everything already scores ~92 % accuracy, so accuracy is
  reported next to `majority_baseline` and never alone. What the reward needs is to *catch*
  failures, hence precision / recall / F1 of the fail class, and ROC-AUC with the fail score
  ``1 - P(pass)``.
* **AUC over accuracy.** The reward uses P(pass) as a continuous number, so what matters is
  whether the *ranking* by P(pass) separates good from bad responses (AUC), not where the 0.5
  threshold happens to cut.
* **Middle zone** = share of samples with 0.2 <= P(pass) <= 0.8. GRPO normalizes rewards within
  a group of responses to one prompt; if the judge only ever says 0.01 or 0.99 it is a 0/1
  judge, most groups get identical scores, and identical scores give zero advantage and zero
  gradient. The field report's reason-first v2 had a 0.0 % middle zone and AUC 0.61; an
  over-trained checkpoint shrinks it too (9.8 % -> 5 %). It is a property to keep, not a loss.
* **img_corr** is the Pearson r between the judge's 0–10 image score and the teacher's, over
  samples where both exist (no-image samples carry null, and a number there means nothing).

Everything is computed with scikit-learn / scipy (the tests compare against them independently);
this module only validates, masks and names. Output is JSON-safe through `to_jsonable`.
It stands on the ground floor (numpy, scipy and scikit-learn only), so training, evaluation and
the launchers import it without pulling in each other; users import it as
`rm_jax.eval.metrics`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np
from scipy import stats
from sklearn.metrics import accuracy_score, precision_recall_fscore_support, roc_auc_score

PASS_THRESHOLD = 0.5          # predicted verdict is "pass" when P(pass) >= 0.5
MIDDLE_ZONE = (0.2, 0.8)      # inclusive bounds of the "judge is unsure" band

METRIC_KEYS = ("n", "n_fail", "accuracy", "majority_baseline", "fail_precision", "fail_recall",
               "fail_f1", "auc", "middle_zone", "img_corr")


# ---------------------------------------------------------------- input normalization


def fail_indicator(labels: Sequence[Any]) -> np.ndarray:
    """Labels -> int array with 1 = fail (the positive class), 0 = pass.

    Accepts "pass"/"fail" strings, or 0/1 (and booleans) where 1 / True means fail. Mixed
    encodings are refused: a list holding both "fail" and 1 almost certainly has a bug upstream.
    """
    values = list(labels.tolist() if isinstance(labels, np.ndarray) else labels)
    if not values:
        return np.zeros(0, dtype=np.int64)
    if all(isinstance(v, str) for v in values):
        bad = sorted({v for v in values if v not in ("pass", "fail")})
        if bad:
            raise ValueError(f"labels must be 'pass' or 'fail'; got {bad[:5]}")
        return np.array([v == "fail" for v in values], dtype=np.int64)
    if any(isinstance(v, str) for v in values):
        raise ValueError("labels mix strings and numbers; use 'pass'/'fail' or 0/1 (1 = fail) throughout")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, (bool, np.bool_)) or (isinstance(v, (int, float, np.integer, np.floating)) and v in (0, 1)):
            out.append(int(v))
        else:
            raise ValueError(f"labels[{i}] = {v!r}: numeric labels must be 0 (pass) or 1 (fail)")
    return np.array(out, dtype=np.int64)


def _probabilities(p_pass: Sequence[float], n: int, name: str = "p_pass") -> np.ndarray:
    p = np.asarray(p_pass, dtype=np.float64).reshape(-1)
    if p.shape[0] != n:
        raise ValueError(f"{name} has {p.shape[0]} values but labels has {n}")
    if np.isnan(p).any():
        raise ValueError(f"{name} contains NaN at index {int(np.flatnonzero(np.isnan(p))[0])}")
    out_of_range = (p < 0.0) | (p > 1.0)
    if out_of_range.any():
        i = int(np.flatnonzero(out_of_range)[0])
        raise ValueError(f"{name}[{i}] = {p[i]} is outside [0, 1]")
    return p


def optional_floats(values: Sequence[Any] | None, n: int, name: str) -> np.ndarray:
    """A possibly-missing numeric column: None / NaN -> NaN. Length must match."""
    if values is None:
        return np.full(n, np.nan)
    vals = list(values.tolist() if isinstance(values, np.ndarray) else values)
    if len(vals) != n:
        raise ValueError(f"{name} has {len(vals)} values but labels has {n}")
    return np.array([np.nan if v is None else float(v) for v in vals], dtype=np.float64)


def _mask(mask: Sequence[bool], n: int, name: str) -> np.ndarray:
    m = np.asarray(mask)
    if m.shape != (n,):
        raise ValueError(f"{name} has shape {m.shape}, expected ({n},)")
    if m.dtype != np.bool_:
        if not np.isin(m, (0, 1)).all():
            raise ValueError(f"{name} must be a boolean mask")
        m = m.astype(bool)
    return m


# ---------------------------------------------------------------- metrics


def safe_auc(y_positive: np.ndarray, score: np.ndarray) -> float:
    """ROC-AUC, NaN when only one class is present (AUC is undefined, not 0.5)."""
    if len(np.unique(y_positive)) < 2:
        return math.nan
    return float(roc_auc_score(y_positive, score))


def pearson_or_nan(pred: np.ndarray, true: np.ndarray) -> float:
    """Pearson r over pairs where both are finite; NaN for < 2 pairs or a constant side."""
    both = np.isfinite(pred) & np.isfinite(true)
    x, y = pred[both], true[both]
    if x.size < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan
    return float(stats.pearsonr(x, y).statistic)


def _core_metrics(y_fail: np.ndarray, p: np.ndarray, img_pred: np.ndarray, img_true: np.ndarray) -> dict:
    n = int(y_fail.size)
    if n == 0:   # an empty slice: counts are 0, every rate is undefined
        return {"n": 0, "n_fail": 0, **{k: math.nan for k in METRIC_KEYS[2:]}}
    pred_fail = (p < PASS_THRESHOLD).astype(np.int64)
    precision, recall, f1, _ = precision_recall_fscore_support(
        y_fail, pred_fail, labels=[1], average=None, zero_division=0)
    n_fail = int(y_fail.sum())
    lo, hi = MIDDLE_ZONE
    return {
        "n": n,
        "n_fail": n_fail,
        "accuracy": float(accuracy_score(y_fail, pred_fail)),
        "majority_baseline": max(n_fail, n - n_fail) / n,
        "fail_precision": float(precision[0]),
        "fail_recall": float(recall[0]),
        "fail_f1": float(f1[0]),
        "auc": safe_auc(y_fail, 1.0 - p),
        "middle_zone": float(np.mean((p >= lo) & (p <= hi))),
        "img_corr": pearson_or_nan(img_pred, img_true),
    }


def judge_metrics(labels: Sequence[Any], p_pass: Sequence[float], img_pred: Sequence[Any] | None = None,
                  img_true: Sequence[Any] | None = None, *, parse_ok: Sequence[bool] | None = None,
                  off_vocab_mass: Sequence[float] | None = None,
                  slices: Mapping[str, Sequence[bool]] | None = None) -> dict:
    """Held-out judge metrics; see the module docstring for what each number means.

    labels: "pass"/"fail" (or 0/1 with 1 = fail). p_pass: P(pass) at the verdict slot, in [0, 1].
    img_pred / img_true: 0–10 scores, None or NaN where missing. parse_ok: whether the decoded
    JSON parsed (adds `parse_failure_rate`). off_vocab_mass: probability mass at the verdict slot
    outside {pass, fail} (adds `mean_off_vocab_mass`). slices: name -> boolean mask; each slice
    gets the same core metrics under result["slices"][name].
    """
    y_fail = fail_indicator(labels)
    n = int(y_fail.size)
    if n == 0:
        raise ValueError("judge_metrics needs at least one sample")
    p = _probabilities(p_pass, n)
    pred_img = optional_floats(img_pred, n, "img_pred")
    true_img = optional_floats(img_true, n, "img_true")

    ok = None if parse_ok is None else _mask(parse_ok, n, "parse_ok")
    mass = None if off_vocab_mass is None else _probabilities(off_vocab_mass, n, "off_vocab_mass")

    def metrics_over(m: np.ndarray) -> dict:
        out = _core_metrics(y_fail[m], p[m], pred_img[m], true_img[m])
        if ok is not None:
            out["parse_failure_rate"] = float(np.mean(~ok[m])) if m.any() else math.nan
        if mass is not None:
            out["mean_off_vocab_mass"] = float(mass[m].mean()) if m.any() else math.nan
        return out

    result = metrics_over(np.ones(n, bool))
    if slices is not None:
        result["slices"] = {name: metrics_over(_mask(mask, n, f"slices[{name!r}]"))
                            for name, mask in slices.items()}
    return result


def failures_by_issue(labels: Sequence[Any], p_pass: Sequence[float],
                      teacher_issues: Sequence[Sequence[str]]) -> dict[str, dict]:
    """How the judge scores each kind of failure the teacher filed, keyed by issue code.

    One AUC hides *which* failures a judge misses: a judge can be perfect on a missing parameter
    and blind to a wrong value. For every code on a teacher "fail" label: ``n`` (failures carrying
    it), ``mean_p_pass``, ``recall`` (share flagged fail, P(pass) < 0.5) and ``auc_vs_pass``, the
    ROC-AUC of those failures against every held-out pass (NaN without passes). A failure with
    several codes counts under each; one with none under ``"(none)"``. Ordered by n, largest first.
    """
    y_fail = fail_indicator(labels)
    n = int(y_fail.size)
    p = _probabilities(p_pass, n)
    if len(teacher_issues) != n:
        raise ValueError(f"teacher_issues has {len(teacher_issues)} entries for {n} samples")
    codes: dict[str, list[int]] = {}
    for i in np.flatnonzero(y_fail):
        for code in (list(teacher_issues[i]) or ["(none)"]):
            codes.setdefault(str(code), []).append(int(i))
    passes = np.flatnonzero(y_fail == 0)
    out = {}
    for code, idx in sorted(codes.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        both = np.concatenate([passes, idx])
        out[code] = {"n": len(idx), "mean_p_pass": float(p[idx].mean()),
                     "recall": float(np.mean(p[idx] < PASS_THRESHOLD)),
                     "auc_vs_pass": safe_auc(y_fail[both], 1.0 - p[both])}
    return out


# ---------------------------------------------------------------- JSON


def to_jsonable(value: Any) -> Any:
    """Recursively make `value` json.dumps-able: numpy -> python, NaN/inf -> None (JSON has no
    NaN and a bare NaN breaks strict readers), dataclasses -> dicts, tuples/sets -> lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return [to_jsonable(v) for v in value.tolist()]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return f if math.isfinite(f) else None
    return value
