"""Command-line overrides for the tiny training runs that tests start as `launch.train` subprocesses,
and the same run config in process."""

import ml_collections

from rm_jax.run_config import RunConfig, parse

# Wall-clock figures in metrics.jsonl: left out when two runs' rows are compared.
TIMING = {"tokens_per_s", "samples_per_s"}

# A short run: checkpoints, validation and logging all happen within it.
OVERRIDES = dict(global_batch=8, steps=6, checkpoint_every=2, eval_every=3, eval_batches=1, log_every=1,
                 max_patches=2048, max_images=16, tensorboard=False)

# A shallower judge keeps compile time (most of these tests' cost) down; depth is not what
# these tests are about (the scanned stacks are covered by the model tests).
SMALL_MODEL = {"model.text_config.num_hidden_layers": 2, "model.vision_config.depth": 1,
               "model.vision_config.deepstack_visual_indexes": "(0,)"}


def override_flags(train: dict) -> list[str]:
    """`--config.train.K=V` for each entry of ``train``, then the small-model overrides."""
    return [f"--config.train.{k}={v}" for k, v in train.items()] + [f"--config.{k}={v}" for k, v in SMALL_MODEL.items()]


def train_cfg(tiny_cfg, shards: str, *, data: dict | None = None, moe: dict | None = None,
              model: dict | None = None, **train) -> RunConfig:
    """The tiny config on ``shards`` with OVERRIDES, ``train`` overrides and the small model (or
    ``model``, a whole model section), plus ``data`` / ``moe`` overrides, parsed (in process)."""
    cfg = tiny_cfg.copy_and_resolve_references()
    cfg.data.dir = shards
    cfg.data.update(data or {})
    cfg.moe.update(moe or {})
    cfg.train.update({**OVERRIDES, **train})
    if model is not None:
        cfg.model = ml_collections.ConfigDict(model)
    else:
        cfg.model.text_config.num_hidden_layers = 2
        cfg.model.vision_config.depth = 1
        cfg.model.vision_config.deepstack_visual_indexes = (0,)
    return parse(cfg)
