"""Calibration of pairwise probabilities: NLL, Brier, ECE, temperature scaling, reliability diagram.

The temperature T of σ(Δ / T) is fitted on the calibration split (minimum pairwise NLL) and then
frozen: the held-out figures before/after use that T, never one refitted on held-out. Labels may be
soft (p in [0, 1]); NLL and Brier then are the cross-entropy / squared error against p, and equal
sklearn's ``log_loss`` / ``brier_score_loss`` for 0/1 labels.
"""

from __future__ import annotations

import numpy as np
from scipy import optimize

EPS = 1e-12


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


def reliability_diagram(path: str, curves: dict, n_bins: int = 15) -> None:
    """curves: name -> (p, y). One PNG: observed frequency against mean predicted probability."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect")
    for name, (p, y) in curves.items():
        rows = [r for r in reliability_bins(p, y, n_bins)["bins"] if r["n"]]
        ax.plot([r["mean_p"] for r in rows], [r["freq"] for r in rows], "o-", label=name)
    ax.set_xlabel("predicted P(a preferred)")
    ax.set_ylabel("observed frequency")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
