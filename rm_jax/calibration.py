"""Calibration of probabilities: NLL, Brier, ECE, temperature scaling, reliability diagram, and the
judge's optional calibrated P(pass).

The temperature T of σ(Δ / T) is fitted on the calibration split (minimum NLL) and then frozen:
the held-out figures before/after use that T, never one refitted on held-out. Labels may be soft
(p in [0, 1]); NLL and Brier then are the cross-entropy / squared error against p, and equal
sklearn's ``log_loss`` / ``brier_score_loss`` for 0/1 labels.

The judge's P(pass) = σ(z) with z = logit(pass) - logit(fail) at the verdict slot. ``Calibration``
maps it to σ(z / T + shift), an option of score, sweep and serve (``--calibration``):

* ``none`` (default): the field report's reward, unchanged.
* ``prior``: failures are oversampled in the training stream only (x3: about 60 % fail against
  35 % held out), so the judge's prior odds of pass are too low. Bayes' rule with the class
  prior replaced: shift = logit(stream fail share) - logit(held-out fail share), both from the run
  (its recorded ``data.oversample_fail`` and its data directory's split indexes).
* ``temperature``: T fitted by the sweep on a calibration half of the held-out split at the chosen
  step, frozen in ``W/calibration.json``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np
from scipy import optimize

EPS = 1e-12
METHODS = ("none", "prior", "temperature")


def calibration_metrics(p, y, n_bins: int = 15) -> dict:
    """``nll``, ``brier``, ``ece`` (equal-width bins on [0, 1]; weights = bin share)."""
    p = np.clip(np.asarray(p, np.float64), 0.0, 1.0)
    y = np.asarray(y, np.float64)
    if p.shape != y.shape or p.ndim != 1:
        raise ValueError(f"p and y must be 1-D of equal length, got {p.shape} and {y.shape}")
    if len(p) == 0:
        return {"nll": float("nan"), "brier": float("nan"), "ece": float("nan"), "n": 0}
    q = np.clip(p, EPS, 1 - EPS)
    nll = float(-np.mean(y * np.log(q) + (1 - y) * np.log(1 - q)))
    brier = float(np.mean((p - y) ** 2))
    bins = np.minimum((p * n_bins).astype(np.int64), n_bins - 1)
    ece = 0.0
    for b in range(n_bins):
        sel = bins == b
        if sel.any():
            ece += sel.mean() * abs(y[sel].mean() - p[sel].mean())
    return {"nll": nll, "brier": brier, "ece": float(ece), "n": int(len(p))}


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def fit_temperature(delta, y) -> float:
    """argmin_T NLL(σ(Δ/T), y), searched over log T in [-6, 6]."""
    delta, y = np.asarray(delta, np.float64), np.asarray(y, np.float64)
    if len(delta) == 0:
        return 1.0

    def nll(log_t):
        z = delta / np.exp(log_t)
        return float(np.mean(y * np.logaddexp(0, -z) + (1 - y) * np.logaddexp(0, z)))

    res = optimize.minimize_scalar(nll, bounds=(-6.0, 6.0), method="bounded")
    return float(np.exp(res.x))


def reliability_bins(p, y, n_bins: int = 15) -> dict:
    p, y = np.asarray(p, np.float64), np.asarray(y, np.float64)
    bins = np.minimum((p * n_bins).astype(np.int64), n_bins - 1)
    rows = [{"lo": b / n_bins, "hi": (b + 1) / n_bins, "n": int((bins == b).sum()),
             "mean_p": float(p[bins == b].mean()) if (bins == b).any() else None,
             "freq": float(y[bins == b].mean()) if (bins == b).any() else None} for b in range(n_bins)]
    return {"bins": rows}


def reliability_diagram(path: str, curves: dict, n_bins: int = 15, xlabel: str = "predicted P(a preferred)") -> None:
    """curves: name -> (p, y). One PNG: observed frequency against mean predicted probability."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect")
    for name, (p, y) in curves.items():
        rows = [r for r in reliability_bins(p, y, n_bins)["bins"] if r["n"]]
        ax.plot([r["mean_p"] for r in rows], [r["freq"] for r in rows], "o-", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("observed frequency")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- the judge's calibrated P(pass)


def _logit(q: float) -> float:
    return math.log(q) - math.log1p(-q)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """P(pass) -> σ(z / temperature + shift), z the verdict logit difference."""
    method: str = "none"
    temperature: float = 1.0
    shift: float = 0.0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"calibration {self.method!r} is not one of {METHODS}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)) or not math.isfinite(self.shift):
            raise ValueError(f"calibration needs a finite temperature > 0 and a finite shift, got {self}")

    def logit(self, z):
        return np.asarray(z, np.float64) / self.temperature + self.shift

    def p_pass(self, p):
        """Calibrated P(pass) from the judge's P(pass) (z recovered as its logit; NaN stays NaN)."""
        if self.method == "none":
            return p
        q = np.clip(np.asarray(p, np.float64), EPS, 1 - EPS)
        out = sigmoid(self.logit(np.log(q) - np.log1p(-q)))
        return float(out) if np.ndim(out) == 0 else out

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


IDENTITY = Calibration()


def prior_shift(shares: dict) -> float:
    """The pass-logit shift that swaps the training stream's prior for the held-out one."""
    t, h = shares["train_stream_fail_share"], shares["heldout_fail_share"]
    if not (0 < t < 1 and 0 < h < 1):
        raise ValueError(f"the prior calibration needs fail shares strictly between 0 and 1, got {shares}")
    return _logit(t) - _logit(h)


def calibration_split(prompt_ids, fraction: float = 0.5, seed: int = 0) -> np.ndarray:
    """Boolean mask of the calibration half of the held-out split, by prompt (a stable hash)."""
    def u(pid: str) -> float:
        return int.from_bytes(hashlib.sha256(f"calibration:{seed}:{pid}".encode()).digest()[:8], "big") / 2.0 ** 64
    return np.asarray([u(p) < fraction for p in prompt_ids], bool)


def calibration_table(p_pass, y_pass, cal_mask, shares: dict) -> dict:
    """Fit T on the calibration part, then NLL/Brier/ECE of none / prior / temperature on the
    evaluation part (never the part T was fitted on)."""
    p = np.clip(np.asarray(p_pass, np.float64), EPS, 1 - EPS)
    y = np.asarray(y_pass, np.float64)
    z = np.log(p) - np.log1p(-p)
    t = fit_temperature(z[cal_mask], y[cal_mask])
    methods = {"none": IDENTITY, "prior": Calibration("prior", shift=prior_shift(shares)),
               "temperature": Calibration("temperature", temperature=t)}
    ev = ~cal_mask
    rows = {name: calibration_metrics(np.asarray(c.p_pass(p[ev])), y[ev]) for name, c in methods.items()}
    return {"temperature": t, "shift": methods["prior"].shift, "shares": shares,
            "n_calibration": int(cal_mask.sum()), "n_evaluation": int(ev.sum()), "rows": rows,
            "curves": {name: (np.asarray(c.p_pass(p[ev])), y[ev]) for name, c in methods.items()}}
