"""Architectures by config.json's ``model_type``: its config parser, model class and HF key table.

Design choices:

* **Keyed by ``model_type``**, the field transformers itself dispatches on. Every path that turns
  a config.json (or a run config's ``model`` section) into a model goes through
  ``config_from_hf_dict``, so a checkpoint of an architecture rm_jax does not implement is refused
  by name, with the known list, instead of being parsed as the wrong one field by field.
* **An architecture is a record** (``Architecture``): adding one is a package
  (``rm_jax/model/<arch>/``: config, model, params with its ``CheckpointFormat``) plus one
  ``register`` call here. Loading and saving checkpoints sits one floor up
  (``rm_jax.model.convert``), so nothing an architecture imports reaches back here.
* ``init_model`` / ``abstract_model`` / ``prepare_inputs`` dispatch on the typed config's
  ``model_type``, so callers never name a model class.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from flax import nnx

from rm_jax.model import inputs as inputs_lib
from rm_jax.model.config import ConfigError, RuntimeOptions, plain_dict
from rm_jax.model.hf_checkpoint import CheckpointFormat
from rm_jax.model.interface import JudgeModel
from rm_jax.model.qwen3_5_moe import config as q35_config
from rm_jax.model.qwen3_5_moe import model as q35_model
from rm_jax.model.qwen3_5_moe import params as q35_params
from rm_jax.model.qwen3_vl_moe import config as vl_config
from rm_jax.model.qwen3_vl_moe import model as vl_model
from rm_jax.model.qwen3_vl_moe import params as vl_params


class UnknownModelType(ConfigError):
    """config.json names an architecture that is not registered."""


@dataclasses.dataclass(frozen=True)
class Architecture:
    model_type: str                                         # config.json's top-level model_type
    config_from_hf: Callable[[Mapping, RuntimeOptions | None], Any]
    model_class: type                                       # implements interface.JudgeModel
    checkpoint: CheckpointFormat                            # its HF key table and checkpoint hooks
    prepare_inputs: Callable = inputs_lib.prepare_inputs    # (cfg, input_ids, mask, pixels, grid, **kw)


ARCHITECTURES: dict[str, Architecture] = {}


def register(arch: Architecture) -> None:
    if arch.model_type in ARCHITECTURES:
        raise ValueError(f"model_type {arch.model_type!r} is already registered")
    ARCHITECTURES[arch.model_type] = arch


def known_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def architecture(model_type: str | None) -> Architecture:
    if model_type is None:
        raise UnknownModelType("config: no 'model_type' key (transformers' config.json names its architecture "
                               f"there); known model types: {known_model_types()}")
    if model_type not in ARCHITECTURES:
        raise UnknownModelType(f"config: model_type={model_type!r} is not supported by rm_jax; known model "
                               f"types: {known_model_types()}")
    return ARCHITECTURES[model_type]


def architecture_of(cfg) -> Architecture:
    """The architecture of a typed config (its class names its ``model_type``)."""
    return architecture(getattr(cfg, "model_type", None))


def config_from_hf_dict(d: Mapping, runtime: RuntimeOptions | None = None):
    """A transformers config dict (config.json, or a run config's ``model`` section) -> the typed
    config of its architecture."""
    d = plain_dict(d)
    return architecture(d.get("model_type")).config_from_hf(d, runtime)


def init_model(cfg, seed: int = 0) -> JudgeModel:
    """A randomly initialized model (tests, benchmarks); real runs use ``load_hf``."""
    return architecture_of(cfg).model_class(cfg, rngs=nnx.Rngs(seed))


def abstract_model(cfg) -> JudgeModel:
    """Shapes and metadata only: no memory is allocated (the loader fills it)."""
    cls = architecture_of(cfg).model_class
    return nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))


def prepare_inputs(cfg, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None, **kw):
    """Processor tensors -> ``JudgeInputs`` for this config's architecture (``inputs.prepare_inputs``)."""
    return architecture_of(cfg).prepare_inputs(cfg, input_ids, attention_mask, pixel_values, image_grid_thw, **kw)


def _register_builtin() -> None:
    register(Architecture(model_type=vl_config.MODEL_TYPE, config_from_hf=vl_config.ModelConfig.from_hf_dict,
                          model_class=vl_model.Qwen3VLMoeJudge, checkpoint=vl_params.CHECKPOINT))
    # Multimodal and text-only (ForCausalLM) checkpoints: one config record, one model class, one
    # checkpoint format (the text-only key prefix comes from the config).
    for model_type in q35_config.MODEL_TYPES:
        register(Architecture(model_type=model_type, config_from_hf=q35_config.Qwen35MoeConfig.from_hf_dict,
                              model_class=q35_model.Qwen35MoeJudge, checkpoint=q35_params.CHECKPOINT))


_register_builtin()
