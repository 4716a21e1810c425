"""Checkpoint selection by a declared rule (docs/operations.md, "Runbook": Sweep).

The sweep evaluates every saved step on the held-out split and must pick one. Validation loss is
the wrong criterion for a reward model: in the field report it bottomed at step 1100 while the
second epoch was making the judge over-confident — the middle zone (P(pass) in [0.2, 0.8]) fell
from 9.8 % to 5 %, fail recall from 52.6 % to 44.8 %. A judge that answers 0.01 / 0.99 gives GRPO
a 0/1 signal: groups of responses to one prompt tie, and a tied group has zero advantage.

The default rule therefore reads the downstream properties, in order:

1. **AUC gate** — keep checkpoints whose AUC is within `auc_tolerance` (0.015) of the best AUC.
   AUC is what the continuous reward uses; differences below ~0.015 are within held-out noise
   (1,440 samples / 116 fails in the report).
2. **Middle-zone gate** — of those, keep the ones with middle zone >= `min_middle_zone` (5 %),
   so the reward still spreads within a GRPO group.
3. **Objective** — take the highest fail-F1 (catching failures is the judge's job); ties go to
   the earlier step (less over-fitting, cheaper to reproduce).

On the report's table this picks step 900 (F1 57.3 %, AUC 0.908 vs best 0.920) over the
lowest-loss step 1100. If no checkpoint passes the gates, the fallback is the best AUC, and the
reason string says so — a silent fallback would hide a collapsed middle zone.

`objective="auc"` and `objective="val_loss"` exist for ablations; `SelectionRule.lowest_val_loss()`
is the naive rule (no gates) the report argues against, kept so the sweep can print both.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

OBJECTIVES = {           # name -> (SweepRow field, higher is better)
    "fail_f1": ("fail_f1", True),
    "auc": ("auc", True),
    "val_loss": ("val_loss", False),
}
_AUC_EPS = 1e-9          # "within 0.015" must include 0.920 vs 0.905 despite float rounding


@dataclasses.dataclass(frozen=True)
class SweepRow:
    """One evaluated checkpoint. Rates are fractions (0.573, not 57.3); None/NaN = not measured."""
    step: int
    accuracy: float
    fail_precision: float
    fail_recall: float
    fail_f1: float
    auc: float | None
    middle_zone: float
    img_corr: float | None = None
    val_loss: float | None = None

    @classmethod
    def from_metrics(cls, step: int, metrics: Mapping[str, Any], val_loss: float | None = None) -> "SweepRow":
        """From a `judge_metrics` dict (None in JSON-round-tripped dicts stands for NaN)."""
        return cls(step=int(step), accuracy=metrics["accuracy"], fail_precision=metrics["fail_precision"],
                   fail_recall=metrics["fail_recall"], fail_f1=metrics["fail_f1"], auc=metrics["auc"],
                   middle_zone=metrics["middle_zone"], img_corr=metrics.get("img_corr"), val_loss=val_loss)


@dataclasses.dataclass(frozen=True)
class SelectionRule:
    """The declared rule. A gate set to None is off."""
    auc_tolerance: float | None = 0.015
    min_middle_zone: float | None = 0.05
    objective: str = "fail_f1"

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective {self.objective!r} is not one of {sorted(OBJECTIVES)}")

    @classmethod
    def lowest_val_loss(cls) -> "SelectionRule":
        """The naive rule (ablation only): lowest validation loss, no gates."""
        return cls(auc_tolerance=None, min_middle_zone=None, objective="val_loss")

    def describe(self) -> str:
        gates = []
        if self.auc_tolerance is not None:
            gates.append(f"AUC within {self.auc_tolerance:g} of the best")
        if self.min_middle_zone is not None:
            gates.append(f"middle zone >= {self.min_middle_zone:.0%}")
        key, higher = OBJECTIVES[self.objective]
        pick = f"{'highest' if higher else 'lowest'} {key} (ties -> earlier step)"
        return (f"among checkpoints with {' and '.join(gates)}, " if gates else "") + pick


@dataclasses.dataclass(frozen=True)
class Choice:
    step: int
    reason: str                  # printed by the sweep, stored in sweep.json
    candidates: list[int]        # steps that passed the gates (empty on fallback)
    fallback: bool = False


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _best(rows: Sequence[SweepRow], key: str, higher: bool) -> SweepRow | None:
    scored = [r for r in rows if _finite(getattr(r, key))]
    if not scored:
        return None
    # Sort by step first so that, among equal values, the earliest step wins.
    scored = sorted(scored, key=lambda r: r.step)
    sign = 1.0 if higher else -1.0
    return max(scored, key=lambda r: sign * getattr(r, key))   # max keeps the first maximal element


def select_checkpoint(rows: Sequence[SweepRow], rule: SelectionRule = SelectionRule()) -> Choice:
    """Apply `rule` to the sweep rows; see the module docstring."""
    if not rows:
        raise ValueError("select_checkpoint needs at least one evaluated checkpoint")
    steps = [r.step for r in rows]
    if len(set(steps)) != len(steps):
        raise ValueError(f"duplicate steps in sweep rows: {sorted(s for s in set(steps) if steps.count(s) > 1)}")
    key, higher = OBJECTIVES[rule.objective]

    candidates = list(rows)
    best_auc_row = _best(rows, "auc", True)
    notes = []
    if rule.auc_tolerance is not None:
        if best_auc_row is None:
            candidates = []
        else:
            floor = best_auc_row.auc - rule.auc_tolerance
            candidates = [r for r in candidates if _finite(r.auc) and r.auc >= floor - _AUC_EPS]
            notes.append(f"best AUC {best_auc_row.auc:.3f} at step {best_auc_row.step}")
    if rule.min_middle_zone is not None:
        candidates = [r for r in candidates if _finite(r.middle_zone) and r.middle_zone >= rule.min_middle_zone]
    candidate_steps = sorted(r.step for r in candidates)

    chosen = _best(candidates, key, higher)
    if chosen is not None:
        reason = (f"step {chosen.step}: {key} {getattr(chosen, key):.3f} is the "
                  f"{'highest' if higher else 'lowest'} among {len(candidate_steps)} checkpoint(s) "
                  f"{candidate_steps} that pass the rule [{rule.describe()}]")
        if notes:
            reason += "; " + "; ".join(notes)
        return Choice(step=chosen.step, reason=reason, candidates=candidate_steps)

    # Fallback: nothing passed the gates. Best AUC keeps the property the reward depends on most.
    if best_auc_row is not None:
        return Choice(step=best_auc_row.step, fallback=True, candidates=[],
                      reason=(f"FALLBACK step {best_auc_row.step}: no checkpoint passes the rule "
                              f"[{rule.describe()}]; took the best AUC {best_auc_row.auc:.3f} instead"))
    last = max(rows, key=lambda r: r.step)
    return Choice(step=last.step, fallback=True, candidates=[],
                  reason=(f"FALLBACK step {last.step}: no checkpoint passes the rule and no AUC is "
                          f"defined (held-out set has one class?); took the last step"))


# ---------------------------------------------------------------- report table


def _pct(x: float | None) -> str:
    return f"{x:.1%}" if _finite(x) else "—"


def _num(x: float | None) -> str:
    return f"{x:.3f}" if _finite(x) else "—"


def format_table(rows: Sequence[SweepRow], chosen: int | Choice | None,
                 extra: Mapping[str, Mapping[int, str]] | None = None) -> str:
    """The report's markdown table, one row per step, the chosen row in bold and marked.
    ``extra``: more columns, header -> {step: cell} (e.g. the robustness audit's worst attack)."""
    chosen_step = chosen.step if isinstance(chosen, Choice) else chosen
    extra = extra or {}
    lines = ["| step | accuracy | fail P | fail R | F1 | AUC | middle zone | img corr | val loss |"
             + "".join(f" {h} |" for h in extra),
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(extra)]
    for r in sorted(rows, key=lambda r: r.step):
        cells = [str(r.step), _pct(r.accuracy), _pct(r.fail_precision), _pct(r.fail_recall), _pct(r.fail_f1),
                 _num(r.auc), _pct(r.middle_zone), _num(r.img_corr), _num(r.val_loss)]
        cells += [col.get(r.step, "—") for col in extra.values()]
        if r.step == chosen_step:
            cells = [f"**{c}**" for c in cells]
            cells[0] += " ← chosen"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
