"""A tiny Qwen3.5-MoE judge (and policy) at the embedded default's width and depth.

Usage: --config=configs/tiny_qwen3_5.py [--config.train.steps=N ...]

The field report's base layout (configs/qwen3_5_35b_a3b.py) scaled to configs/tiny.py's budget:
hidden 64, 4 layers (three Gated DeltaNet layers, then one gated full-attention layer), 4 query /
2 kv heads of 16, 8 routed experts top-2 plus a shared expert, partial rotary 0.25 with theta 1e7
(the real model's), a 2-block vision tower without deepstack. Same tokenizer and special tokens
as configs/tiny.py, so both read the same synthetic data and shards; every other section is tiny's.
"""

import ml_collections

from configs import tiny

N_LAYERS = 4
FULL_ATTENTION_INTERVAL = 4


def hf_model_config() -> ml_collections.ConfigDict:
    """HF-style Qwen3.5-MoE config (keys as in transformers' Qwen3_5MoeConfig): tiny's token ids and
    vision tower (without deepstack, which Qwen3.5 does not have), a Qwen3.5 text stack."""
    cfg = tiny.hf_model_config()
    vision = cfg.vision_config.to_dict()
    del vision["deepstack_visual_indexes"]
    cfg.model_type = "qwen3_5_moe"
    cfg.vision_config = ml_collections.ConfigDict(dict(model_type="qwen3_5_moe_vision", **vision))
    cfg.text_config = ml_collections.ConfigDict(dict(
        model_type="qwen3_5_moe_text",
        vocab_size=4096,
        hidden_size=64,
        num_hidden_layers=N_LAYERS,
        layer_types=tuple("full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
                          for i in range(N_LAYERS)),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=48,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        # rotary dim 16 * 0.25 = 4: two frequency slots, split over the MRoPE axes as (1, 1, 0).
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                             mrope_section=(1, 1, 0), mrope_interleaved=True),
        tie_word_embeddings=False,
        max_position_embeddings=8192,
    ))
    return cfg


def get_config() -> ml_collections.ConfigDict:
    cfg = tiny.get_config()
    cfg.name = "tiny_qwen3_5"
    cfg.model = hf_model_config()
    return cfg
