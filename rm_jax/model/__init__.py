"""Qwen3-VL-MoE judge in Flax NNX: ``load_hf(hf_dir) -> (model, config)``; ``model(input_ids, ...)``."""

from rm_jax.model.config import ModelConfig, RuntimeOptions, TextConfig, VisionConfig
from rm_jax.model.judge import (JudgeInputs, JudgeOutput, Qwen3VLMoeJudge, abstract_model, init_model,
                                prepare_inputs)


def load_hf(hf_dir, dtype="float32", mesh=None, **kwargs):
    """Load a transformers Qwen3-VL-MoE checkpoint (safetensors) -> (model, ModelConfig)."""
    from rm_jax.model.hf import load_hf as _load_hf
    return _load_hf(hf_dir, dtype=dtype, mesh=mesh, **kwargs)


def save_hf(model, out_dir, **kwargs):
    """Write ``model`` as a transformers checkpoint (safetensors + config.json)."""
    from rm_jax.model.hf import save_hf as _save_hf
    return _save_hf(model, out_dir, **kwargs)


__all__ = ["ModelConfig", "RuntimeOptions", "TextConfig", "VisionConfig", "JudgeInputs", "JudgeOutput",
           "Qwen3VLMoeJudge", "abstract_model", "init_model", "prepare_inputs", "load_hf", "save_hf"]
