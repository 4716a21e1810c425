"""The embedded default: a tiny Qwen3-VL-MoE judge trained on the synthetic set on CPU.

Usage: --config=configs/tiny.py [--config.train.steps=N ...]

Every field, its default and its meaning: rm_jax/run_config.py (the defaults are this run's).
"""

import ml_collections

from configs import judge_contracts
from rm_jax import run_config

# Special tokens of the synthetic tokenizer, fixed ids 0.. in this order (launch.synth).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                  "</tool_call>", "<tool_response>", "</tool_response>")


def hf_model_config() -> ml_collections.ConfigDict:
    """HF-style Qwen3-VL-MoE config (keys as in transformers' Qwen3VLMoeConfig)."""
    return ml_collections.ConfigDict(dict(
        model_type="qwen3_vl_moe",
        image_token_id=SPECIAL_TOKENS.index("<|image_pad|>"),
        video_token_id=SPECIAL_TOKENS.index("<|video_pad|>"),
        vision_start_token_id=SPECIAL_TOKENS.index("<|vision_start|>"),
        vision_end_token_id=SPECIAL_TOKENS.index("<|vision_end|>"),
        tie_word_embeddings=False,
        text_config=dict(
            vocab_size=4096,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=(),
            rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=5_000_000.0,
                                 mrope_section=(4, 2, 2), mrope_interleaved=True),
            tie_word_embeddings=False,
            max_position_embeddings=8192,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            in_channels=3,
            patch_size=8,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=64,
            num_position_embeddings=64,
            deepstack_visual_indexes=(0, 1),
        ),
    ))


def get_config() -> ml_collections.ConfigDict:
    """The typed defaults (rm_jax.run_config) with this model and the route-only contracts."""
    cfg = ml_collections.ConfigDict(run_config.RunConfig(name="tiny").to_dict())
    cfg.model = hf_model_config()
    # data=-1: all devices not claimed by the other axes (1 CPU here, 8 emulated in tests).
    cfg.mesh.data = -1
    # The route-only contracts and no tool listing: a tiny judge cannot read instructions, and
    # every token between the request and the verdict slot slows what it must learn, the
    # comparison (judge_contracts; template = the policy's own format, the default).
    cfg.data.tool_contract = judge_contracts.TOOL_CALL_CONTRACT_ROUTE
    cfg.data.text_contract = judge_contracts.TEXT_ONLY_CONTRACT_ROUTE
    cfg.data.tools_listing = "none"
    return cfg
