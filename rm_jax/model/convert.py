"""transformers checkpoint <-> rm_jax model, for any registered architecture: ``load_hf`` and
``save_hf``.

Design choices:

* **Dispatch sits above the registry.** ``read_config`` parses config.json into the typed config
  its ``model_type`` names (``rm_jax.model.registry``); the architecture's ``CheckpointFormat``
  (its key table and hooks, ``rm_jax.model.<arch>.params``) then drives the one load/save loop
  (``rm_jax.model.hf_checkpoint``). Nothing below this module knows about the others, so the
  table vocabulary, the architectures and the registry import each other in one direction only.
* **Only safetensors are read** (``safetensors_io``); a dtype must be floating, and a checkpoint
  directory must exist, before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp

from rm_jax.model import registry
from rm_jax.model.config import ConfigError, RuntimeOptions
from rm_jax.model.hf_checkpoint import load_params, save_params
from rm_jax.model.interface import JudgeModel
from rm_jax.model.safetensors_io import CheckpointError


def read_config(hf_dir, runtime: RuntimeOptions | None = None):
    """config.json -> the typed config of the architecture its ``model_type`` names."""
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path}: missing (a transformers checkpoint dir needs its config.json)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    try:
        return registry.config_from_hf_dict(raw, runtime)
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None


def load_hf(hf_dir, dtype="float32", mesh=None, *, expert_layout: str | None = None,
            runtime: RuntimeOptions | None = None) -> tuple[JudgeModel, object]:
    """Load a transformers safetensors checkpoint into a (sharded) NNX model -> (model, config),
    the architecture picked by config.json's ``model_type``.

    ``expert_layout`` (e.g. "published" or "transformers"; the architecture's format lists the
    names it accepts) is needed only when the fused-expert shapes are ambiguous
    (hidden_size == 2 * moe_intermediate_size).
    """
    try:
        pdtype = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype={dtype!r}: not a dtype ({e})") from None
    if not jnp.issubdtype(pdtype, jnp.floating):
        raise ValueError(f"dtype={dtype!r}: parameters need a floating dtype (float32, bfloat16, ...)")
    runtime = dataclasses.replace(runtime or RuntimeOptions(), dtype=str(pdtype), param_dtype=str(pdtype))
    if not Path(hf_dir).is_dir():
        raise CheckpointError(f"{hf_dir}: not a directory")
    cfg = read_config(hf_dir, runtime)
    return load_params(hf_dir, cfg, registry.architecture_of(cfg).checkpoint, registry.abstract_model,
                       mesh=mesh, pdtype=pdtype, expert_layout=expert_layout)


def save_hf(model: JudgeModel, out_dir, *, dtype=None, expert_layout: str | None = None,
            max_shard_bytes: int = 4 << 30) -> Path:
    """Write safetensors + config.json that transformers' ``from_pretrained`` (of the class the
    config names) loads, streamed in shards of at most ``max_shard_bytes``. ``expert_layout``
    defaults to the layout the model was loaded from (else the architecture's default); each
    tensor keeps the dtype it was loaded in unless ``dtype`` forces one."""
    return save_params(model, out_dir, registry.architecture_of(model.cfg).checkpoint, dtype=dtype,
                       expert_layout=expert_layout, max_shard_bytes=max_shard_bytes)
