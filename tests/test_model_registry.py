"""The architecture registry (by config.json's model_type) and the layer-spec records.

* An unknown model_type and a missing one are refused by name with the known list; Qwen3.5's
  two model types (multimodal, text-only) are registered and parse to their own config, through
  the registry and a checkpoint dir's config.json, while Qwen3-VL's own parser still refuses
  them by name (it must not parse another architecture's config field by field).
* ``ModelConfig.layer_specs`` follows transformers' sparse-layer rule; ``group_layers`` cuts runs
  of equal specs, deepstack layers alone; ``kind_offsets`` indexes each group into its kind's
  decode-state stack.
"""

import json

import pytest

from rm_jax.model import JudgeModel, LayerSpec, ModelConfig, Qwen3VLMoeJudge, config_from_hf_dict, load_hf, registry
from rm_jax.model.config import ConfigError
from rm_jax.model.layer_stack import LayerGroup, group_layers, kind_offsets
from rm_jax.model.safetensors_io import CheckpointError


def _vl_dict(**text):
    from configs.tiny import hf_model_config
    d = hf_model_config().to_dict()
    d["text_config"].update(text)
    return d


def _qwen3_5_dict():
    from transformers import Qwen3_5MoeConfig
    return Qwen3_5MoeConfig().to_dict()


def test_known_model_types():
    assert "qwen3_vl_moe" in registry.known_model_types()
    cfg = config_from_hf_dict(_vl_dict())
    assert isinstance(cfg, ModelConfig) and cfg.model_type == "qwen3_vl_moe"
    assert registry.architecture_of(cfg).model_type == "qwen3_vl_moe"
    model = registry.abstract_model(cfg)            # shapes only
    assert isinstance(model, Qwen3VLMoeJudge) and isinstance(model, JudgeModel)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_unknown_model_type_is_refused_by_name(model_type, tmp_path):
    d = dict(_vl_dict(), model_type=model_type)
    with pytest.raises(registry.UnknownModelType, match=rf"model_type='{model_type}' is not supported.*"
                                                        r"known model types: \[.*'qwen3_vl_moe'"):
        config_from_hf_dict(d)
    # And so does loading a checkpoint dir (before any weight is read).
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=rf"config.json: config: model_type='{model_type}' is not supported"):
        load_hf(tmp_path)


def test_missing_model_type_is_refused():
    d = _vl_dict()
    del d["model_type"]
    with pytest.raises(registry.UnknownModelType, match="no 'model_type' key"):
        config_from_hf_dict(d)


def test_qwen3_5_configs_are_accepted(tmp_path):
    from transformers import Qwen3_5MoeTextConfig

    from rm_jax.model.convert import read_config
    from rm_jax.model.qwen3_5_moe.config import Qwen35MoeConfig
    from rm_jax.model.qwen3_5_moe.model import Qwen35MoeJudge
    assert {"qwen3_5_moe", "qwen3_5_moe_text"} <= set(registry.known_model_types())
    d = _qwen3_5_dict()
    cfg = config_from_hf_dict(d)
    assert isinstance(cfg, Qwen35MoeConfig) and not cfg.text_only
    assert cfg.text.layer_types == tuple(d["text_config"]["layer_types"])
    assert registry.architecture_of(cfg).model_class is Qwen35MoeJudge
    text_cfg = config_from_hf_dict(Qwen3_5MoeTextConfig().to_dict())
    assert isinstance(text_cfg, Qwen35MoeConfig) and text_cfg.text_only
    model = registry.abstract_model(text_cfg)       # shapes only
    assert isinstance(model, Qwen35MoeJudge) and isinstance(model, JudgeModel)
    # A checkpoint dir's config.json goes through the same dispatch.
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert read_config(tmp_path) == cfg
    # Qwen3-VL's parser still refuses it by name, even with the key whose absence once misled.
    d["text_config"]["intermediate_size"] = 64
    with pytest.raises(ConfigError, match="model_type='qwen3_5_moe' is not a Qwen3-VL-MoE config"):
        ModelConfig.from_hf_dict(d)


def test_layer_specs_follow_the_sparse_rule():
    cfg = config_from_hf_dict(_vl_dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]))
    moe, dense = LayerSpec("attention", "moe"), LayerSpec("attention", "dense")
    # transformers: sparse iff not in mlp_only_layers and (i + 1) % step == 0.
    assert cfg.layer_specs() == (dense, moe, dense, dense, dense, moe)
    assert cfg.layer_specs() == tuple(LayerSpec("attention", "moe" if cfg.text.is_sparse(i) else "dense")
                                      for i in range(6))


def test_group_layers_and_kind_offsets():
    gdn, attn = LayerSpec("gated_deltanet", "moe"), LayerSpec("attention", "moe")
    specs = (gdn, gdn, gdn, attn, gdn, gdn, attn, attn)
    groups = group_layers(specs)
    assert groups == (LayerGroup(0, 3, gdn), LayerGroup(3, 4, attn), LayerGroup(4, 6, gdn), LayerGroup(6, 8, attn))
    assert kind_offsets(groups) == (0, 0, 3, 1)
    # A layer in `alone` is a group by itself, and the run after it starts fresh.
    assert group_layers(specs, alone=[1]) == (LayerGroup(0, 1, gdn), LayerGroup(1, 2, gdn), LayerGroup(2, 3, gdn),
                                              LayerGroup(3, 4, attn), LayerGroup(4, 6, gdn), LayerGroup(6, 8, attn))
    with pytest.raises(ValueError, match="mixer='mamba'"):
        LayerSpec("mamba", "dense")
