"""Judge models in Flax NNX: ``load_hf(hf_dir) -> (model, config)``; ``model(input_ids, ...)``.

The architecture is picked by config.json's ``model_type`` (``registry``); every model
implements ``interface.JudgeModel``. ``ModelConfig``/``TextConfig`` are Qwen3-VL-MoE's.
"""

from rm_jax.model.config import ConfigError, RuntimeOptions
from rm_jax.model.convert import load_hf, save_hf
from rm_jax.model.interface import JudgeModel
from rm_jax.model.layer_stack import LayerGroup, LayerSpec
from rm_jax.model.qwen3_vl_moe.config import ModelConfig, TextConfig
from rm_jax.model.qwen3_vl_moe.model import Qwen3VLMoeJudge
from rm_jax.model.records import JudgeInputs, JudgeOutput
from rm_jax.model.registry import abstract_model, config_from_hf_dict, init_model, prepare_inputs
from rm_jax.model.vision_config import VisionConfig


__all__ = ["ConfigError", "ModelConfig", "RuntimeOptions", "TextConfig", "VisionConfig", "JudgeInputs",
           "JudgeModel", "JudgeOutput", "LayerGroup", "LayerSpec", "Qwen3VLMoeJudge", "abstract_model",
           "config_from_hf_dict", "init_model", "prepare_inputs", "load_hf", "save_hf"]
