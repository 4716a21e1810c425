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
from rm_jax.eval import plots
from rm_jax.eval.baseline import shortcut_baseline
from rm_jax.metrics import METRIC_KEYS, failures_by_issue, judge_metrics, to_jsonable
from rm_jax.eval.reward_report import format_markdown, reward_report
from rm_jax.eval.selection import SelectionRule, SweepRow, format_table, select_checkpoint
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


def run_sweep(workdir: str, data_dir: str, *, rule: SelectionRule = SelectionRule(), decode: bool = True,
              max_samples: int = 0, batch_size: int = 16, max_new_tokens: int = 64,
              progress: bool = False,
              reward: RewardSettings = RewardSettings()) -> dict:
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
    per_step: dict[int, StepScores] = {}
    for step in steps:
        ts = time.time()
        model, _, _ = load_judge(workdir, step)
        scorer = Scorer.for_run(model, renderer, cfg, batch_size=batch_size, max_new_tokens=max_new_tokens,
                                progress=progress)
        results = scorer.score(heldout) if decode else scorer.p_pass(heldout)
        per_step[step] = StepScores(step, results, evaluate_results(heldout, results), time.time() - ts)
        print(f"step {step}: auc {per_step[step].metrics['auc']}, middle zone "
              f"{per_step[step].metrics['middle_zone']:.3f}, fail F1 {per_step[step].metrics['fail_f1']:.3f} "
              f"({per_step[step].seconds:.1f}s)", flush=True)
    rows = [SweepRow.from_metrics(s, per_step[s].metrics, losses.get(s)) for s in steps]
    choice = select_checkpoint(rows, rule)
    naive = select_checkpoint(rows, SelectionRule.lowest_val_loss()) if any(r.val_loss is not None for r in rows) else None
    chosen = per_step[choice.step]
    chosen_samples, chosen_results = scored_pairs(heldout, chosen.results)
    rewards = reward_records(chosen_samples, chosen_results, reward)
    # None when no held-out sample has a P(pass) at the chosen step (a reason-first judge that never
    # wrote the verdict slot): the sweep still reports every row, with n_unscored saying why.
    reward_val = reward_report(rewards) if chosen_samples else None
    baseline = shortcut_baseline(splits["train"], heldout)

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
    out = to_jsonable({
        "workdir": os.path.abspath(workdir), "data": os.path.abspath(data_dir), "n_heldout": len(heldout),
        "rule": rule.describe(), "rows": [dataclasses.asdict(r) for r in rows],
        "chosen": {"step": choice.step, "reason": choice.reason, "candidates": choice.candidates,
                   "fallback": choice.fallback, **chosen.metrics,
                   "by_issue": failures_by_issue(labels, p_pass, [s.label.issues for s in chosen_samples])},
        "lowest_val_loss_step": naive.step if naive else None,
        "reward_validation": reward_val,
        "reward_config": reward.to_json(), "shortcut_baseline": baseline, "plots": plot_paths,
        "seconds": round(time.time() - t0, 2), "seconds_per_step": {s: round(v.seconds, 2) for s, v in per_step.items()},
    })
    with open(os.path.join(workdir, "sweep.json"), "w") as f:
        json.dump(out, f, indent=2)
    with open(os.path.join(workdir, "sweep.md"), "w") as f:
        f.write(format_sweep_markdown(out, rows, choice))
    return out


def format_sweep_markdown(out: dict, rows: Sequence[SweepRow], choice) -> str:
    c = out["chosen"]
    lines = ["# Checkpoint sweep", "", f"Held-out samples: {out['n_heldout']}. Rule: {out['rule']}.", "",
             format_table(rows, choice), "",
             f"**Chosen: step {c['step']}.** {c['reason']}"]
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
              "", "## Shortcut baseline", "",
              f"Logistic regression on response length/format features only: held-out AUC "
              f"{_fmt(out['shortcut_baseline'].get('auc'), '{:.3f}')} (near 0.5 = the labels do not leak "
              f"through surface features)."]
    return "\n".join(lines) + "\n"


def _fmt(x, fmt: str = "{:.1%}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not np.isfinite(x)) else fmt.format(x)
