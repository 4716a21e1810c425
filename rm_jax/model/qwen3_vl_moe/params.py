"""Qwen3-VL-MoE's HF key table: every transformers key of ``Qwen3VLMoeForConditionalGeneration``
with the rm_jax param path(s) it fills and the transform between them, and its checkpoint format.

``rm_jax.model.hf_checkpoint`` applies the table (load forwards, export backwards); ``{i}`` is a
decoder layer, placed into its scanned stack by ``model.layer_groups``. The ViT's keys are the
shared tower's (``rm_jax.model.vision_params``), deepstack mergers included.
"""

from __future__ import annotations

from rm_jax.model.hf_checkpoint import CheckpointFormat
from rm_jax.model.hf_table import (EXPERTS_DOWN, EXPERTS_GATE_UP, IDENT, KV_HEADS, O_HEADS, Q_HEADS, TRANSPOSE, Rule,
                                   Target, expand_rules, has_dense_mlp, has_moe, slots_of_groups)
from rm_jax.model.qwen3_vl_moe.config import ModelConfig
from rm_jax.model.qwen3_vl_moe.model import layer_groups
from rm_jax.model.vision import vision_segments
from rm_jax.model.vision_params import vision_rules

_T = "model.language_model."

RULES: tuple[Rule, ...] = (
    Rule(_T + "embed_tokens.weight", ("embed_vd",), IDENT, "global"),
    Rule(_T + "norm.weight", ("final_norm.weight",), IDENT, "global"),
    Rule("lm_head.weight", ("lm_head_dv",), TRANSPOSE, "global"),
    Rule(_T + "layers.{i}.input_layernorm.weight", ("input_norm.weight",), IDENT, "text_layer"),
    Rule(_T + "layers.{i}.post_attention_layernorm.weight", ("post_norm.weight",), IDENT, "text_layer"),
    Rule(_T + "layers.{i}.self_attn.q_proj.weight", ("attn.wq_dnh",), Q_HEADS, "text_layer"),
    Rule(_T + "layers.{i}.self_attn.k_proj.weight", ("attn.wk_dkh",), KV_HEADS, "text_layer"),
    Rule(_T + "layers.{i}.self_attn.v_proj.weight", ("attn.wv_dkh",), KV_HEADS, "text_layer"),
    Rule(_T + "layers.{i}.self_attn.o_proj.weight", ("attn.wo_nhd",), O_HEADS, "text_layer"),
    Rule(_T + "layers.{i}.self_attn.q_norm.weight", ("attn.q_norm.weight",), IDENT, "text_layer"),
    Rule(_T + "layers.{i}.self_attn.k_norm.weight", ("attn.k_norm.weight",), IDENT, "text_layer"),
    Rule(_T + "layers.{i}.mlp.gate.weight", ("mlp.router_de",), TRANSPOSE, "text_layer", has_moe),
    Rule(_T + "layers.{i}.mlp.experts.gate_up_proj", ("mlp.wi_gate_edf", "mlp.wi_up_edf"),
         EXPERTS_GATE_UP, "text_layer", has_moe),
    Rule(_T + "layers.{i}.mlp.experts.down_proj", ("mlp.wo_efd",), EXPERTS_DOWN, "text_layer", has_moe),
    Rule(_T + "layers.{i}.mlp.gate_proj.weight", ("mlp.wi_gate_df",), TRANSPOSE, "text_layer", has_dense_mlp),
    Rule(_T + "layers.{i}.mlp.up_proj.weight", ("mlp.wi_up_df",), TRANSPOSE, "text_layer", has_dense_mlp),
    Rule(_T + "layers.{i}.mlp.down_proj.weight", ("mlp.wo_fd",), TRANSPOSE, "text_layer", has_dense_mlp),
    *vision_rules(deepstack=True),
)

EMBED_KEY = _T + "embed_tokens.weight"
HEAD_KEY = "lm_head.weight"


def key_table(cfg: ModelConfig) -> dict[str, tuple[Rule, tuple[Target, ...]]]:
    """Every concrete HF key this config has -> (rule, our targets)."""
    return expand_rules(RULES, text_layers=slots_of_groups(layer_groups(cfg), cfg.text.num_hidden_layers),
                        vision_groups=vision_segments(cfg.vision), n_vision_blocks=cfg.vision.depth,
                        n_deepstack=len(cfg.vision.deepstack_visual_indexes),
                        skip=(HEAD_KEY,) if cfg.tie_word_embeddings else ())


# Published checkpoints store fused experts [E, H, 2I] ("in_out"); transformers' save_pretrained
# writes [E, 2I, H] ("out_in"), the default for a model that was not loaded from a checkpoint.
CHECKPOINT = CheckpointFormat(
    key_table=key_table, embed_key=lambda cfg: EMBED_KEY, head_key=HEAD_KEY,
    expert_layouts={"in_out": "in_out", "published": "in_out", "out_in": "out_in", "transformers": "out_in"},
    export_layout="out_in")
