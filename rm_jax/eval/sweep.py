"""The checkpoint sweep: score the held-out split at every saved step, pick one for RL use.

The field report picked step 900 over the lowest-validation-loss step 1100: a reward model is
chosen for what GRPO will do with it (AUC, middle zone, catching failures), so the sweep scores
every checkpoint the trainer kept with the real scorer (verdict slot, decoding for img/issues),
applies the declared selection rule (rm_jax.eval.selection), and then validates the chosen
checkpoint *as a reward*: separation by teacher label and within-group spread.

Held-out samples are re-read from the build's input JSONL by id and rendered by the same
renderer that built the shards, so the judge sees exactly what it saw in evaluation at train time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Sequence

import numpy as np

from rm_jax.data import records
from rm_jax.data.render import Renderer
from rm_jax.data.schema import Sample, read_samples
from rm_jax.data.attacks import ATTACK, of_kind
from rm_jax.eval import audit as audit_lib
from rm_jax import calibration as cal
from rm_jax.score import calibration_files
from rm_jax.eval import plots
from rm_jax.eval.baseline import shortcut_baseline
from rm_jax.metrics import METRIC_KEYS, failures_by_issue, judge_metrics, to_jsonable
from rm_jax.eval.reward_report import format_markdown, reward_report
from rm_jax.eval.selection import Choice, SelectionRule, SweepRow, format_table, select_checkpoint
from rm_jax.score.reward import RewardSettings, compute_reward, sample_has_image
from rm_jax.train.metrics_log import read_metrics


def split_samples(data_dir: str) -> dict[str, list[Sample]]:
    """The build's samples by split (ids from the shards, rows from the build's input JSONL)."""
    import grain
    with open(os.path.join(data_dir, "manifest.json")) as f:
        manifest = json.load(f)
    ids = {}
    for split in records.SPLITS:
        src = grain.sources.ArrayRecordDataSource(records.shard_paths(data_dir, split))
        ids[split] = [records.decode(src[i])["id"] for i in range(len(src))]
    by_id = {s.id: s for s in read_samples(manifest["input"]) if isinstance(s, Sample)}
    missing = [i for split in ids.values() for i in split if i not in by_id]
    if missing:
        raise ValueError(f"{len(missing)} built ids are not in {manifest['input']} (e.g. {missing[:3]}); "
                         f"was the input changed after the build?")
    return {split: [by_id[i] for i in split_ids] for split, split_ids in ids.items()}


def make_renderer(cfg, data_dir: str) -> Renderer:
    with open(os.path.join(data_dir, "manifest.json")) as f:
        manifest = json.load(f)
    return Renderer.from_config(cfg.data, manifest["tokenizer_dir"],
                                storage_dtype=manifest["build_options"]["pixel_dtype"])


@dataclasses.dataclass
class StepScores:
    step: int
    results: list                 # JudgeResult per held-out sample
    metrics: dict
    seconds: float


def _slices(samples: Sequence[Sample]) -> dict[str, np.ndarray]:
    tool = np.asarray([s.response.calls_tools for s in samples])
    img = np.asarray([sample_has_image(s) for s in samples])
    return {"tool_call": tool, "text_only": ~tool, "with_image": img, "without_image": ~img}


def has_p_pass(result) -> bool:
    """Scored: no render/length error, and (a reason-first judge) the decoder wrote the slot."""
    return result.error is None and result.slot_found


def scored_pairs(samples: Sequence[Sample], results: Sequence) -> tuple[list[Sample], list]:
    """The (sample, result) pairs that have a P(pass), as two aligned lists."""
    pairs = [(s, r) for s, r in zip(samples, results) if has_p_pass(r)]
    return [s for s, _ in pairs], [r for _, r in pairs]


def evaluate_results(samples: Sequence[Sample], results: Sequence) -> dict:
    """`results` are JudgeResults (decoded) or VerdictScores (--nodecode: no img, no parse status).

    Samples without a P(pass) (a reason-first judge that never wrote the verdict slot, a prompt
    over the largest bucket) are not guessed at: they are left out of every metric and counted
    as ``n_unscored``; a judge that loses many of them shows it there, not as a made-up score."""
    n_total = len(samples)
    samples, results = scored_pairs(samples, results)
    if not samples:
        return {"n": 0, "n_fail": 0, **{k: float("nan") for k in METRIC_KEYS[2:]}, "n_unscored": n_total}
    return {**_judge_metrics(samples, results), "n_unscored": n_total - len(samples)}


def _judge_metrics(samples: Sequence[Sample], results: Sequence) -> dict:
    labels = [s.label.l3 for s in samples]
    decoded = all(hasattr(r, "parse_ok") for r in results)
    return judge_metrics(labels, [r.p_pass for r in results],
                         img_pred=[r.img for r in results] if decoded else None,
                         img_true=[s.label.img for s in samples] if decoded else None,
                         parse_ok=[r.parse_ok for r in results] if decoded else None,
                         off_vocab_mass=[r.off_vocab_mass for r in results],
                         slices=_slices(samples))


def reward_records(samples: Sequence[Sample], results: Sequence,
                   reward: RewardSettings = RewardSettings()) -> list[dict]:
    out = []
    for s, r in zip(samples, results):
        issues = list(getattr(r, "issues", ()))   # undecoded (--nodecode): P(pass) and rules only
        rw = compute_reward(s, r.p_pass, issues, getattr(r, "img", None), *reward)
        out.append({"id": s.id, "prompt_id": s.prompt_id, "label": s.label.l3, "reward": rw.reward,
                    "rule_score": rw.rule_score, "p_pass": r.p_pass, "n_issues": len(issues),
                    "gated": bool(rw.components["gated"])})
    return out


def val_losses(workdir: str) -> dict[int, float]:
    rows = read_metrics(workdir)
    return {int(r["step"]): float(r["val_loss"]) for r in rows if r.get("val_loss") is not None}


def step_calibration(method: str, shares: dict, heldout: Sequence[Sample], results: Sequence) -> cal.Calibration:
    """One step's calibration: ``prior`` from the run's label shares; ``temperature`` fitted on the
    calibration half of the held-out split (``cal.calibration_split``) of this step's P(pass)."""
    if method == "none":
        return cal.IDENTITY
    if method == "prior":
        return cal.Calibration("prior", shift=cal.prior_shift(shares))
    samples, scored = scored_pairs(heldout, results)
    mask = cal.calibration_split([s.prompt_id for s in samples])
    p = np.clip(np.asarray([r.p_pass for r in scored], np.float64), cal.EPS, 1 - cal.EPS)
    y = np.asarray([s.label.l3 == "pass" for s in samples], np.float64)
    return cal.Calibration("temperature", temperature=cal.fit_temperature((np.log(p) - np.log1p(-p))[mask], y[mask]))


def calibrated(results: Sequence, calibration: cal.Calibration) -> list:
    """Results with P(pass) calibrated (the rows without one unchanged)."""
    if calibration.method == "none":
        return list(results)
    return [dataclasses.replace(r, p_pass=calibration.p_pass(r.p_pass)) if has_p_pass(r) else r for r in results]


@dataclasses.dataclass(frozen=True)
class Robustness:
    """The robustness audit in the sweep: attacks on a fixed subset of failing held-out samples."""
    samples: int = 0                 # failing held-out samples audited per step (0: no audit)
    gate: float | None = None        # a step whose worst attack flip rate exceeds this is not chosen
    seed: int = 0

    def subset(self, heldout: Sequence[Sample]) -> list[Sample]:
        return [s for s in heldout if s.label.l3 == "fail"][:self.samples]


def gate_rows(rows: Sequence[SweepRow], audits: dict[int, dict], gate: float | None
              ) -> tuple[list[SweepRow], dict[int, str]]:
    """(rows that pass the robustness gate, {excluded step: why})."""
    if gate is None:
        return list(rows), {}
    excluded = {}
    for r in rows:
        worst = audits[r.step]["worst_attack"]
        if worst is not None and worst["flip_rate"] > gate:
            excluded[r.step] = f"{worst['name']} flips {worst['flip_rate']:.1%} > gate {gate:.1%}"
    return [r for r in rows if r.step not in excluded], excluded


def run_sweep(workdir: str, data_dir: str, *, rule: SelectionRule = SelectionRule(), decode: bool = True,
              max_samples: int = 0, batch_size: int = 16, max_new_tokens: int = 64,
              progress: bool = False,
              reward: RewardSettings = RewardSettings(), calibration: str = "none",
              robustness: Robustness = Robustness()) -> dict:
    import jax
    if jax.process_count() > 1:
        raise RuntimeError(f"the sweep runs in one process; this one is process {jax.process_index()} of "
                           f"{jax.process_count()}: run it once, on one host")
    from rm_jax.score.checkpoints import list_steps, load_judge, read_run_config
    from rm_jax.score.scorer import Scorer

    t0 = time.time()
    cfg = read_run_config(workdir)
    renderer = make_renderer(cfg, data_dir)
    splits = split_samples(data_dir)
    heldout = splits["heldout"][:max_samples] if max_samples else splits["heldout"]
    if not heldout:
        raise ValueError(f"{data_dir}: the held-out split is empty")
    steps = list_steps(workdir)
    if not steps:
        raise FileNotFoundError(f"{workdir}/checkpoints holds no checkpoint to sweep")
    losses = val_losses(workdir)
    shares = calibration_files.label_shares(data_dir, int(cfg.data.oversample_fail))
    audit_subset = robustness.subset(heldout) if (robustness.samples or robustness.gate is not None) else []
    if robustness.gate is not None and not audit_subset:
        raise ValueError(f"--robustness_gate needs failing held-out samples to audit; {data_dir} has none "
                         f"among the {len(heldout)} scored")
    per_step: dict[int, StepScores] = {}
    raw_results: dict[int, list] = {}
    step_cal: dict[int, cal.Calibration] = {}
    audits: dict[int, dict] = {}
    for step in steps:
        ts = time.time()
        model, _, _ = load_judge(workdir, step)
        scorer = Scorer.for_run(model, renderer, cfg, batch_size=batch_size, max_new_tokens=max_new_tokens,
                                progress=progress)
        raw_results[step] = scorer.score(heldout) if decode else scorer.p_pass(heldout)
        step_cal[step] = step_calibration(calibration, shares, heldout, raw_results[step])
        results = calibrated(raw_results[step], step_cal[step])
        if audit_subset:
            audits[step] = audit_lib.audit(scorer, audit_subset, seed=robustness.seed,
                                           transforms=of_kind(ATTACK), batch=False)
        per_step[step] = StepScores(step, results, evaluate_results(heldout, results), time.time() - ts)
        print(f"step {step}: auc {per_step[step].metrics['auc']}, middle zone "
              f"{per_step[step].metrics['middle_zone']:.3f}, fail F1 {per_step[step].metrics['fail_f1']:.3f} "
              f"({per_step[step].seconds:.1f}s)", flush=True)
    rows = [SweepRow.from_metrics(s, per_step[s].metrics, losses.get(s)) for s in steps]
    allowed, excluded = gate_rows(rows, audits, robustness.gate)
    if allowed:
        choice = select_checkpoint(allowed, rule)
        if excluded:
            choice = dataclasses.replace(choice, reason=choice.reason + "; robustness gate excluded " + "; ".join(
                f"step {s} ({why})" for s, why in sorted(excluded.items())))
    else:
        least = min(rows, key=lambda r: (audits[r.step]["worst_attack"]["flip_rate"], r.step))
        choice = Choice(step=least.step, candidates=[], fallback=True,
                        reason=f"FALLBACK step {least.step}: every step exceeds the robustness gate "
                               f"{robustness.gate:.1%} (" + "; ".join(f"step {s}: {why}" for s, why in sorted(excluded.items()))
                               + "); took the lowest worst-attack flip rate")
    naive = select_checkpoint(rows, SelectionRule.lowest_val_loss()) if any(r.val_loss is not None for r in rows) else None
    chosen = per_step[choice.step]
    chosen_samples, chosen_results = scored_pairs(heldout, chosen.results)
    rewards = reward_records(chosen_samples, chosen_results, reward)
    # None when no held-out sample has a P(pass) at the chosen step (a reason-first judge that never
    # wrote the verdict slot): the sweep still reports every row, with n_unscored saying why.
    reward_val = reward_report(rewards) if chosen_samples else None
    baseline = shortcut_baseline(splits["train"], heldout)
    raw_samples, raw_chosen = scored_pairs(heldout, raw_results[choice.step])
    cal_table = None
    if raw_samples:
        cal_table = cal.calibration_table([r.p_pass for r in raw_chosen], [s.label.l3 == "pass" for s in raw_samples],
                                          cal.calibration_split([s.prompt_id for s in raw_samples]), shares)

    labels = [s.label.l3 for s in chosen_samples]
    p_pass = [r.p_pass for r in chosen_results]
    plot_dir = os.path.join(workdir, "plots")
    plot_paths = {"sweep": plots.plot_sweep(rows, choice.step, os.path.join(plot_dir, "sweep_metrics.png"))}
    if chosen_samples:
        plot_paths["reliability"] = plots.plot_reliability(
            labels, p_pass, os.path.join(plot_dir, f"reliability_step{choice.step}.png"))
        plot_paths["p_pass_hist"] = plots.plot_p_pass_hist(
            labels, p_pass, os.path.join(plot_dir, f"p_pass_hist_step{choice.step}.png"))
        plot_paths["reward_hist"] = plots.plot_reward_hist(
            labels, [r["reward"] for r in rewards], os.path.join(plot_dir, f"reward_hist_step{choice.step}.png"))
    if cal_table is not None:
        path = os.path.join(plot_dir, f"calibration_step{choice.step}.png")
        cal.reliability_diagram(path, cal_table.pop("curves"), xlabel="P(pass) (evaluation half of held-out)")
        plot_paths["calibration"] = path
    if step_cal[choice.step].method == "temperature":
        calibration_files.save_temperature(workdir, step_cal[choice.step].temperature, step=choice.step,
                             n=cal_table["n_calibration"] if cal_table else 0)
    out = to_jsonable({
        "workdir": os.path.abspath(workdir), "data": os.path.abspath(data_dir), "n_heldout": len(heldout),
        "rule": rule.describe(), "rows": [dataclasses.asdict(r) for r in rows],
        "chosen": {"step": choice.step, "reason": choice.reason, "candidates": choice.candidates,
                   "fallback": choice.fallback, **chosen.metrics,
                   "by_issue": failures_by_issue(labels, p_pass, [s.label.issues for s in chosen_samples])},
        "lowest_val_loss_step": naive.step if naive else None,
        "reward_validation": reward_val,
        "reward_config": reward.to_json(), "shortcut_baseline": baseline, "plots": plot_paths,
        "calibration": {"method": calibration, "applied": step_cal[choice.step].to_json(), "table": cal_table},
        "robustness": {"samples": len(audit_subset), "gate": robustness.gate,
                       "by_step": {s: a for s, a in audits.items()}, "excluded": excluded},
        "seconds": round(time.time() - t0, 2), "seconds_per_step": {s: round(v.seconds, 2) for s, v in per_step.items()},
    })
    with open(os.path.join(workdir, "sweep.json"), "w") as f:
        json.dump(out, f, indent=2)
    with open(os.path.join(workdir, "sweep.md"), "w") as f:
        f.write(format_sweep_markdown(out, rows, choice, audits))
    return out


def robustness_cells(audits: dict[int, dict]) -> dict[str, dict[int, str]]:
    """The sweep table's robustness column: each step's worst attack and its flip rate."""
    if not audits:
        return {}
    cells = {}
    for step, a in audits.items():
        w = a["worst_attack"]
        cells[step] = "—" if w is None else f"{w['flip_rate']:.1%} {w['name']}"
    return {"worst attack flip": cells}


def format_sweep_markdown(out: dict, rows: Sequence[SweepRow], choice, audits: dict[int, dict] | None = None) -> str:
    c = out["chosen"]
    lines = ["# Checkpoint sweep", "", f"Held-out samples: {out['n_heldout']}. Rule: {out['rule']}. "
             f"P(pass) calibration: {out['calibration']['method']}.", "",
             format_table(rows, choice, robustness_cells(audits or {})), "",
             f"**Chosen: step {c['step']}.** {c['reason']}"]
    rob = out["robustness"]
    if rob["samples"]:
        lines += ["", f"Robustness: attacks of rm_jax.data.attacks on the first {rob['samples']} failing held-out "
                  f"samples; flip rate = caught failures (P(pass) < 0.5) lifted to P(pass) >= 0.5; gate "
                  f"{'off' if rob['gate'] is None else format(rob['gate'], '.1%')}."]
    if out.get("lowest_val_loss_step") is not None:
        lines.append(f"(The lowest validation loss is at step {out['lowest_val_loss_step']}.)")
    lines += ["", "## Chosen checkpoint by slice", "", "| slice | n | fails | accuracy | fail F1 | AUC | middle zone |",
              "|---|---|---|---|---|---|---|"]
    for name, m in (c.get("slices") or {}).items():
        lines.append(f"| {name} | {m['n']} | {m['n_fail']} | {_fmt(m['accuracy'])} | {_fmt(m['fail_f1'])} | "
                     f"{_fmt(m['auc'], '{:.3f}')} | {_fmt(m['middle_zone'])} |")
    if c.get("by_issue"):
        lines += ["", "## Chosen checkpoint by teacher issue (failures only)", "",
                  "Each kind of failure the teacher filed, against every held-out pass: which failures the "
                  "judge catches and which it misses.", "",
                  "| teacher issue | fails | mean P(pass) | caught (P(pass) < 0.5) | AUC vs passes |",
                  "|---|---|---|---|---|"]
        for code, m in c["by_issue"].items():
            lines.append(f"| {code} | {m['n']} | {_fmt(m['mean_p_pass'], '{:.3f}')} | {_fmt(m['recall'])} | "
                         f"{_fmt(m['auc_vs_pass'], '{:.3f}')} |")
    lines += ["", f"Parse failures: {_fmt(c.get('parse_failure_rate'))}; mean off-vocab mass at the slot: "
              f"{_fmt(c.get('mean_off_vocab_mass'), '{:.4f}')}.", "", "## Reward validation (chosen step)", "",
              format_markdown(out["reward_validation"]) if out["reward_validation"] else
              "No held-out sample has a P(pass) at the chosen step (all unscored): nothing to validate.",
              "", "## Calibration of P(pass) (chosen step)", "", format_calibration(out["calibration"]),
              "", "## Shortcut baseline", "",
              f"Logistic regression on response length/format features only: held-out AUC "
              f"{_fmt(out['shortcut_baseline'].get('auc'), '{:.3f}')} (near 0.5 = the labels do not leak "
              f"through surface features)."]
    return "\n".join(lines) + "\n"


def format_calibration(record: dict) -> str:
    t = record["table"]
    if t is None:
        return "No held-out sample has a P(pass) at the chosen step: nothing to calibrate."
    sh = t["shares"]
    lines = [f"Temperature fitted on a calibration half of the held-out split ({t['n_calibration']} samples, "
             f"by prompt): T = {t['temperature']:.3f}. Prior shift {t['shift']:+.3f} (training stream "
             f"{sh['train_stream_fail_share']:.1%} fail, held-out {sh['heldout_fail_share']:.1%}). "
             f"Figures on the other {t['n_evaluation']} samples; applied in this sweep: {record['method']}.", "",
             "| calibration | NLL | Brier | ECE |", "|---|---|---|---|"]
    for name, m in t["rows"].items():
        lines.append(f"| {name} | {_fmt(m['nll'], '{:.4f}')} | {_fmt(m['brier'], '{:.4f}')} | {_fmt(m['ece'], '{:.4f}')} |")
    return "\n".join(lines)


def _fmt(x, fmt: str = "{:.1%}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not np.isfinite(x)) else fmt.format(x)
