"""Train a scalar Bradley–Terry RM on built pair data (launch.rm_build).

  python -m launch.rm_train --config=configs/rm_tiny.py --workdir=W --data=DIR [--config.rm.steps=N]

Writes W/checkpoints/, W/metrics.jsonl (pair_loss, pair_accuracy, margin, chosen_reward,
rejected_reward, overlength_filter_rate, pairs_per_s, non_pad_tokens_per_s, ...), W/manifest.json.
Starting again in the same workdir resumes from the newest intact checkpoint (model and data
position). Several processes: pass all three of --coordinator_address=HOST:PORT --num_processes=N
--process_id=i on every process (nothing is guessed from the environment).
"""

from __future__ import annotations

import json

from absl import app, flags

from launch.common import define_cluster_flags, define_config_flag, parse_config, quiet_library_info

_WORKDIR = flags.DEFINE_string("workdir", None, "run directory", required=True)
_DATA = flags.DEFINE_string("data", None, "built pair data (launch.rm_build --out)", required=True)
_CLUSTER = define_cluster_flags()
_CONFIG = define_config_flag("configs/rm_tiny.py")


def main(argv):
    del argv
    quiet_library_info()
    from rm_jax.rm import train
    from rm_jax.train import distributed

    line = distributed.initialize(_CLUSTER())
    print(json.dumps(train.run(parse_config(_CONFIG.value), _WORKDIR.value, _DATA.value, cluster_line=line), default=str))


if __name__ == "__main__":
    app.run(main)
