"""Does the judge check each value? Held-out swapped-value detection AUC of an HF checkpoint.

    python -m benchmarks.value_check --hf=DIR --data=SHARDS [--batches=12] [--seed=123]

On the held-out split of built shards, every passing example gets one single-token value of its
response swapped for another of its class (rm_jax.data.value_swap, rate 1), and the checkpoint's
verdict tokens are read at each labelled value's own position: score = logit(fail) - logit(pass).
Prints the AUC of that score for swapped against kept values, beside a presence rule (a value is
kept iff its token occurs before the response), which needs no model. A judge trained with
``train.value_check_weight`` learns the score; one trained on verdicts alone sits near 0.5.
A measurement, not a test.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

flags.DEFINE_string("hf", None, "judge HF checkpoint (launch.convert --to_hf of a training step)", required=True)
flags.DEFINE_string("data", None, "built shards (launch.build_data --out), with value classes", required=True)
flags.DEFINE_integer("batches", 12, "held-out batches of 16")
flags.DEFINE_integer("seed", 123, "swap draws")


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from sklearn.metrics import roc_auc_score

    from configs import tiny
    from rm_jax.data import loader as loader_lib
    from rm_jax.model import load_hf
    from rm_jax.run_config import parse
    from rm_jax.train.data_plan import BatchStream, RunPlan, loader_config
    from rm_jax.train.host_batch import ValueCheck
    f = flags.FLAGS
    cfg = tiny.get_config()
    cfg.data.dir, cfg.train.value_check_weight, cfg.train.value_check_rate = f.data, 1.0, 1.0
    cfg.seed = f.seed
    run = parse(cfg)
    manifest = loader_lib.read_manifest(f.data)
    check = ValueCheck.from_config(run, manifest)
    plan = RunPlan(total_steps=1, micro_batch=16, accumulation=1, steps_per_epoch=1.0)
    stream = BatchStream(f.data, "heldout", loader_config(run, plan, split="heldout"), 1)
    model = load_hf(f.hf)[0]
    fail_id, pass_id = manifest["verdict_tokens"]["fail_id"], manifest["verdict_tokens"]["pass_id"]
    swapped, score, absent = [], [], []
    for k, micro in enumerate(stream.it):
        if k >= f.batches:
            break
        b, target = check.apply(micro, 0, k)
        if not (target >= 0).any():
            continue
        out = model.forward(b["input_ids"], pixel_values=b["pixel_values"], image_grid_thw=b["image_grid_thw"])
        logits = np.asarray(out.logits_btv)
        for i, p in zip(*np.nonzero(target >= 0)):
            swapped.append(int(target[i, p]))
            score.append(float(logits[i, p, fail_id] - logits[i, p, pass_id]))
            absent.append(int(b["input_ids"][i, p] not in b["input_ids"][i, :b["response_start"][i]]))
    auc, rule = roc_auc_score(swapped, score), roc_auc_score(swapped, absent)
    print(f"{f.hf}: {len(swapped)} labelled values ({sum(swapped)} swapped), detection AUC {auc:.3f}; "
          f"presence rule {rule:.3f}")
    print(json.dumps({"bench": "value_check", "values": len(swapped), "swapped": int(sum(swapped)),
                      "auc": round(auc, 4), "presence_rule_auc": round(rule, 4)}))


if __name__ == "__main__":
    app.run(main)
