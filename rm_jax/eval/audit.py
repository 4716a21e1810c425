"""Robustness audit of a judge: how P(pass) moves under attacks, fact edits and invariance rewrites.

An RL policy searches for whatever the judge over-rewards, so trust is measured before use. Each
transform of ``rm_jax.data.attacks`` is applied to labelled samples and both versions are scored
by the same scorer path ``launch.score`` uses (render -> verdict slot):

* **attack** (applied to failing samples): ``mean_delta_p_pass`` over them, and ``flip_rate`` =
  the share of *caught* failures (P(pass) < 0.5) that the attack lifts to P(pass) >= 0.5. A master
  key replaces the whole response, so its base is still the caught failures: the judge caught the
  real response, does it let the empty one through?
* **edit** (applied to passing samples): ``flip_rate`` = the share of accepted passes
  (P(pass) >= 0.5) that the edit drops below 0.5 (here higher is better: the judge saw the swap).
* **invariance** (every sample the rewrite applies to): ``max_abs_delta``; the batch invariance
  scores a subset alone, in reverse order and beside other companions and reports the largest
  difference from the main run.

Intervals are percentile bootstrap 95 % intervals (``scipy.stats.bootstrap``) over samples, with a
fixed seed so that two audits of one judge print the same table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Sequence

import numpy as np
from scipy import stats

from rm_jax.data import attacks
from rm_jax.data.attacks import ATTACK, EDIT, INVARIANCE, Transform, ValuePools
from rm_jax.data.schema import Sample

THRESHOLD = 0.5
N_RESAMPLES = 2000
BATCH_SUBSET = 16          # samples the batch invariance re-scores alone (one call each)


@dataclasses.dataclass(frozen=True)
class Estimate:
    value: float
    lo: float
    hi: float

    def to_json(self) -> dict:
        return {"value": _finite_or_none(self.value), "ci95": [_finite_or_none(self.lo), _finite_or_none(self.hi)]}


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def bootstrap_mean(x: Sequence[float], seed: int = 0) -> Estimate:
    """Mean with a percentile bootstrap 95 % interval; NaN interval below 2 observations."""
    x = np.asarray(x, np.float64)
    if len(x) == 0:
        return Estimate(math.nan, math.nan, math.nan)
    mean = float(x.mean())
    if len(x) < 2 or np.all(x == x[0]):    # no spread to resample: the interval is the point
        return Estimate(mean, mean if len(x) > 1 else math.nan, mean if len(x) > 1 else math.nan)
    res = stats.bootstrap((x,), np.mean, confidence_level=0.95, n_resamples=N_RESAMPLES, method="percentile",
                          random_state=np.random.default_rng(seed))
    return Estimate(mean, float(res.confidence_interval.low), float(res.confidence_interval.high))


@dataclasses.dataclass(frozen=True)
class TransformReport:
    name: str
    kind: str
    n: int                     # pairs scored (original and transformed both have a P(pass))
    n_not_applicable: int      # samples the transform does not apply to
    n_unscored: int            # transformed samples without a P(pass) (too long, render error)
    mean_delta_p_pass: Estimate
    flip_base: int             # caught failures (attack) / accepted passes (edit) / all pairs (invariance)
    flip_rate: Estimate
    max_abs_delta: float

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "n": self.n, "n_not_applicable": self.n_not_applicable,
                "n_unscored": self.n_unscored, "mean_delta_p_pass": self.mean_delta_p_pass.to_json(),
                "flip_base": self.flip_base, "flip_rate": self.flip_rate.to_json(),
                "max_abs_delta": _finite_or_none(self.max_abs_delta)}


def _flips(kind: str, before: np.ndarray, after: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(base mask, flipped indicator over the base) for one transform kind."""
    if kind == ATTACK:
        base = before < THRESHOLD
        return base, after[base] >= THRESHOLD
    if kind == EDIT:
        base = before >= THRESHOLD
        return base, after[base] < THRESHOLD
    base = np.ones(len(before), bool)
    return base, (before >= THRESHOLD) != (after >= THRESHOLD)


def target_samples(kind: str, samples: Sequence[Sample]) -> list[Sample]:
    """The samples a transform kind is measured on (attacks: failing; edits: passing; else all)."""
    if kind == ATTACK:
        return [s for s in samples if s.label.l3 == "fail"]
    if kind == EDIT:
        return [s for s in samples if s.label.l3 == "pass"]
    return list(samples)


def transform_report(t: Transform, before: dict[str, float], pairs: Sequence[tuple[Sample, float]],
                     n_not_applicable: int, seed: int) -> TransformReport:
    """``before``: original P(pass) by id; ``pairs``: (original sample, transformed P(pass), NaN = unscored)."""
    scored = [(before[s.id], p) for s, p in pairs if math.isfinite(p) and math.isfinite(before[s.id])]
    b = np.asarray([x for x, _ in scored], np.float64)
    a = np.asarray([y for _, y in scored], np.float64)
    base, flipped = _flips(t.kind, b, a)
    delta = a - b
    return TransformReport(
        name=t.name, kind=t.kind, n=len(scored), n_not_applicable=n_not_applicable,
        n_unscored=sum(1 for _, p in pairs if not math.isfinite(p)),
        mean_delta_p_pass=bootstrap_mean(delta, seed), flip_base=int(base.sum()),
        flip_rate=bootstrap_mean(flipped.astype(np.float64), seed),
        max_abs_delta=float(np.abs(delta).max()) if len(delta) else math.nan)


def _p_values(scores) -> list[float]:
    return [v.p_pass if v.error is None and v.slot_found else math.nan for v in scores]


def run_transforms(scorer, samples: Sequence[Sample], transforms: Sequence[Transform], *, seed: int = 0,
                   pools: ValuePools | None = None, before: dict[str, float] | None = None) -> list[TransformReport]:
    """Score every applicable (sample, transform) pair in one ``scorer.p_pass`` call."""
    pools = ValuePools.collect(samples) if pools is None else pools
    if before is None:
        before = dict(zip([s.id for s in samples], _p_values(scorer.p_pass(samples))))
    jobs: list[tuple[Transform, Sample, Sample]] = []
    not_applicable = {t.name: 0 for t in transforms}
    for t in transforms:
        for s in target_samples(t.kind, samples):
            out = t.apply(s, attacks.sample_rng(seed, s.id, t.name), pools)
            if out is None:
                not_applicable[t.name] += 1
            else:
                jobs.append((t, s, dataclasses.replace(out, id=f"{s.id}~{t.name}")))
    after = _p_values(scorer.p_pass([x for _, _, x in jobs])) if jobs else []
    reports = []
    for t in transforms:
        pairs = [(s, p) for (tj, s, _), p in zip(jobs, after) if tj.name == t.name]
        reports.append(transform_report(t, before, pairs, not_applicable[t.name], seed))
    return reports


def batch_invariance(scorer, samples: Sequence[Sample], before: dict[str, float], seed: int = 0) -> dict:
    """Largest |ΔP(pass)| of a subset scored alone, and in reverse order beside other companions,
    against the same samples scored in the main run."""
    rng = np.random.default_rng(seed)
    scored = [s for s in samples if math.isfinite(before[s.id])]
    if not scored:
        return {"n": 0, "max_abs_delta_alone": None, "max_abs_delta_reordered": None}
    pick = sorted(rng.choice(len(scored), size=min(BATCH_SUBSET, len(scored)), replace=False).tolist())
    subset = [scored[i] for i in pick]
    alone = [scorer.p_pass([s])[0].p_pass for s in subset]
    picked = set(pick)
    rest = [s for i, s in enumerate(scored) if i not in picked]
    companions = [rest[i] for i in rng.permutation(len(rest))[:len(subset)]]
    reordered = _p_values(scorer.p_pass(list(reversed(subset)) + companions))[:len(subset)][::-1]
    ref = np.asarray([before[s.id] for s in subset])
    return {"n": len(subset),
            "max_abs_delta_alone": float(np.max(np.abs(np.asarray(alone) - ref))),
            "max_abs_delta_reordered": float(np.max(np.abs(np.asarray(reordered) - ref)))}


def worst_attack(reports: Sequence[TransformReport]) -> TransformReport | None:
    """The attack with the highest flip rate (ties: table order); None without any measured attack."""
    measured = [r for r in reports if r.kind == ATTACK and r.flip_base and math.isfinite(r.flip_rate.value)]
    return max(measured, key=lambda r: r.flip_rate.value, default=None)


def audit(scorer, samples: Sequence[Sample], *, seed: int = 0,
          transforms: Sequence[Transform] = attacks.TRANSFORMS, batch: bool = True) -> dict:
    """The audit record (``audit.json``'s body): per transform, the invariance maxima, the worst attack."""
    unlabelled = [s.id for s in samples if s.label is None]
    if unlabelled:
        raise ValueError(f"the audit needs labelled samples; {len(unlabelled)} have no label (e.g. {unlabelled[:3]})")
    if len({s.id for s in samples}) != len(samples):
        raise ValueError("the audit needs unique sample ids")
    before = dict(zip([s.id for s in samples], _p_values(scorer.p_pass(samples))))
    reports = run_transforms(scorer, samples, transforms, seed=seed, before=before)
    inv = {r.name: _finite_or_none(r.max_abs_delta) for r in reports if r.kind == INVARIANCE}
    if batch:
        b = batch_invariance(scorer, samples, before, seed)
        inv["batch_alone"], inv["batch_reordered"] = b["max_abs_delta_alone"], b["max_abs_delta_reordered"]
    worst = worst_attack(reports)
    return {"n_samples": len(samples), "n_fail": sum(s.label.l3 == "fail" for s in samples),
            "n_pass": sum(s.label.l3 == "pass" for s in samples),
            "n_unscored": sum(1 for p in before.values() if not math.isfinite(p)),
            "threshold": THRESHOLD, "transforms": [r.to_json() for r in reports],
            "invariance_max_abs_delta": inv,
            "worst_attack": None if worst is None else {"name": worst.name, "flip_rate": worst.flip_rate.value}}


def _pct(e: dict) -> str:
    v, (lo, hi) = e["value"], e["ci95"]
    if v is None:
        return "n/a"
    return f"{v:.1%}" + (f" [{lo:.1%}, {hi:.1%}]" if lo is not None else "")


def _num(e: dict) -> str:
    v, (lo, hi) = e["value"], e["ci95"]
    if v is None:
        return "n/a"
    return f"{v:+.3f}" + (f" [{lo:+.3f}, {hi:+.3f}]" if lo is not None else "")


def format_markdown(record: dict) -> str:
    lines = ["# Robustness audit", "",
             f"Samples: {record['n_samples']} ({record['n_fail']} fail, {record['n_pass']} pass); "
             f"step {record.get('step')}. Intervals: bootstrap 95 %.", ""]
    heads = {ATTACK: ("Attacks on failing responses", "flip rate (caught -> P(pass) >= 0.5)", "caught"),
             EDIT: ("Fact edits of passing responses", "flip rate (accepted -> P(pass) < 0.5, higher is better)",
                    "accepted"),
             INVARIANCE: ("Invariances", "verdict changed", "pairs")}
    for kind, (title, flip_head, base_head) in heads.items():
        rows = [r for r in record["transforms"] if r["kind"] == kind]
        if not rows:
            continue
        lines += [f"## {title}", "", f"| transform | n | not applicable | unscored | mean ΔP(pass) | {base_head} | "
                  f"{flip_head} | max abs Δ |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            mx = "n/a" if r["max_abs_delta"] is None else f"{r['max_abs_delta']:.2e}"
            lines.append(f"| {r['name']} | {r['n']} | {r['n_not_applicable']} | {r['n_unscored']} | "
                         f"{_num(r['mean_delta_p_pass'])} | {r['flip_base']} | {_pct(r['flip_rate'])} | {mx} |")
        lines.append("")
    lines += ["## Invariance maxima (|ΔP(pass)|)", "", "| invariance | max abs Δ |", "|---|---|"]
    for name, v in record["invariance_max_abs_delta"].items():
        lines.append(f"| {name} | {'n/a' if v is None else f'{v:.2e}'} |")
    w = record["worst_attack"]
    lines += ["", f"Worst attack: {w['name']} ({w['flip_rate']:.1%})." if w else "Worst attack: none measured."]
    return "\n".join(lines) + "\n"


def write_audit(record: dict, out_dir: str) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "audit.json"), "md": os.path.join(out_dir, "audit.md")}
    with open(paths["json"], "w") as f:
        json.dump(record, f, indent=2)
    with open(paths["md"], "w") as f:
        f.write(format_markdown(record))
    return paths


def audit_file(workdir: str, input_path: str, out_dir: str, *, step: int | None = None, max_samples: int = 0,
               batch_size: int = 16, seed: int = 0, tokenizer: str = "") -> dict:
    """``launch.audit``: load the judge as ``launch.score`` does, audit the labelled samples of
    ``input_path`` (rows that break the contract are counted by reason, not audited), write
    ``audit.json`` / ``audit.md`` into ``out_dir``."""
    from rm_jax.data.schema import Reject, read_samples
    from rm_jax.score.checkpoints import load_judge
    from rm_jax.score.run import renderer_for
    from rm_jax.score.scorer import Scorer

    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"--input={input_path}: no such file (a labelled samples JSONL)")
    samples, rejected = [], {}
    for item in read_samples(input_path, require_label=True):
        if isinstance(item, Reject):
            rejected[item.reason] = rejected.get(item.reason, 0) + 1
        else:
            samples.append(item)
    if max_samples:
        samples = samples[:max_samples]
    if not samples:
        raise ValueError(f"{input_path}: no valid labelled sample to audit (rejected by reason: {rejected})")
    cfg, renderer = renderer_for(workdir, tokenizer)
    model, _, used_step = load_judge(workdir, step)
    scorer = Scorer.for_run(model, renderer, cfg, batch_size=batch_size, max_new_tokens=1, progress=True)
    record = {"workdir": os.path.abspath(workdir), "step": used_step, "input": os.path.abspath(input_path),
              "rejected_by_reason": rejected, **audit(scorer, samples, seed=seed)}
    record["paths"] = write_audit(record, out_dir)
    return record
