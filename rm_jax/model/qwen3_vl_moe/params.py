"""Qwen3-VL-MoE's HF key table: every transformers key of ``Qwen3VLMoeForConditionalGeneration``
with the rm_jax param path(s) it fills and the transform between them.

``rm_jax.model.convert`` applies the table (load forwards, export backwards); ``{i}`` is a
decoder layer / vision block index, placed into its scanned stack by ``model.layer_groups`` and
``vision.vision_segments``, and ``{j}`` a deepstack merger.
"""

from __future__ import annotations

import numpy as np

from rm_jax.model.convert import (EXPERTS_DOWN, EXPERTS_GATE_UP, IDENT, TRANSPOSE, Rule, Target, Transform,
                                  expand_rules, has_dense_mlp, has_moe)
from rm_jax.model.qwen3_vl_moe.config import ModelConfig
from rm_jax.model.qwen3_vl_moe.model import layer_groups
from rm_jax.model.vision import vision_segments

_t = Transform

# Linear [n*h, D] -> [D, n, h] (q/k/v) and back.
Q_HEADS = _t(lambda w, c, x: (w.T.reshape(w.shape[1], c.text.num_attention_heads, c.text.head_dim),),
             lambda o, c, x: o[0].reshape(o[0].shape[0], -1).T)
KV_HEADS = _t(lambda w, c, x: (w.T.reshape(w.shape[1], c.text.num_key_value_heads, c.text.head_dim),),
              lambda o, c, x: o[0].reshape(o[0].shape[0], -1).T)
# Linear [D, n*h] -> [n, h, D] (o_proj) and back.
O_HEADS = _t(lambda w, c, x: (w.T.reshape(c.text.num_attention_heads, c.text.head_dim, w.shape[0]),),
             lambda o, c, x: o[0].reshape(-1, o[0].shape[-1]).T)
VIS_O_HEADS = _t(lambda w, c, x: (w.T.reshape(c.vision.num_heads, c.vision.head_dim, w.shape[0]),),
                 lambda o, c, x: o[0].reshape(-1, o[0].shape[-1]).T)
# Conv3d weight [D, C, T, P, P] with stride == kernel -> matmul weight [C*T*P*P, D].
PATCH_CONV = _t(lambda w, c, x: (w.reshape(w.shape[0], -1).T,),
                lambda o, c, x: o[0].T.reshape(c.vision.hidden_size, c.vision.in_channels,
                                               c.vision.temporal_patch_size, c.vision.patch_size,
                                               c.vision.patch_size))


def _qkv_split(w, c, x):
    # qkv.weight [3*D, D]: rows are (which of q/k/v, head, head_dim), as HF's reshape(N, 3, heads, -1).
    v = c.vision
    w = w.reshape(3, v.num_heads, v.head_dim, w.shape[-1])
    return tuple(np.transpose(w[k], (2, 0, 1)) for k in range(3))


def _qkv_join(o, c, x):
    return np.concatenate([np.transpose(a, (1, 2, 0)).reshape(-1, a.shape[0]) for a in o], axis=0)


QKV_W = _t(_qkv_split, _qkv_join)
QKV_B = _t(lambda w, c, x: tuple(w.reshape(3, c.vision.num_heads, c.vision.head_dim)),
           lambda o, c, x: np.concatenate([a.reshape(-1) for a in o]))


_T = "model.language_model."
_V = "model.visual."
_MERGER = (("norm.weight", "norm.weight", IDENT), ("norm.bias", "norm.bias", IDENT),
           ("linear_fc1.weight", "fc1.w", TRANSPOSE), ("linear_fc1.bias", "fc1.b", IDENT),
           ("linear_fc2.weight", "fc2.w", TRANSPOSE), ("linear_fc2.bias", "fc2.b", IDENT))

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
    Rule(_V + "patch_embed.proj.weight", ("vision.patch_w_pd",), PATCH_CONV, "global"),
    Rule(_V + "patch_embed.proj.bias", ("vision.patch_b_d",), IDENT, "global"),
    Rule(_V + "pos_embed.weight", ("vision.pos_embed_pd",), IDENT, "global"),
    Rule(_V + "blocks.{i}.norm1.weight", ("norm1.weight",), IDENT, "vision_block"),
    Rule(_V + "blocks.{i}.norm1.bias", ("norm1.bias",), IDENT, "vision_block"),
    Rule(_V + "blocks.{i}.norm2.weight", ("norm2.weight",), IDENT, "vision_block"),
    Rule(_V + "blocks.{i}.norm2.bias", ("norm2.bias",), IDENT, "vision_block"),
    Rule(_V + "blocks.{i}.attn.qkv.weight", ("attn.wq_dnh", "attn.wk_dnh", "attn.wv_dnh"), QKV_W, "vision_block"),
    Rule(_V + "blocks.{i}.attn.qkv.bias", ("attn.bq_nh", "attn.bk_nh", "attn.bv_nh"), QKV_B, "vision_block"),
    Rule(_V + "blocks.{i}.attn.proj.weight", ("attn.wo_nhd",), VIS_O_HEADS, "vision_block"),
    Rule(_V + "blocks.{i}.attn.proj.bias", ("attn.bo_d",), IDENT, "vision_block"),
    Rule(_V + "blocks.{i}.mlp.linear_fc1.weight", ("fc1.w",), TRANSPOSE, "vision_block"),
    Rule(_V + "blocks.{i}.mlp.linear_fc1.bias", ("fc1.b",), IDENT, "vision_block"),
    Rule(_V + "blocks.{i}.mlp.linear_fc2.weight", ("fc2.w",), TRANSPOSE, "vision_block"),
    Rule(_V + "blocks.{i}.mlp.linear_fc2.bias", ("fc2.b",), IDENT, "vision_block"),
    *(Rule(_V + "merger." + k, ("vision.merger." + o,), t, "global") for k, o, t in _MERGER),
    *(Rule(_V + "deepstack_merger_list.{j}." + k, (o,), t, "deepstack") for k, o, t in _MERGER),
)

EMBED_KEY = _T + "embed_tokens.weight"
HEAD_KEY = "lm_head.weight"


def key_table(cfg: ModelConfig) -> dict[str, tuple[Rule, tuple[Target, ...]]]:
    """Every concrete HF key this config has -> (rule, our targets)."""
    return expand_rules(RULES, n_layers=cfg.text.num_hidden_layers, layer_groups=layer_groups(cfg),
                        vision_groups=vision_segments(cfg.vision), n_vision_blocks=cfg.vision.depth,
                        n_deepstack=len(cfg.vision.deepstack_visual_indexes),
                        skip=(HEAD_KEY,) if cfg.tie_word_embeddings else ())
