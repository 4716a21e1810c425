"""Sweep and judge plots (PNG, matplotlib Agg — no display needed on training hosts).

* `plot_sweep`: metrics vs step with the chosen step marked; val loss on a twin axis so the
  reader sees the report's point directly — loss keeps improving where AUC and middle zone fall.
* `plot_reliability`: P(pass) binned vs the observed pass rate, with counts per bin. The reward
  uses P(pass) as a number, so its calibration matters, not only its ranking.
* `plot_p_pass_hist`: P(pass) by teacher label with the middle zone [0.2, 0.8] shaded; an empty
  band is the 0/1 judge that gives GRPO no within-group spread.
* `plot_reward_hist`: total reward by teacher label.
* `plot_training`: train loss (and held-out loss where logged) vs step, from W/metrics.jsonl, with
  the held-out AUC and middle zone the validation logged beside it.
"""

from __future__ import annotations

import os
from typing import Sequence

import matplotlib

matplotlib.use("Agg")   # before pyplot: headless hosts have no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from rm_jax.metrics import MIDDLE_ZONE, fail_indicator  # noqa: E402
from rm_jax.eval.selection import SweepRow  # noqa: E402

_COLORS = {"pass": "tab:green", "fail": "tab:red"}


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _series(rows: Sequence[SweepRow], key: str) -> np.ndarray:
    return np.array([np.nan if getattr(r, key) is None else float(getattr(r, key)) for r in rows])


def plot_sweep(rows: Sequence[SweepRow], chosen_step: int | None, path: str) -> str:
    rows = sorted(rows, key=lambda r: r.step)
    steps = np.array([r.step for r in rows])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, label, style in (("auc", "AUC", "o-"), ("fail_f1", "fail F1", "s-"),
                              ("middle_zone", "middle zone", "^-"), ("accuracy", "accuracy", "d-")):
        ax.plot(steps, _series(rows, key), style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("metric (fraction)")
    ax.set_ylim(0, 1.02)
    handles, labels = ax.get_legend_handles_labels()
    loss = _series(rows, "val_loss")
    if np.isfinite(loss).any():
        ax2 = ax.twinx()
        ax2.plot(steps, loss, "k--", alpha=0.7, label="val loss")
        ax2.set_ylabel("val loss")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if chosen_step is not None:
        handles.append(ax.axvline(chosen_step, color="gray", linestyle=":", linewidth=2))
        labels.append(f"chosen step {chosen_step}")
    ax.legend(handles, labels, loc="lower left", fontsize=8)
    ax.set_title("checkpoint sweep (held-out)")
    return _save(fig, path)


def plot_reliability(labels: Sequence, p_pass: Sequence[float], path: str, bins: int = 10) -> str:
    y_pass = 1 - fail_indicator(labels)
    p = np.asarray(p_pass, dtype=np.float64)
    if p.shape != y_pass.shape:
        raise ValueError(f"p_pass has {p.size} values but labels has {y_pass.size}")
    edges = np.linspace(0.0, 1.0, bins + 1)
    # Last bin closed on the right so P(pass) = 1.0 is counted.
    idx = np.clip(np.digitize(p, edges[1:-1], right=False), 0, bins - 1)
    counts = np.bincount(idx, minlength=bins)
    mean_p = np.bincount(idx, weights=p, minlength=bins) / np.maximum(counts, 1)
    observed = np.bincount(idx, weights=y_pass, minlength=bins) / np.maximum(counts, 1)
    filled = counts > 0

    fig, (ax, ax_n) = plt.subplots(2, 1, figsize=(5.5, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot([0, 1], [0, 1], color="gray", linestyle="--", label="perfect calibration")
    ax.plot(mean_p[filled], observed[filled], "o-", label="judge")
    for x, y, n in zip(mean_p[filled], observed[filled], counts[filled]):
        ax.annotate(str(n), (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.set_ylabel("observed pass rate")
    ax.set_ylim(-0.08, 1.05)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("reliability of P(pass)")
    ax_n.bar((edges[:-1] + edges[1:]) / 2, counts, width=1.0 / bins * 0.9)
    ax_n.set_yscale("log" if counts.max() > 50 * max(1, counts[filled].min()) else "linear")
    ax_n.set_xlabel("P(pass)")
    ax_n.set_ylabel("count")
    ax_n.set_xlim(0, 1)
    return _save(fig, path)


def plot_p_pass_hist(labels: Sequence, p_pass: Sequence[float], path: str, bins: int = 20) -> str:
    y_fail = fail_indicator(labels)
    p = np.asarray(p_pass, dtype=np.float64)
    fig, ax = plt.subplots(figsize=(6, 4))
    lo, hi = MIDDLE_ZONE
    ax.axvspan(lo, hi, color="gold", alpha=0.2, label=f"middle zone [{lo}, {hi}]")
    edges = np.linspace(0, 1, bins + 1)
    for name, value in (("pass", 0), ("fail", 1)):
        ax.hist(p[y_fail == value], bins=edges, alpha=0.6, color=_COLORS[name],
                label=f"teacher {name} (n={int((y_fail == value).sum())})")
    ax.set_xlabel("P(pass)")
    ax.set_ylabel("count")
    ax.set_yscale("log")   # the pass class dominates; log keeps the fail bars visible
    ax.legend(fontsize=8)
    ax.set_title(f"P(pass) by label; middle zone {np.mean((p >= lo) & (p <= hi)):.1%}")
    return _save(fig, path)


def plot_reward_hist(labels: Sequence, rewards: Sequence[float], path: str, bins: int = 30) -> str:
    y_fail = fail_indicator(labels)
    r = np.asarray(rewards, dtype=np.float64)
    fig, ax = plt.subplots(figsize=(6, 4))
    edges = np.linspace(r.min(), r.max() if r.max() > r.min() else r.min() + 1, bins + 1)
    for name, value in (("pass", 0), ("fail", 1)):
        ax.hist(r[y_fail == value], bins=edges, alpha=0.6, color=_COLORS[name],
                label=f"teacher {name} (n={int((y_fail == value).sum())})")
    ax.set_xlabel("total reward")
    ax.set_ylabel("count")
    ax.legend(fontsize=8)
    ax.set_title("reward by teacher label")
    return _save(fig, path)


def plot_training(metrics: Sequence[dict], path: str) -> str:
    """Train loss per logged step and validation loss where it was logged (W/metrics.jsonl rows);
    when the validation also read P(pass) (verdict-first data), a second panel with its held-out
    AUC and middle-zone share, the numbers the checkpoint choice weighs."""
    judge = [(m["step"], m["val_auc"], m.get("val_middle_zone")) for m in metrics
             if m.get("val_auc") is not None]
    fig, axes = plt.subplots(1, 2 if judge else 1, figsize=(13 if judge else 8, 4.5))
    ax = axes[0] if judge else axes
    train = [(m["step"], m["loss"]) for m in metrics if "loss" in m]
    val = [(m["step"], m["val_loss"]) for m in metrics if m.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), "-", color="tab:blue", alpha=0.8, label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", color="black", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (target tokens)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    if judge:
        steps, auc, middle = zip(*judge)
        axes[1].plot(steps, auc, "o-", color="tab:green", label="held-out AUC")
        axes[1].plot(steps, [np.nan if x is None else x for x in middle], "s--", color="tab:orange",
                     label="middle zone (0.2 <= P(pass) <= 0.8)")
        axes[1].set_ylim(0, 1)
        axes[1].set_xlabel("step")
        axes[1].grid(alpha=0.3)
        axes[1].legend(loc="lower left", fontsize=8)
        axes[1].set_title("validation during training (eval_batches)")
    return _save(fig, path)
