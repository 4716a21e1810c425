"""Qwen3.5-35B-A3B: the field report's policy base (40 layers, every 4th gated full attention and
the rest Gated DeltaNet, 256 experts top-8 plus a shared expert, 27-block ViT without deepstack).

Sizes are those of the published ``config.json`` (transformers' Qwen3_5MoeConfig keys, whose
defaults are this model), so ``Qwen35MoeConfig.from_hf_dict(hf_model_config())`` builds the model
``rm_jax.model.load_hf`` reads from the checkpoint. Everything outside the model
section is the 30B config's: the report's recipe on one 8-GPU host.

Usage: --config=configs/qwen3_5_35b_a3b.py
"""

import ml_collections

from configs import qwen3_vl_30b_a3b

N_LAYERS = 40
FULL_ATTENTION_INTERVAL = 4


def hf_model_config() -> ml_collections.ConfigDict:
    """HF-style Qwen3.5-MoE config (keys as in transformers' Qwen3_5MoeConfig)."""
    return ml_collections.ConfigDict(dict(
        model_type="qwen3_5_moe",
        image_token_id=248056,
        video_token_id=248057,
        vision_start_token_id=248053,
        vision_end_token_id=248054,
        tie_word_embeddings=False,
        text_config=dict(
            model_type="qwen3_5_moe_text",
            vocab_size=248320,
            hidden_size=2048,
            num_hidden_layers=N_LAYERS,
            layer_types=tuple("full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
                              for i in range(N_LAYERS)),
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            rms_norm_eps=1e-6,
            hidden_act="silu",
            attention_bias=False,
            rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                 mrope_section=(11, 11, 10), mrope_interleaved=True),
            tie_word_embeddings=False,
            max_position_embeddings=262144,
        ),
        vision_config=dict(
            model_type="qwen3_5_moe_vision",
            depth=27,
            hidden_size=1152,
            intermediate_size=4304,
            num_heads=16,
            in_channels=3,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=2048,
            num_position_embeddings=2304,
        ),
    ))


def get_config() -> ml_collections.ConfigDict:
    cfg = qwen3_vl_30b_a3b.get_config()
    cfg.name = "qwen3_5_35b_a3b"
    cfg.model = hf_model_config()
    # Full-attention head_dim is 256: cuDNN flash has kernels for it on Hopper and later (sm90+),
    # not before. "auto" picks cuDNN there and XLA's attention elsewhere, naming it in the log
    # (layers.choose_attention), rather than failing on an A100.
    cfg.train.attention = "auto"
    # The 35B's bf16 expert stacks enter the layer scan as packed bits (bit-identical; what the
    # memory plan compiles: XLA:CPU would slice f32 copies of each whole stack).
    cfg.train.stack_codec = "bf16_bits"
    # Expert gradients summed into the bf16 accumulator inside the layer scan, from the fp32 master
    # cast one layer at a time (equal to the plain path): no bf16 copy of the expert stacks and no
    # per-microbatch expert gradient beside the accumulator (docs/operations.md's 35B table).
    cfg.train.expert_grad_in_scan = True
    # Memory: the 30B recipe's grad_accum=4 and bf16 expert grads/accumulator, unchanged
    # (benchmarks/memory_plan.py --model=qwen3_5_35b_a3b; docs/operations.md's 35B table).
    return cfg
