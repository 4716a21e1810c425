"""Train the judge: verdict-first SFT on built shards.

  python -m launch.train --config=configs/tiny.py --workdir=W \\
      [--config.data.dir=DIR --config.train.steps=N --config.train.checkpoint_every=K]

Writes W/checkpoints/, W/metrics.jsonl, W/tensorboard/, W/manifest.json. Starting again in the
same workdir resumes from the newest intact checkpoint. Multi-host runs need all three cluster
flags; nothing is inferred from the environment.
"""

from __future__ import annotations

import json

from absl import app, flags

from launch.common import define_cluster_flags, define_config_flag, parse_config, quiet_library_info

_WORKDIR = flags.DEFINE_string("workdir", None, "run directory", required=True)
_CLUSTER = define_cluster_flags()
_CONFIG = define_config_flag()


def main(argv):
    del argv
    # Background failures (async checkpoint writer, data workers) must surface with their real
    # traceback: our handler stays at INFO whatever a library set; only Orbax's INFO chatter goes.
    quiet_library_info()
    from rm_jax.train import distributed, loop

    cfg = parse_config(_CONFIG.value)
    line = distributed.initialize(_CLUSTER())
    result = loop.run(cfg, _WORKDIR.value, cluster_line=line)
    print(json.dumps({k: v for k, v in result.items() if k != "last_metrics"} | {"last": result["last_metrics"]},
                     default=str))


if __name__ == "__main__":
    app.run(main)
