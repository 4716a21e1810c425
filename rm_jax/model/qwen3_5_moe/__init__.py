"""Qwen3.5-MoE (transformers' ``qwen3_5_moe`` / ``qwen3_5_moe_text``): Gated DeltaNet + gated
full-attention hybrid decoder, routed experts plus a shared expert, Qwen3-VL ViT without deepstack.

``config`` parses config.json, ``model`` is the NNX model, ``params`` the HF key table and checkpoint
format."""
