"""Evaluate one scalar RM, or an ensemble of several, on the calibration + held-out splits.

  python -m launch.rm_eval --workdir=W[,W2,...] [--data=DIR --out=DIR --step=N]
      [--benchmark=FORMAT:PATH ...]     # FORMAT: rewardbench | rewardbench2 | vl_rewardbench | mm_rewardbench

Writes OUT/rm_eval.json, OUT/rm_eval.md, OUT/reliability.png (OUT defaults to W/rm_eval) and, per
benchmark, OUT/benchmark_FORMAT.json. --data defaults to the data the (first) run trained on.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from launch.common import quiet_library_info

_WORKDIR = flags.DEFINE_list("workdir", None, "run directory (several, comma-separated: an ensemble)", required=True)
_DATA = flags.DEFINE_string("data", "", "built pair data (default: the run's)")
_OUT = flags.DEFINE_string("out", "", "output directory (default: <first workdir>/rm_eval)")
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default: the newest)")
_BENCH = flags.DEFINE_multi_string("benchmark", [], "FORMAT:PATH of a benchmark file to score")


def main(argv):
    del argv
    quiet_library_info()
    from rm_jax.rm import scoring

    out = _OUT.value or os.path.join(_WORKDIR.value[0], "rm_eval")
    report = scoring.eval_workdirs(_WORKDIR.value, _DATA.value, out, step=_STEP.value, benchmarks=_BENCH.value)
    print(open(os.path.join(out, "rm_eval.md")).read())
    print(json.dumps(report["manifest"]))


if __name__ == "__main__":
    app.run(main)
