"""Qwen3.5-MoE's HF key table and checkpoint format (``Qwen3_5MoeForConditionalGeneration`` and the
text-only ``Qwen3_5MoeForCausalLM``).

Design choices:

* **The table is written in ``rm_jax.model.hf_table``'s words** and applied by
  ``rm_jax.model.hf_checkpoint``, as every architecture's is. The attention-head and fused-expert
  transforms and the ViT's keys (``vision_params``, without deepstack mergers) are shared; only
  Qwen3.5's own tensors get new transforms here (the gated ``q_proj``, the GDN layer).
* **Layer placement.** HF layer ``i`` lives in block ``i // p``, sub-layer ``i % p`` of the one
  scanned stack (``model.layer_period``); attention rules apply to ``full_attention`` layers, GDN
  rules to the others.
* **Expert layouts.** ``per_expert``: ``experts.{e}.{gate,up,down}_proj.weight``, what
  transformers 5.x's ``save_pretrained`` writes; fused ``gate_up_proj`` [E, 2I, H] /
  ``down_proj`` [E, H, I] (``out_in``, the published checkpoints); and the Qwen3-VL published
  orientation [E, H, 2I] / [E, I, H] (``in_out``). Export writes the layout the checkpoint came
  in (default per-expert, which is what transformers itself would write).
* **Text-only checkpoints** name the decoder ``model.`` instead of ``model.language_model.`` and
  have no ``model.visual.``.
* ``mtp.*`` (the multi-token-prediction head of the published checkpoints) is not part of the
  judge: those keys are skipped with one log line. Any other unknown key is an error.
"""

from __future__ import annotations

import numpy as np

from rm_jax.model.gated_deltanet import HF_PARAMS as GDN_HF_PARAMS
from rm_jax.model.hf_checkpoint import CheckpointFormat
from rm_jax.model.hf_table import (EXPERTS_DOWN, EXPERTS_GATE_UP, IDENT, KV_HEADS, O_HEADS, TRANSPOSE, LayerSlot,
                                   Rule, Target, Transform, expand_rules)
from rm_jax.model.qwen3_5_moe.config import Qwen35MoeConfig
from rm_jax.model.qwen3_5_moe.model import layer_period
from rm_jax.model.vision import vision_segments
from rm_jax.model.vision_params import vision_rules

MTP_PREFIX = "mtp."


# ---------------------------------------------------------------------------------------------
# Transforms of Qwen3.5's own tensors
# ---------------------------------------------------------------------------------------------

def _gated_q_fwd(w, c, x):
    # q_proj [N*2*Hd, D]: per head, Hd query rows then Hd gate rows (HF: view(..., N, 2*Hd).chunk(2)).
    t = c.text
    w_dn2h = w.T.reshape(w.shape[1], t.num_attention_heads, 2, t.head_dim)
    return w_dn2h[:, :, 0], w_dn2h[:, :, 1]


def _gated_q_inv(o, c, x):
    return np.stack(o, axis=2).reshape(o[0].shape[0], -1).T


GATED_Q = Transform(_gated_q_fwd, _gated_q_inv)


def _gdn(path: str, inverse) -> Transform:
    """gated_deltanet.HF_PARAMS' forward transform for ``path``, with its inverse."""
    fwd = GDN_HF_PARAMS[path][1]
    return Transform(lambda w, c, x: (fwd(w, c.text.gdn()),), lambda o, c, x: inverse(o[0]))


_flat_t = lambda a: a.reshape(a.shape[0], -1).T                   # [D, h, v] -> [h*v, D]
_GDN_INVERSES = {
    "in_proj_qkv_dc": lambda a: a.T, "in_proj_z_dhv": _flat_t, "in_proj_b_dh": lambda a: a.T,
    "in_proj_a_dh": lambda a: a.T, "conv1d_wc": lambda a: a.T[:, None, :], "A_log_h": lambda a: a,
    "dt_bias_h": lambda a: a, "norm.weight": lambda a: a,
    "out_proj_hvd": lambda a: a.reshape(-1, a.shape[-1]).T,        # [h, v, D] -> [D, h*v]
}


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------

def text_prefix(cfg: Qwen35MoeConfig) -> str:
    return "model." if cfg.text_only else "model.language_model."


def embed_key(cfg: Qwen35MoeConfig) -> str:
    return text_prefix(cfg) + "embed_tokens.weight"


def is_full_attention(layer_type: str) -> bool:
    return layer_type == "full_attention"


def is_linear_attention(layer_type: str) -> bool:
    return layer_type != "full_attention"


def rules(cfg: Qwen35MoeConfig) -> tuple[Rule, ...]:
    """Every HF key pattern of this config; ``{i}`` is a decoder layer or vision block index."""
    L = text_prefix(cfg) + "layers.{i}."
    attn, gdn = is_full_attention, is_linear_attention
    out = [
        Rule(text_prefix(cfg) + "embed_tokens.weight", ("embed_vd",), IDENT, "global"),
        Rule(text_prefix(cfg) + "norm.weight", ("final_norm.weight",), IDENT, "global"),
        Rule(L + "input_layernorm.weight", ("input_norm.weight",), IDENT, "text_layer"),
        Rule(L + "post_attention_layernorm.weight", ("post_norm.weight",), IDENT, "text_layer"),
        Rule(L + "mlp.gate.weight", ("mlp.routed.router_de",), TRANSPOSE, "text_layer"),
        Rule(L + "mlp.experts.gate_up_proj", ("mlp.routed.wi_gate_edf", "mlp.routed.wi_up_edf"),
             EXPERTS_GATE_UP, "text_layer"),
        Rule(L + "mlp.experts.down_proj", ("mlp.routed.wo_efd",), EXPERTS_DOWN, "text_layer"),
        Rule(L + "mlp.shared_expert.gate_proj.weight", ("mlp.shared.wi_gate_df",), TRANSPOSE, "text_layer"),
        Rule(L + "mlp.shared_expert.up_proj.weight", ("mlp.shared.wi_up_df",), TRANSPOSE, "text_layer"),
        Rule(L + "mlp.shared_expert.down_proj.weight", ("mlp.shared.wo_fd",), TRANSPOSE, "text_layer"),
        Rule(L + "mlp.shared_expert_gate.weight", ("mlp.shared_gate_d1",), TRANSPOSE, "text_layer"),
        Rule(L + "self_attn.q_proj.weight", ("mixer.wq_dnh", "mixer.wgate_dnh"), GATED_Q, "text_layer", attn),
        Rule(L + "self_attn.k_proj.weight", ("mixer.wk_dkh",), KV_HEADS, "text_layer", attn),
        Rule(L + "self_attn.v_proj.weight", ("mixer.wv_dkh",), KV_HEADS, "text_layer", attn),
        Rule(L + "self_attn.o_proj.weight", ("mixer.wo_nhd",), O_HEADS, "text_layer", attn),
        Rule(L + "self_attn.q_norm.weight", ("mixer.q_norm.weight",), IDENT, "text_layer", attn),
        Rule(L + "self_attn.k_norm.weight", ("mixer.k_norm.weight",), IDENT, "text_layer", attn),
        *(Rule(L + "linear_attn." + key, ("mixer." + path,), _gdn(path, _GDN_INVERSES[path]), "text_layer", gdn)
          for path, (key, _) in GDN_HF_PARAMS.items()),
    ]
    if not cfg.tie_word_embeddings:
        out.append(Rule("lm_head.weight", ("lm_head_dv",), TRANSPOSE, "global"))
    if cfg.vision is not None:
        out += vision_rules(deepstack=False)
    return tuple(out)


def key_table(cfg: Qwen35MoeConfig) -> dict[str, tuple[Rule, tuple[Target, ...]]]:
    """Every concrete (fused-layout) HF key of this config -> (rule, our targets)."""
    p = layer_period(cfg.text.layer_types)
    slots = [LayerSlot(("blocks", "layers", "layers", i % p), i // p, kind)
             for i, kind in enumerate(cfg.text.layer_types)]
    if cfg.vision is None:
        return expand_rules(rules(cfg), text_layers=slots)
    return expand_rules(rules(cfg), text_layers=slots, vision_groups=vision_segments(cfg.vision),
                        n_vision_blocks=cfg.vision.depth)


CHECKPOINT = CheckpointFormat(
    key_table=key_table, embed_key=embed_key,
    expert_layouts={"per_expert": "per_expert", "out_in": "out_in", "fused": "out_in", "published": "out_in",
                    "in_out": "in_out"},
    export_layout="per_expert", per_expert=True,
    ignored_prefixes={MTP_PREFIX: "the multi-token-prediction head"})
