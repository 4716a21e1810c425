"""The field report's ablation table on the embedded default: `make ablation`.

  python -m launch.ablate --workdir=W [--n=10000] [--steps=500] [--policy_steps=300] [--seed=0]
      [--base=assets/tiny_base | --base=]

Every variant trains on the same synthetic set (one launch.synth run), with the same budget and
seed, and changes one factor of the demo's recipe (verdict-first target, the policy's SFT
checkpoint as init, an unshifted stream):

  verdict_first  the recipe                         reason_first   the reason before the verdict
  oversample_1   the recipe (stream = label share)  oversample_3   failures repeated x3
  policy_init    the recipe                         random_init    no policy checkpoint

so verdict_first, oversample_1 and policy_init are one training run (the table says so). With a
base (the committed assets/tiny_base by default; --base= for none) the data takes the base's
tokenizer and the policy starts from the base, as in launch.demo; random_init stays a judge from
random weights. Each row
holds the judge_metrics keys of the checkpoint the sweep's declared rule chooses, and its step;
reason-first is scored at the verdict slot found after decoding, as the scorer does. Two more rows
take the recipe's run and pick its checkpoint by the lowest validation loss (`select_by_val_loss`)
or by the declared rule (`select_by_rule`). Writes W/ablation.json and W/ablation.md.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from launch.common import DEFAULT_BASE, DEFAULT_CONFIG, metrics_at, resolve_base, run_stage

_WORKDIR = flags.DEFINE_string("workdir", None, "where everything is written", required=True)
_N = flags.DEFINE_integer("n", 10000, "synthetic samples")
_STEPS = flags.DEFINE_integer("steps", 500, "judge training steps per variant")
_POLICY_STEPS = flags.DEFINE_integer("policy_steps", 300, "policy SFT steps (shared by the policy_init runs)")
_SEED = flags.DEFINE_integer("seed", 0, "synthetic data and training seed")
_SWEEP_MAX = flags.DEFINE_integer("sweep_max_samples", 700, "held-out samples the sweep scores per checkpoint")
_CONFIG = flags.DEFINE_string("config", DEFAULT_CONFIG, "config file for every stage")
_BASE = flags.DEFINE_string("base", DEFAULT_BASE, "a pretrained base (launch.pretrain_base --out) of the "
                            "config's architecture that the policy starts from; '' = random init")

REASON_FIRST = "('reason','l3','issues','img')"
# run name -> (field order or None, oversample_fail, policy init)
RUNS = {"recipe": (None, 1, True), "reason_first": (REASON_FIRST, 1, True),
        "oversample_3": (None, 3, True), "random_init": (None, 1, False)}
ROWS = {"verdict_first": "recipe", "reason_first": "reason_first", "oversample_1": "recipe",
        "oversample_3": "oversample_3", "random_init": "random_init", "policy_init": "recipe"}


def main(argv):
    del argv
    from rm_jax.eval.metrics import METRIC_KEYS
    work = os.path.abspath(_WORKDIR.value)
    data = os.path.join(work, "data")
    cfg = f"--config={_CONFIG.value}"
    timings: dict[str, float] = {}
    provenance, base_hf = resolve_base(_BASE.value, _CONFIG.value)
    run_stage("synth", [f"--out={data}", f"--n={_N.value}", f"--seed={_SEED.value}", "--fail_rate=0.3",
                        *([f"--tokenizer={base_hf}"] if base_hf else [])], timings, "synth")
    run_stage("policy_sft", [f"--input={data}/samples.jsonl", f"--out={work}/policy", cfg,
                        f"--steps={_POLICY_STEPS.value}", f"--config.seed={_SEED.value}", f"--init_from={base_hf}"],
              timings, "policy_sft")
    sweeps = {}
    for name, (order, oversample, policy) in RUNS.items():
        shards, run = os.path.join(work, f"shards_{'reason' if order else 'verdict'}_first"), os.path.join(work, name)
        order_flag = [f"--config.data.field_order={order}"] if order else []
        if not os.path.isfile(os.path.join(shards, "manifest.json")):
            run_stage("build_data", [f"--input={data}/samples.jsonl", f"--out={shards}", cfg, *order_flag],
                 timings, f"build_{os.path.basename(shards)}")
        if not os.path.isfile(os.path.join(run, "sweep.json")):
            run_stage("train", [cfg, f"--workdir={run}", f"--config.data.dir={shards}", *order_flag,
                           f"--config.data.oversample_fail={oversample}", f"--config.train.steps={_STEPS.value}",
                           f"--config.seed={_SEED.value}",
                           f"--config.train.init_from={os.path.join(work, 'policy', 'hf') if policy else ''}"],
                 timings, f"train_{name}")
            run_stage("sweep", [f"--workdir={run}", f"--data={shards}", f"--max_samples={_SWEEP_MAX.value}"],
                 timings, f"sweep_{name}")
        with open(os.path.join(run, "sweep.json")) as f:
            sweeps[name] = json.load(f)
    rows = {row: {"run": run, **metrics_at(sweeps[run], sweeps[run]["chosen"]["step"])} for row, run in ROWS.items()}
    recipe = sweeps["recipe"]
    val_step = recipe.get("lowest_val_loss_step")
    rows["select_by_val_loss"] = {"run": "recipe", **(metrics_at(recipe, val_step) if val_step is not None
                                                      else {"step": None, **{k: None for k in METRIC_KEYS}})}
    rows["select_by_rule"] = {"run": "recipe", **metrics_at(recipe, recipe["chosen"]["step"])}
    out = {"workdir": work, "n": _N.value, "steps": _STEPS.value, "seed": _SEED.value, "base": _BASE.value,
           "base_steps": provenance.steps if provenance else None, "rows": rows,
           "wall_seconds": timings}
    with open(os.path.join(work, "ablation.json"), "w") as f:
        json.dump(out, f, indent=2)
    start = f"policy from the base {_BASE.value}" if base_hf else "policy from random init"
    lines = ["# Ablations", "", f"{_N.value} samples, {_STEPS.value} judge steps per run, seed {_SEED.value}, {start}.",
             "",
             "| row | run | step | accuracy | fail P | fail R | fail F1 | AUC | middle zone | img corr |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    pct = lambda x: "n/a" if x is None else f"{x:.1%}"  # noqa: E731
    num = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    for name, r in rows.items():
        lines.append(f"| {name} | {r['run']} | {r['step']} | {pct(r['accuracy'])} | {pct(r['fail_precision'])} | "
                     f"{pct(r['fail_recall'])} | {pct(r['fail_f1'])} | {num(r['auc'])} | {pct(r['middle_zone'])} | "
                     f"{num(r['img_corr'])} |")
    with open(os.path.join(work, "ablation.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    app.run(main)
