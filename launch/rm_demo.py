"""The scalar-RM demo on the embedded default: synthetic preference groups -> build -> train -> eval.

  python -m launch.rm_demo [--workdir=runs/rm_demo --prompts=400 --k=4 --steps=240]

Writes WORKDIR/data/ (preferences.jsonl, images, tokenizer), WORKDIR/pairs/ (built), WORKDIR/run/
(checkpoints, metrics), WORKDIR/report.md + report.json (pairwise accuracy, Kendall tau-b,
calibration before/after, Best-of-N, length bias) and WORKDIR/reliability.png.
"""

from __future__ import annotations

import json
import os
import shutil
import time

from absl import app, flags

from launch.common import load_config, parse_config, quiet_library_info

_WORKDIR = flags.DEFINE_string("workdir", "runs/rm_demo", "demo directory (recreated)")
_PROMPTS = flags.DEFINE_integer("prompts", 400, "synthetic prompts (groups)")
_K = flags.DEFINE_integer("k", 4, "responses per prompt")
_STEPS = flags.DEFINE_integer("steps", 240, "training steps")


def main(argv):
    del argv
    quiet_library_info()
    from rm_jax.data.render import Renderer
    from rm_jax.rm import build, scoring, synth_prefs, train
    from rm_jax.rm.render import RMRenderer

    t0 = time.time()
    wd = _WORKDIR.value
    if os.path.isdir(wd):
        shutil.rmtree(wd)
    cfg = load_config(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "rm_tiny.py"))
    cfg.rm.steps = _STEPS.value
    cfg.rm.checkpoint_every = _STEPS.value
    cfg.train.tensorboard = False
    cfg = parse_config(cfg)
    data, pairs, run = (os.path.join(wd, d) for d in ("data", "pairs", "run"))
    summary = synth_prefs.write_preferences(data, _PROMPTS.value, k=_K.value, seed=int(cfg.seed))
    print("synthetic preferences:", json.dumps(summary))
    tok = os.path.join(data, "tokenizer")
    stats = build.build(os.path.join(data, "preferences.jsonl"), pairs,
                        RMRenderer(Renderer.from_config(cfg.data, tok, storage_dtype="float16")),
                        build.PairBuildOptions.from_config(cfg.data), tokenizer_dir=tok)
    print("build:", json.dumps({k: v for k, v in stats.items() if k != "rejected_by_reason"}))
    t_train = time.time()
    result = train.run(cfg, run, pairs)
    t_eval = time.time()
    report = scoring.eval_workdirs([run], pairs, wd)
    report["timing_s"] = {"data": t_train - t0, "train": t_eval - t_train, "eval": time.time() - t_eval,
                          "total": time.time() - t0}
    report["build_stats"] = stats
    report["train_last"] = result["last"]
    os.replace(os.path.join(wd, "rm_eval.json"), os.path.join(wd, "report.json"))
    with open(os.path.join(wd, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=float)
    md = open(os.path.join(wd, "rm_eval.md")).read()
    os.remove(os.path.join(wd, "rm_eval.md"))
    md += (f"\nData: {summary['prompts']} prompts x {_K.value} responses; pairs kept {stats['pairs_kept']} of "
           f"{stats['pairs_read']} (overlength filter rate {stats['overlength_filter_rate']:.3f}, missing EOS "
           f"{stats['missing_eos_rate']:.3f}); splits {json.dumps(stats['splits'])}.\n"
           f"Training: {_STEPS.value} steps, last logged {json.dumps({k: round(v, 4) for k, v in result['last'].items()})}.\n"
           f"Time: {report['timing_s']['total']:.0f} s (train {report['timing_s']['train']:.0f} s).\n")
    with open(os.path.join(wd, "report.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    app.run(main)
