"""The field report's lessons, read off measured runs, each with whether the run separates it from noise.

The report's recipe rests on four comparisons: reason-first collapses the middle zone, x3
failure oversampling raises fail recall, the policy's checkpoint beats a random start, and
checkpoint selection by the downstream rule beats selection by validation loss. The demo shows
each one with its figures from a run (its own sweep, or a ``launch.ablate`` table), and says
"inside the noise" when the difference is within two standard errors: for an AUC, Hanley and
McNeil's error at the held-out class sizes; for a share (middle zone, recall), the binomial error.
Two runs' errors are combined as if independent (they are scored on the same held-out samples, so
this overstates the noise: a "separated" verdict is conservative).
"""

from __future__ import annotations

import dataclasses
import math

Z = 1.96


def auc_se(auc: float, n_pos: int, n_neg: int) -> float:
    """Hanley & McNeil (1982) standard error of an AUC with n_pos positives and n_neg negatives."""
    q1, q2 = auc / (2.0 - auc), 2.0 * auc * auc / (1.0 + auc)
    var = (auc * (1 - auc) + (n_pos - 1) * (q1 - auc * auc) + (n_neg - 1) * (q2 - auc * auc)) / (n_pos * n_neg)
    return math.sqrt(max(var, 0.0))


def share_se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1.0 - p), 0.0) / max(n, 1))


@dataclasses.dataclass(frozen=True)
class Comparison:
    metric: str
    base: float          # the recipe's side
    other: float         # the variant's side
    se: float            # standard error of the difference

    @property
    def separated(self) -> bool:
        return abs(self.other - self.base) > Z * self.se


def compare(metric: str, base: dict, other: dict) -> Comparison | None:
    """base/other: judge_metrics dicts (n, n_fail and the metric). None when either lacks it."""
    a, b = base.get(metric), other.get(metric)
    if a is None or b is None or any(isinstance(x, float) and math.isnan(x) for x in (a, b)):
        return None
    if metric == "auc":
        se = [auc_se(m[metric], m["n_fail"], m["n"] - m["n_fail"]) for m in (base, other)]
    elif metric == "fail_recall":
        se = [share_se(m[metric], m["n_fail"]) for m in (base, other)]
    else:
        se = [share_se(m[metric], m["n"]) for m in (base, other)]
    return Comparison(metric, float(a), float(b), math.sqrt(se[0] ** 2 + se[1] ** 2))


@dataclasses.dataclass(frozen=True)
class Lesson:
    name: str
    claim: str                       # the report's lesson
    source: str                      # which run measured it
    base_label: str                  # what base / other are
    other_label: str
    comparisons: tuple[Comparison, ...]
    expected_sign: int               # +1: the lesson says other > base on the first metric; -1: other < base
    note: str = ""                   # e.g. both rules chose the same step

    @property
    def holds(self) -> bool | None:
        """True when the first comparison moves the lesson's way beyond the noise, False when it
        moves the other way beyond the noise, None when the run cannot separate it."""
        if not self.comparisons:
            return None
        c = self.comparisons[0]
        if not c.separated:
            return None
        return (c.other - c.base) * self.expected_sign > 0


def ablation_lessons(rows: dict, source: str) -> list[Lesson]:
    """From a launch.ablate table's rows (each a judge_metrics dict with a step)."""
    def lesson(name, claim, base, other, metrics, sign):
        comps = tuple(c for m in metrics if (c := compare(m, rows[base], rows[other])) is not None)
        return Lesson(name, claim, source, base, other, comps, sign)
    return [lesson("reason_first", "reason-first collapses the middle zone (and the AUC)", "verdict_first",
                   "reason_first", ("middle_zone", "auc"), -1),
            lesson("oversample_3", "x3 failure oversampling raises fail recall", "oversample_1", "oversample_3",
                   ("fail_recall", "fail_precision", "auc"), +1),
            lesson("policy_init", "the policy's checkpoint beats a random start", "random_init", "policy_init",
                   ("auc", "middle_zone"), +1)]


def selection_lesson(sweep: dict, metrics_at_step, source: str) -> Lesson:
    """Selection by the declared rule against the lowest validation loss, on one sweep."""
    chosen, val_step = sweep["chosen"]["step"], sweep.get("lowest_val_loss_step")
    claim = "selecting the checkpoint by the downstream rule beats selecting it by validation loss"
    if val_step is None:
        return Lesson("selection", claim, source, "select_by_val_loss", "select_by_rule", (), +1,
                      note="the run logged no validation loss")
    by_rule, by_loss = metrics_at_step(sweep, chosen), metrics_at_step(sweep, val_step)
    comps = tuple(c for m in ("auc", "middle_zone") if (c := compare(m, by_loss, by_rule)) is not None)
    note = (f"both choose step {chosen}" if val_step == chosen
            else f"the rule chooses step {chosen}, the lowest validation loss is at step {val_step}")
    return Lesson("selection", claim, source, f"select_by_val_loss (step {val_step})",
                  f"select_by_rule (step {chosen})", comps, +1, note=note)


def lesson_lines(lessons: list[Lesson]) -> list[str]:
    """A markdown table: each lesson, its figures and whether the run separates it from noise."""
    out = ["| lesson (field report) | measured in | figures | verdict |", "|---|---|---|---|"]
    for ls in lessons:
        figs = "; ".join(f"{c.metric} {_fmt(c.base, c.metric)} ({ls.base_label}) -> {_fmt(c.other, c.metric)} "
                         f"({ls.other_label}), ±{_fmt(Z * c.se, c.metric)}" for c in ls.comparisons) or "n/a"
        if ls.note:
            figs += f" ({ls.note})"
        verdict = {True: "reproduced", False: "reversed beyond the noise",
                   None: "inside the noise: this run cannot separate it"}[ls.holds]
        out.append(f"| {ls.claim} | {ls.source} | {figs} | {verdict} |")
    return out


def _fmt(x: float, metric: str) -> str:
    return f"{x:.3f}" if metric == "auc" else f"{x:.1%}"
