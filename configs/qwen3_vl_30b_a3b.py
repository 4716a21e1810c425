"""Qwen3-VL-30B-A3B-Instruct: the real judge base (48 layers, 128 experts top-8, 27-block ViT).

Sizes are those of the published ``config.json`` (transformers' Qwen3VLMoeConfig keys), so
``ModelConfig.from_hf_dict(hf_model_config())`` builds the same model ``load_hf`` reads from the
checkpoint. Only the model section differs from configs/tiny.py; data, mesh and MoE settings are
the tiny ones with an 8-GPU single-host mesh (FSDP-only experts, docs/operations.md "Meshes").

Usage: --config=configs/qwen3_vl_30b_a3b.py
"""

import ml_collections

from configs import judge_contracts, tiny


def hf_model_config() -> ml_collections.ConfigDict:
    """HF-style Qwen3-VL-MoE config (keys as in transformers' Qwen3VLMoeConfig)."""
    return ml_collections.ConfigDict(dict(
        model_type="qwen3_vl_moe",
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=False,
        text_config=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            decoder_sparse_step=1,
            mlp_only_layers=(),
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=5000000.0,
                                 mrope_section=(24, 20, 20), mrope_interleaved=True),
            tie_word_embeddings=False,
            max_position_embeddings=262144,
        ),
        vision_config=dict(
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
            deepstack_visual_indexes=(8, 16, 24),
        ),
    ))


def get_config() -> ml_collections.ConfigDict:
    cfg = tiny.get_config()
    cfg.name = "qwen3_vl_30b_a3b"
    cfg.model = hf_model_config()
    cfg.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=8, expert=1, tensor=1))
    # The field report's v3 recipe: lr 5e-6, global batch 32, max length 8192, 2 epochs,
    # failures x3 in train only; bf16 compute over fp32 master weights, full remat.
    cfg.data.max_len = 8192
    cfg.data.buckets = (2048, 4096, 6144, 8192)
    cfg.data.image.max_pixels = 1024 * 32 * 32      # 1024 merged tokens per image (policy budget)
    cfg.data.image.min_pixels = 256 * 32 * 32
    cfg.data.tool_contract = judge_contracts.TOOL_CALL_CONTRACT      # the report's full judge contracts
    cfg.data.text_contract = judge_contracts.TEXT_ONLY_CONTRACT
    cfg.data.tools_listing = "template"     # the tool schemas as the policy's chat template lists them
    cfg.train.update(dict(lr=5e-6, global_batch=32, grad_accum=4, epochs=2.0, warmup_steps=50,
                          dtype="bfloat16", param_dtype="float32", mu_dtype="bfloat16", remat="full",
                          nu_dtype="bfloat16", expert_grad_dtype="bfloat16", expert_accum_dtype="bfloat16",
                          max_target_tokens=192,
                          vocab_chunk=16384, max_patches=32 * 4096, max_images=64,
                          checkpoint_every=100, eval_every=100, eval_batches=0,
                          verdict_weight=1.0,        # the report trained plain token-mean SFT
                          # What benchmarks/memory_plan.py measured (73.8 GiB per GPU at A=4):
                          # flash attention and a grouped-matmul kernel. Explicit, so an
                          # ineligible input fails instead of running XLA's [B, N, T, S] attention.
                          attention="cudnn"))
    cfg.moe.ragged_dot = "tokamax"
    return cfg
