"""The HF key table of the shared Qwen-VL vision tower (``rm_jax.model.vision``): every
``model.visual.*`` key with the rm_jax param path(s) it fills and the transform between them.

Qwen3-VL-MoE uses all of it; Qwen3.5-MoE's ViT is the same tower without the deepstack mergers.
``{i}`` is a vision block, placed into its scanned run by ``vision.vision_segments``; ``{j}`` a
deepstack merger.
"""

from __future__ import annotations

import numpy as np

from rm_jax.model.hf_table import IDENT, TRANSPOSE, Rule, Transform

PREFIX = "model.visual."

O_HEADS = Transform(lambda w, c, x: (w.T.reshape(c.vision.num_heads, c.vision.head_dim, w.shape[0]),),
                    lambda o, c, x: o[0].reshape(-1, o[0].shape[-1]).T)
# Conv3d weight [D, C, T, P, P] with stride == kernel -> matmul weight [C*T*P*P, D].
PATCH_CONV = Transform(lambda w, c, x: (w.reshape(w.shape[0], -1).T,),
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


QKV_W = Transform(_qkv_split, _qkv_join)
QKV_B = Transform(lambda w, c, x: tuple(w.reshape(3, c.vision.num_heads, c.vision.head_dim)),
                  lambda o, c, x: np.concatenate([a.reshape(-1) for a in o]))

_V = PREFIX
_MERGER = (("norm.weight", "norm.weight", IDENT), ("norm.bias", "norm.bias", IDENT),
           ("linear_fc1.weight", "fc1.w", TRANSPOSE), ("linear_fc1.bias", "fc1.b", IDENT),
           ("linear_fc2.weight", "fc2.w", TRANSPOSE), ("linear_fc2.bias", "fc2.b", IDENT))

_TOWER: tuple[Rule, ...] = (
    Rule(_V + "patch_embed.proj.weight", ("vision.patch_w_pd",), PATCH_CONV, "global"),
    Rule(_V + "patch_embed.proj.bias", ("vision.patch_b_d",), IDENT, "global"),
    Rule(_V + "pos_embed.weight", ("vision.pos_embed_pd",), IDENT, "global"),
    Rule(_V + "blocks.{i}.norm1.weight", ("norm1.weight",), IDENT, "vision_block"),
    Rule(_V + "blocks.{i}.norm1.bias", ("norm1.bias",), IDENT, "vision_block"),
    Rule(_V + "blocks.{i}.norm2.weight", ("norm2.weight",), IDENT, "vision_block"),
    Rule(_V + "blocks.{i}.norm2.bias", ("norm2.bias",), IDENT, "vision_block"),
    Rule(_V + "blocks.{i}.attn.qkv.weight", ("attn.wq_dnh", "attn.wk_dnh", "attn.wv_dnh"), QKV_W, "vision_block"),
    Rule(_V + "blocks.{i}.attn.qkv.bias", ("attn.bq_nh", "attn.bk_nh", "attn.bv_nh"), QKV_B, "vision_block"),
    Rule(_V + "blocks.{i}.attn.proj.weight", ("attn.wo_nhd",), O_HEADS, "vision_block"),
    Rule(_V + "blocks.{i}.attn.proj.bias", ("attn.bo_d",), IDENT, "vision_block"),
    Rule(_V + "blocks.{i}.mlp.linear_fc1.weight", ("fc1.w",), TRANSPOSE, "vision_block"),
    Rule(_V + "blocks.{i}.mlp.linear_fc1.bias", ("fc1.b",), IDENT, "vision_block"),
    Rule(_V + "blocks.{i}.mlp.linear_fc2.weight", ("fc2.w",), TRANSPOSE, "vision_block"),
    Rule(_V + "blocks.{i}.mlp.linear_fc2.bias", ("fc2.b",), IDENT, "vision_block"),
    *(Rule(_V + "merger." + k, ("vision.merger." + o,), t, "global") for k, o, t in _MERGER),
)
_DEEPSTACK: tuple[Rule, ...] = tuple(Rule(_V + "deepstack_merger_list.{j}." + k, (o,), t, "deepstack")
                                     for k, o, t in _MERGER)


def vision_rules(*, deepstack: bool) -> tuple[Rule, ...]:
    """The tower's rules, with or without the deepstack mergers."""
    return _TOWER + _DEEPSTACK if deepstack else _TOWER
