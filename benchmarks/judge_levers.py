"""The embedded judge's levers, each measured once at the demo's budget, in one table (issue 38).

  python -m benchmarks.judge_levers --base=runs/demo --workdir=runs/levers --levers=theta_1e4[,...]
      [--steps=1000] [--policy_steps=300]
  python -m benchmarks.judge_levers --base=runs/demo --workdir=runs/levers --levers=   # the table only

``--base`` is a finished ``make demo`` workdir: its data, shards and policy are reused and its sweep
is the table's ``default`` row. Each lever changes one thing of the demo's recipe (LEVERS). A lever
that changes the architecture trains its own policy first (``policy_steps``, the same architecture),
since the judge starts from the policy; the others start from the demo's policy. Each lever's judge
trains on the demo's shards for ``--steps`` and is swept as the demo sweeps it (700 held-out
samples, the declared selection rule). A lever already done (W/<lever>/lever.json) is not rerun.
Writes W/levers.json and W/levers.md: held-out AUC, middle zone, img correlation, the per-kind AUCs
of the chosen checkpoint, and the presence rule (rm_jax.eval.presence) on the same data set; the last
line printed is the table as one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
from absl import app, flags

from launch.common import DEFAULT_CONFIG, metrics_at, run_stage
from rm_jax.eval.presence import read_presence_aucs
from rm_jax.train.metrics_log import read_metrics

QWEN35_CONFIG = "configs/tiny_qwen3_5.py"
TEXT = "--config.model.text_config."
CHECKPOINTS = 5


@dataclasses.dataclass(frozen=True)
class Lever:
    what: str
    config: str = DEFAULT_CONFIG
    model_flags: tuple[str, ...] = ()      # the architecture: the policy and the judge both take them
    judge_flags: tuple[str, ...] = ()      # the judge's training only
    own_policy: bool = False               # the architecture differs from the demo's: SFT its own policy
    # The judge's steps scaled by its policy's training speed against the demo's policy (same data,
    # same batch): the demo's judge wall time rather than its step count, for a slower architecture.
    equal_wall: bool = False


LEVERS = {
    "qwen3_5": Lever("tiny Qwen3.5-MoE (3 GDN + 1 gated attention, shared expert, partial rotary 0.25, "
                     "theta 1e7)", config=QWEN35_CONFIG, own_policy=True, equal_wall=True),
    "theta_1e4": Lever("Qwen3-VL rope_theta 1e4 instead of the real model's 5e6",
                       model_flags=(f"{TEXT}rope_parameters.rope_theta=10000.0",), own_policy=True),
    "head_dim_32": Lever("head_dim 32 (4 heads, hidden 64 kept; MRoPE sections 8/4/4)",
                         model_flags=(f"{TEXT}head_dim=32", f"{TEXT}rope_parameters.mrope_section=(8,4,4)"),
                         own_policy=True),
}

_BASE = flags.DEFINE_string("base", None, "a finished launch.demo workdir (data, shards, policy, train/sweep.json)",
                            required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "where the levers' runs and the table go", required=True)
_LEVERS = flags.DEFINE_list("levers", [], f"levers to run now, of {sorted(LEVERS)} (done ones are kept)")
_EXTRA = flags.DEFINE_multi_string("extra", [], "NAME=LEVER+LEVER: a combination of levers' flags")
_STEPS = flags.DEFINE_integer("steps", 1000, "judge steps of the levers run now")
_POLICY_STEPS = flags.DEFINE_integer("policy_steps", 300, "policy SFT steps of an architecture lever")
_SPEED_REF = flags.DEFINE_string("speed_reference", "", "a policy stage dir whose training speed stands for the "
                                  "demo's (an equal_wall lever's steps); '' = the base's policy")
_SWEEP_MAX = flags.DEFINE_integer("sweep_max_samples", 700, "held-out samples the sweep scores per checkpoint")


def combine(names: list[str]) -> Lever:
    """One lever with the flags of several (at most one may change the config file)."""
    levers = [LEVERS[n] for n in names]
    configs = {lv.config for lv in levers} - {DEFAULT_CONFIG}
    if len(configs) > 1:
        raise app.UsageError(f"levers {names} use different config files {sorted(configs)}")
    return Lever(" + ".join(names), config=configs.pop() if configs else DEFAULT_CONFIG,
                 model_flags=tuple(f for lv in levers for f in lv.model_flags),
                 judge_flags=tuple(f for lv in levers for f in lv.judge_flags),
                 own_policy=any(lv.own_policy for lv in levers))


def run_lever(name: str, lever: Lever, base: str, work: str) -> None:
    out = os.path.join(work, name)
    if os.path.isfile(os.path.join(out, "lever.json")):
        print(f"=== {name}: done already ({out}/lever.json)")
        return
    timings: dict[str, float] = {}
    cfg = f"--config={lever.config}"
    policy = os.path.join(base, "policy", "hf")
    if lever.own_policy:
        run_stage("policy_sft", [f"--input={base}/data/samples.jsonl", f"--out={out}/policy", cfg,
                                 f"--steps={_POLICY_STEPS.value}", *lever.model_flags], timings, "policy_sft")
        policy = os.path.join(out, "policy", "hf")
    steps = _STEPS.value
    if lever.equal_wall:
        reference = _SPEED_REF.value or os.path.join(base, "policy")
        speed = policy_speed(os.path.join(out, "policy")) / policy_speed(reference)
        steps = max(CHECKPOINTS, int(round(steps * speed / CHECKPOINTS)) * CHECKPOINTS)
        print(f"=== {name}: policy speed {speed:.2f}x the demo's: {steps} judge steps for the demo's wall time")
    shards, run = os.path.join(base, "shards"), os.path.join(out, "train")
    every = steps // CHECKPOINTS    # the demo's five checkpoints (200 of 1000), swept the same way
    run_stage("train", [cfg, f"--workdir={run}", f"--config.data.dir={shards}", f"--config.train.init_from={policy}",
                        f"--config.train.steps={steps}", f"--config.train.checkpoint_every={every}",
                        f"--config.train.eval_every={every}", *lever.model_flags, *lever.judge_flags],
              timings, "train")
    run_stage("sweep", [f"--workdir={run}", f"--data={shards}", f"--max_samples={_SWEEP_MAX.value}"],
              timings, "sweep")
    with open(os.path.join(out, "lever.json"), "w") as f:
        json.dump({"lever": dataclasses.asdict(lever), "steps": steps, "policy": policy,
                   "speed_reference": _SPEED_REF.value or None,
                   "wall_seconds": timings, "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())},
                  f, indent=2)


def policy_speed(policy_dir: str) -> float:
    """Median training samples/s of a policy SFT run (its metrics rows after the first, which
    holds the compile)."""
    rates = [r["samples_per_s"] for r in read_metrics(os.path.join(policy_dir, "train"))[1:] if "samples_per_s" in r]
    if not rates:
        raise ValueError(f"{policy_dir}/train: no throughput rows to time the policy by")
    return float(np.median(rates))


def row_of(sweep: dict, steps: int, train_s: float | None, what: str) -> dict:
    chosen = metrics_at(sweep, sweep["chosen"]["step"])
    return {"what": what, "steps": steps, "train_s": train_s, "step": chosen["step"], "auc": chosen["auc"],
            "middle_zone": chosen["middle_zone"], "img_corr": chosen["img_corr"], "accuracy": chosen["accuracy"],
            "by_issue": {k: v["auc_vs_pass"] for k, v in sweep["chosen"]["by_issue"].items()}}


def table(base: str, work: str, names: list[str]) -> dict:
    with open(os.path.join(base, "train", "sweep.json")) as f:
        base_sweep = json.load(f)
    with open(os.path.join(base, "report.json")) as f:
        base_report = json.load(f)
    rows = {"default": row_of(base_sweep, base_sweep["rows"][-1]["step"], base_report["wall_seconds"]["train"],
                              "today's demo (configs/tiny.py)")}
    for name in names:
        path = os.path.join(work, name, "lever.json")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            done = json.load(f)
        with open(os.path.join(work, name, "train", "sweep.json")) as f:
            rows[name] = row_of(json.load(f), done["steps"], done["wall_seconds"]["train"], done["lever"]["what"])
    # Against the conversation alone: the demo's judge reads no tool listing (data.tools_listing=none).
    presence = read_presence_aucs(os.path.join(base, "data", "samples.jsonl"))
    return {"rows": rows, "presence_rule": presence, "kinds": list(rows["default"]["by_issue"])}


def markdown(t: dict) -> str:
    num = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    kinds = t["kinds"]
    head = ["lever", "steps", "train s", "step", "AUC", "middle zone", "img corr", "accuracy", *kinds]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in t["rows"].items():
        lines.append("| " + " | ".join([name, str(r["steps"]), f"{r['train_s']:.0f}", str(r["step"]), num(r["auc"]),
                                        f"{r['middle_zone']:.1%}", num(r["img_corr"]), f"{r['accuracy']:.1%}",
                                        *[num(r["by_issue"].get(k)) for k in kinds]]) + " |")
    p = t["presence_rule"]
    lines.append(f"| presence rule ({p['n']} samples) | | | | " + num(p["conversation"]) + " | | | | "
                 + " | ".join(num(p["by_issue"][k]["conversation"]) if k in p["by_issue"] else "n/a"
                              for k in kinds) + " |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    base, work = os.path.abspath(_BASE.value), os.path.abspath(_WORKDIR.value)
    os.makedirs(work, exist_ok=True)
    levers = dict(LEVERS)
    for spec in _EXTRA.value:
        name, _, parts = spec.partition("=")
        levers[name] = combine(parts.split("+"))
    unknown = sorted(set(_LEVERS.value) - set(levers))
    if unknown:
        raise app.UsageError(f"--levers: unknown {unknown}; known {sorted(levers)}")
    for name in _LEVERS.value:
        run_lever(name, levers[name], base, work)
    names = list(levers) + sorted(n for n in os.listdir(work) if n not in levers
                                  and os.path.isfile(os.path.join(work, n, "lever.json")))
    t = table(base, work, names)
    md = markdown(t)
    with open(os.path.join(work, "levers.json"), "w") as f:
        json.dump(t, f, indent=2)
    with open(os.path.join(work, "levers.md"), "w") as f:
        f.write(md)
    print(md)
    print(json.dumps({"bench": "judge_levers", **{n: {k: r[k] for k in ("auc", "middle_zone", "img_corr", "train_s")}
                                                  for n, r in t["rows"].items()}}))


if __name__ == "__main__":
    app.run(main)
