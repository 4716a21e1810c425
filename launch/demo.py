"""The whole pipeline on the embedded default, one command: `make demo`.

  python -m launch.demo [--workdir=runs/demo] [--n=10000] [--fail_rate=0.3] [--seed=0] [--train_steps=1000]
      [--policy_steps=300] [--oversample_fail=0] [--base=assets/tiny_base | --base=] [--ablation=runs/ablation]

Each stage runs through its own CLI (exactly what a user would type), timed:
[base check (the committed assets/tiny_base by default): a base whose generator hash differs from
rm_jax/data/synth.py today, or whose architecture is not the config's model, is refused] ->
synth (with the base's tokenizer) -> policy_sft (from the base) (next-token SFT on the passing responses, exported with launch.convert --to_hf;
cached by content hash under WORKDIR/policy) -> build_data -> train (the judge, initialized from the
policy with train.init_from) -> sweep -> score. Writes WORKDIR/report.json (with a `chosen`
object: the step and the judge_metrics keys), WORKDIR/report.md and WORKDIR/plots/ (the sweep's
plots and the training curve). The report sets the chosen judge beside the field report's v3, the
shortcut baseline and the presence rule on the held-out split, and lists the report's lessons with
their figures: selection by rule against val loss from this run's sweep, the other three from a
finished `make ablation` in --ablation when there is one. Runs from any directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time

from absl import app, flags

from launch.common import DEFAULT_BASE, DEFAULT_CONFIG, REPO_ROOT, metrics_at, resolve_base
from rm_jax.data import build_rows
from rm_jax.data.base_provenance import BaseProvenance
from rm_jax.eval import lessons as lessons_lib
from rm_jax.eval.presence import presence_aucs

ROBUSTNESS_SAMPLES = 100   # failing held-out samples the sweep attacks per checkpoint

_WORKDIR = flags.DEFINE_string("workdir", "runs/demo", "where everything is written")
_N = flags.DEFINE_integer("n", 10000, "synthetic samples")
# Real teacher data fails ~8% of the time; a 10-minute CPU run needs more failures to learn from.
_FAIL_RATE = flags.DEFINE_float("fail_rate", 0.3, "synthetic failure rate")
_SEED = flags.DEFINE_integer("seed", 0, "synthetic data seed")
_CONFIG = flags.DEFINE_string("config", DEFAULT_CONFIG, "config file for every stage")
_TRAIN_STEPS = flags.DEFINE_integer("train_steps", 1000, "override train.steps (0 = the config's epochs)")
_POLICY_STEPS = flags.DEFINE_integer("policy_steps", 300, "policy SFT steps (0 = judge from random init)")
# 0 keeps the config's x3 (the report's recipe). 1 (an unshifted stream) was measured worse here:
# held-out AUC 0.546 at 500 steps, P(pass) stuck at the prior (docs/experiments/, issue 16).
_OVERSAMPLE = flags.DEFINE_integer("oversample_fail", 0, "data.oversample_fail for the judge's stream (0 = the config's)")
_SCORE_N = flags.DEFINE_integer("score_n", 64, "rows of the input scored by the score stage")
_SWEEP_MAX = flags.DEFINE_integer("sweep_max_samples", 700, "held-out samples the sweep scores per checkpoint (0 = all)")
_BASE = flags.DEFINE_string("base", DEFAULT_BASE, "a pretrained base (launch.pretrain_base --out) of the "
                            "config's architecture: its tokenizer and weights start the policy; '' = random init")
_ABLATION = flags.DEFINE_string("ablation", "runs/ablation", "a finished launch.ablate workdir whose table the "
                                "report's lessons quote (skipped when absent)")


def _run(stage: str, args: list[str], timings: dict) -> None:
    cmd = [sys.executable, "-m", f"launch.{stage}", *args]
    print(f"\n=== {stage}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    # From the repo root, so `-m launch.<stage>` resolves without an installed package too.
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)
    timings[stage] = round(time.time() - t0, 2)
    print(f"=== {stage} done in {timings[stage]:.1f}s", flush=True)


def _loader_check(data_dir: str, timings: dict) -> dict:
    """Pull a few training batches through the Grain loader: shapes and the oversampled mix."""
    from launch.common import load_config
    from rm_jax.data import loader

    cfg = load_config(_CONFIG.value)
    t0 = time.time()
    ds = loader.make_dataset(data_dir, "train", loader.LoaderConfig(batch_size=8, buckets=tuple(cfg.data.buckets)))
    it = loader.make_iterator(ds)
    n_fail = n = 0
    shapes = set()
    for _ in range(25):
        b = next(it)
        n_fail += int(b["label"].sum())
        n += int(b["example_valid"].sum())
        shapes.add(b["input_ids"].shape)
    timings["loader_check"] = round(time.time() - t0, 2)
    out = {"batches": 25, "samples": n, "fail_share_in_stream": n_fail / n, "batch_shapes": sorted(shapes)}
    print(f"\n=== loader: {out}")
    return out


def main(argv):
    del argv
    work = os.path.abspath(_WORKDIR.value)   # the stages run from the repo root
    os.makedirs(work, exist_ok=True)
    data, shards, run = (os.path.join(work, d) for d in ("data", "shards", "train"))
    provenance, base_hf = resolve_base(_BASE.value, _CONFIG.value)
    timings: dict[str, float] = {}
    t0 = time.time()
    _run("synth", [f"--out={data}", f"--n={_N.value}", f"--seed={_SEED.value}", f"--fail_rate={_FAIL_RATE.value}",
                   *([f"--tokenizer={base_hf}"] if base_hf else [])], timings)
    policy_hf = base_hf   # --policy_steps=0: the judge starts from the base (or random init)
    if _POLICY_STEPS.value:
        _run("policy_sft", [f"--input={data}/samples.jsonl", f"--out={work}/policy", f"--config={_CONFIG.value}",
                            f"--steps={_POLICY_STEPS.value}", f"--init_from={base_hf}"], timings)
        policy_hf = os.path.join(work, "policy", "hf")
    oversample = [f"--config.data.oversample_fail={_OVERSAMPLE.value}"] if _OVERSAMPLE.value else []
    _run("build_data", [f"--input={data}/samples.jsonl", f"--out={shards}", f"--config={_CONFIG.value}", *oversample],
         timings)
    with open(os.path.join(shards, "stats.json")) as f:
        stats = json.load(f)
    loader_info = _loader_check(shards, timings)
    train_args = [f"--config={_CONFIG.value}", f"--workdir={run}", f"--config.data.dir={shards}", *oversample,
                  f"--config.train.init_from={policy_hf}"]
    if _TRAIN_STEPS.value:
        train_args.append(f"--config.train.steps={_TRAIN_STEPS.value}")
    if os.path.isdir(run):
        # The data stages above may have rebuilt the shards: a demo run trains from scratch
        # (the trainer refuses to resume checkpoints trained on other data).
        print(f"=== removing the previous demo training run {run}", flush=True)
        shutil.rmtree(run)
    _run("train", train_args, timings)
    # The robustness column (attacks on failing held-out samples, per step); the gate stays off.
    _run("sweep", [f"--workdir={run}", f"--data={shards}", f"--max_samples={_SWEEP_MAX.value}",
                   f"--robustness_samples={ROBUSTNESS_SAMPLES}"], timings)
    score_in = os.path.join(data, "score_input.jsonl")   # beside samples.jsonl: image paths stay valid
    with open(f"{data}/samples.jsonl") as src, open(score_in, "w") as dst:
        for i, line in enumerate(src):
            if i >= _SCORE_N.value:
                break
            dst.write(line)
    _run("score", [f"--workdir={run}", f"--input={score_in}", f"--out={work}/scores.jsonl"], timings)
    timings["total"] = round(time.time() - t0, 2)
    with open(os.path.join(run, "sweep.json")) as f:
        sweep = json.load(f)
    with open(os.path.join(work, "scores.jsonl")) as f:
        scores = [json.loads(line) for line in f]
    plots = collect_plots(work, run, sweep["plots"])
    with open(f"{data}/samples.jsonl") as f:
        presence = heldout_presence([json.loads(line) for line in f], shards)
    lessons = report_lessons(sweep, os.path.abspath(_ABLATION.value))
    write_report(work, timings, stats, loader_info, sweep, scores, plots, presence, lessons, provenance)
    print(f"\nreport: {work}/report.md")


def collect_plots(work: str, run: str, sweep_plots: dict) -> dict:
    """W/plots/: the sweep's plots (copied from the training workdir) and the training curve."""
    from rm_jax.eval.plots import plot_training
    from rm_jax.train.metrics_log import read_metrics
    out_dir = os.path.join(work, "plots")
    os.makedirs(out_dir, exist_ok=True)
    plots = {}
    for name, path in sweep_plots.items():
        plots[name] = os.path.join(out_dir, os.path.basename(path))
        shutil.copy2(path, plots[name])
    plots["training"] = plot_training(read_metrics(run),
                                      os.path.join(out_dir, "training_loss.png"))
    return plots


def heldout_presence(samples: list[dict], shards: str) -> dict:
    """The presence rule (rm_jax.eval.presence) on the held-out split the sweep scores from."""
    with open(os.path.join(shards, "manifest.json")) as f:
        opts = json.load(f)["build_options"]
    held = [s for s in samples if build_rows.split_of(s["prompt_id"], opts["heldout_fraction"],
                                                      opts["split_seed"]) == "heldout"]
    return presence_aucs(held)


def report_lessons(sweep: dict, ablation_dir: str) -> dict:
    """The report's lessons: selection from this run's sweep; the rest from a launch.ablate table."""
    found = [lessons_lib.selection_lesson(sweep, metrics_at, "this run's sweep")]
    path = os.path.join(ablation_dir, "ablation.json")
    ablation = None
    if os.path.isfile(path):
        with open(path) as f:
            ablation = json.load(f)
        found += lessons_lib.ablation_lessons(ablation["rows"], f"make ablation ({ablation['n']} samples, "
                                              f"{ablation['steps']} judge steps, seed {ablation['seed']})")
    return {"lessons": found, "ablation": path if ablation else None}


def write_report(work, timings, stats, loader_info, sweep, scores, plots, presence, lessons, provenance) -> None:
    from rm_jax.eval.metrics import METRIC_KEYS
    chosen = {"step": sweep["chosen"]["step"], **{k: sweep["chosen"][k] for k in METRIC_KEYS}}
    scored = [s for s in scores if "error" not in s]
    report = {"workdir": work, "wall_seconds": timings, "chosen": chosen,
              "chosen_reason": sweep["chosen"]["reason"], "sweep_rows": sweep["rows"],
              "reward_validation": sweep["reward_validation"], "shortcut_baseline": sweep["shortcut_baseline"],
              "presence_rule": presence, "base": dataclasses.asdict(provenance) if provenance else None,
              "lessons": [{"name": ls.name, "holds": ls.holds, "source": ls.source, "note": ls.note,
                           "comparisons": [dataclasses.asdict(c) | {"separated": c.separated}
                                           for c in ls.comparisons]} for ls in lessons["lessons"]],
              "build_stats": stats, "loader": loader_info, "plots": plots,
              "score": {"rows": len(scores), "scored": len(scored), "errors": len(scores) - len(scored)}}
    with open(os.path.join(work, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=list)
    with open(os.path.join(sweep["workdir"], "sweep.md")) as f:
        sweep_md = f.read()
    goal_auc = chosen["auc"] is not None and chosen["auc"] >= 0.90
    goal_mz = 0.05 <= chosen["middle_zone"] <= 0.40
    lines = ["# rm_jax demo report", "",
             f"Chosen checkpoint: step {chosen['step']} — AUC {_num(chosen['auc'])} (goal >= 0.90: "
             f"{'met' if goal_auc else 'not met'}), middle zone {chosen['middle_zone']:.1%} (goal 5-40%: "
             f"{'met' if goal_mz else 'not met'}), accuracy {chosen['accuracy']:.1%} vs majority "
             f"{chosen['majority_baseline']:.1%}, fail F1 {chosen['fail_f1']:.1%}, img corr {_num(chosen['img_corr'])}.",
             f"Shortcut baseline (length/format features only) AUC: {_num(sweep['shortcut_baseline'].get('auc'))}; "
             f"presence rule (values of the response missing from the conversation) on the held-out split: "
             f"{_num(presence['conversation'])}.",
             "", base_line(provenance),
             "", *compared_with_field_report(chosen, sweep, presence), "",
             *presence_by_kind(sweep, presence), "",
             "## The field report's lessons", "",
             *lessons_lib.lesson_lines(lessons["lessons"]), "",
             ("" if lessons["ablation"] else f"Reason-first, x3 oversampling and the policy start are measured by "
              f"`make ablation` (about 25 minutes); no finished table was found at {_ABLATION.value}, so this "
              "run does not show them."), "",
             "## Wall time by stage", "", "| stage | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in timings.items()]
    lines += ["", "## Data", "",
              f"Build: read {stats['read']}, kept {stats['kept']}, rejected {stats['rejected']} "
              f"{stats['rejected_by_reason']}. Splits: {stats['splits']}. Oversampling: {stats['oversampling']}.",
              f"Loader check: fail share in the training stream {loader_info['fail_share_in_stream']:.1%}.",
              "", f"Score stage: {report['score']['scored']} rows scored, {report['score']['errors']} errors.",
              "", "## Plots", "", *[f"- {name}: `{os.path.relpath(path, work)}`" for name, path in plots.items()],
              "", sweep_md.replace("# Checkpoint sweep", "## Checkpoint sweep")]
    with open(os.path.join(work, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


# The field report's v3 judge (its §7-9): the figures this demo is read against.
FIELD_REPORT_V3 = {"auc": 0.908, "middle_zone": 0.098, "accuracy": 0.937, "majority_baseline": 0.919,
                   "fail_precision": 0.629, "fail_recall": 0.526, "img_corr": 0.669, "issues_pass": 0.03,
                   "issues_fail": 1.28, "separation_auc": 0.821, "rule_pass": 0.883, "rule_fail": 0.633,
                   "zero_span": "0 of 20 steps"}


def base_line(provenance: BaseProvenance | None) -> str:
    if provenance is None:
        return "Start: the policy SFT from random init (no --base)."
    return (f"Start: the pretrained tiny base (seed {provenance.data_seed}, {provenance.examples['kept']} LM "
            f"examples, {provenance.steps} steps, held-out LM loss {_num(provenance.heldout_loss)}), then the "
            "policy SFT from it, then the judge from the policy.")


def presence_by_kind(sweep: dict, presence: dict) -> list[str]:
    """Per failure kind: the chosen judge's AUC beside the presence rule's, on the same split."""
    by_issue = sweep["chosen"].get("by_issue") or {}
    lines = ["## Per failure kind: the judge against the presence rule", "",
             "| kind | held-out failures | judge AUC | presence rule AUC |", "|---|---|---|---|"]
    for kind, rule in presence["by_issue"].items():
        judge = by_issue.get(kind, {})
        lines.append(f"| {kind} | {rule['n']} | {_num(judge.get('auc_vs_pass'))} | {_num(rule['conversation'])} |")
    return lines


def compared_with_field_report(chosen: dict, sweep: dict, presence: dict) -> list[str]:
    rv = sweep["reward_validation"]
    bl, groups = rv["by_label"], rv["groups"]
    v3 = FIELD_REPORT_V3
    pct = lambda x: "n/a" if x is None else f"{x:.1%}"  # noqa: E731
    rows = [("AUC", _num(v3["auc"]), _num(chosen["auc"])),
            ("middle zone (0.2 <= P(pass) <= 0.8)", pct(v3["middle_zone"]), pct(chosen["middle_zone"])),
            ("accuracy / majority baseline", f"{pct(v3['accuracy'])} / {pct(v3['majority_baseline'])}",
             f"{pct(chosen['accuracy'])} / {pct(chosen['majority_baseline'])}"),
            ("fail precision / recall", f"{pct(v3['fail_precision'])} / {pct(v3['fail_recall'])}",
             f"{pct(chosen['fail_precision'])} / {pct(chosen['fail_recall'])}"),
            ("img correlation", _num(v3["img_corr"]), _num(chosen["img_corr"])),
            ("issues listed, passes / fails", f"{v3['issues_pass']:.2f} / {v3['issues_fail']:.2f}",
             f"{_num(bl['pass']['n_issues'])} / {_num(bl['fail']['n_issues'])}"),
            ("reward separation AUC", _num(v3["separation_auc"]), _num(rv["separation_auc_reward"])),
            ("rule part, passes / fails", f"+{v3['rule_pass']:.3f} / +{v3['rule_fail']:.3f}",
             f"{_num(bl['pass']['rule_score'])} / {_num(bl['fail']['rule_score'])}"),
            ("GRPO zero-span groups", v3["zero_span"],
             f"{groups['zero_span_groups']} of {groups['groups_with_spread_possible']} groups"),
            ("shortcut baseline AUC", "—", _num(sweep["shortcut_baseline"].get("auc"))),
            ("presence rule AUC (held-out)", "—", _num(presence["conversation"]))]
    return ["## Compared with the field report (v3)", "", "| figure | field report v3 | this run |",
            "|---|---|---|", *[f"| {a} | {b} | {c} |" for a, b, c in rows]]


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    app.run(main)
