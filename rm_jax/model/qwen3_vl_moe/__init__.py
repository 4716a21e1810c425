"""Qwen3-VL-MoE (model_type ``qwen3_vl_moe``): ``config`` (its config.json), ``model`` (the NNX
judge), ``params`` (its HF key table)."""
