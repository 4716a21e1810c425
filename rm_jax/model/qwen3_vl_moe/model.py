"""The Qwen3-VL-MoE judge: vision tower + MRoPE text decoder (dense/sparse layers) + LM head.

Design choices:

* **The model on prepared arrays.** ``forward_arrays`` is the pure, jittable model on a
  ``JudgeInputs`` pytree (``rm_jax.model.inputs.prepare_inputs``); the convenience forward and
  the cached split come from ``JudgeModule``. The class implements ``interface.JudgeModel``.
* **Image features are spliced with a gather** by ``image_index_bt`` (row-major, the order of
  transformers' ``masked_scatter``); the same index adds the deepstack features after the first
  ``len(deepstack)`` decoder layers.
* **Layer groups.** ``cfg.layer_specs()`` (attention + dense MLP or sparse MoE per layer) is cut
  into maximal runs of one spec, a deepstack-receiving layer alone (``layer_stack.group_layers``).
  Each run is one scanned ``LayerStack``; the HF key table (``params.py``) places checkpoint
  layers by the same groups.
* **Decoding.** ``decode_tokens`` runs new text tokens against a ``DecodeState``; every layer is
  attention, so the state has a KV cache and no recurrent part.
* **Outputs.** ``__call__`` returns logits only. ``forward(..., return_hidden=True)`` returns a
  ``JudgeOutput`` with every decoder layer's output (before the deepstack addition, as transformers'
  layer hooks see it), the vision features and the MoE aux of every sparse layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from rm_jax.model.records import DecodeState, JudgeInputs, JudgeOutput, NewTokenState
from rm_jax.model.judge_module import JudgeModule
from rm_jax.model.layer_stack import LayerGroup, LayerSpec, LayerStack, group_layers, kind_offsets
from rm_jax.model.layers import (MLP, Attention, AttentionMask, RMSNorm, as_dtype, causal_padding_mask,
                                 mrope_cos_sin, normal, param)
from rm_jax.model.moe import MoeConfig, SparseMoeBlock
from rm_jax.model.qwen3_vl_moe.config import ModelConfig
from rm_jax.model.vision import VisionModel
from rm_jax.sharding import constrain


# ---------------------------------------------------------------------------------------------
# Decoder
# ---------------------------------------------------------------------------------------------

def layer_groups(cfg: ModelConfig) -> tuple[LayerGroup, ...]:
    """Decoder layers as scanned groups: one spec per run, deepstack-receiving layers alone."""
    return group_layers(cfg.layer_specs(), alone=range(len(cfg.vision.deepstack_visual_indexes)))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, rngs: nnx.Rngs):
        if spec.mixer != "attention":
            raise ValueError(f"Qwen3-VL-MoE layers are attention layers; got {spec}")
        t, rt = cfg.text, cfg.runtime
        dtype, pdtype = as_dtype(rt.dtype), as_dtype(rt.param_dtype)
        sparse = spec.ffn == "moe"
        self.sparse = sparse
        self.input_norm = RMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=pdtype)
        self.attn = Attention(t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
                              t.rms_norm_eps, rngs=rngs, dtype=dtype, param_dtype=pdtype, impl=rt.attention)
        self.post_norm = RMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=pdtype)
        if sparse:
            moe_cfg = MoeConfig(d_model=t.hidden_size, d_ff=t.moe_intermediate_size,
                                num_experts=t.num_experts, top_k=t.num_experts_per_tok,
                                norm_topk_prob=t.norm_topk_prob, backend=rt.moe_backend,
                                ragged_dot=rt.ragged_dot)
            self.mlp = SparseMoeBlock(moe_cfg, rngs=rngs, dtype=dtype, param_dtype=pdtype)
        else:
            self.mlp = MLP(t.hidden_size, t.intermediate_size, rngs=rngs, dtype=dtype, param_dtype=pdtype)

    def __call__(self, x_btd, cos_btd, sin_btd, attn_mask, attention_mask_bt, *, return_kv: bool = False):
        """``(y_btd, aux)``, or ``(y_btd, aux, (k_btkh, v_btkh))`` with ``return_kv`` (cache prefill)."""
        h_btd, kv = self.attn(self.input_norm(x_btd), cos_btd, sin_btd, attn_mask, return_kv=True)
        y_btd, aux = self._ffn(x_btd + h_btd, attention_mask_bt)
        return (y_btd, aux, kv) if return_kv else (y_btd, aux)

    def _ffn(self, x_btd, attention_mask_bt):
        # Shared by the full forward and the cached decode step, so the two cannot drift apart.
        h_btd = self.post_norm(x_btd)
        if self.sparse:
            y_btd, aux = self.mlp(h_btd, mask_bt=attention_mask_bt)
        else:
            y_btd, aux = self.mlp(h_btd), None
        return constrain(x_btd + y_btd, ("batch", "length", "act_embed")), aux

    def decode(self, x_bnd, cos_bnd, sin_bnd, k_cache_bskh, v_cache_bskh, write_b, kv_lengths_b):
        """N cached new tokens through this layer -> ``(y_bnd, (k_bnkh, v_bnkh))`` (rm_jax.model.decode)."""
        h_bnd, k_bnkh, v_bnkh = self.attn.decode(self.input_norm(x_bnd), cos_bnd, sin_bnd, k_cache_bskh,
                                                 v_cache_bskh, write_b, kv_lengths_b)
        y_bnd, _ = self._ffn(x_bnd + h_bnd, None)
        return y_bnd, (k_bnkh, v_bnkh)


class Qwen3VLMoeJudge(JudgeModule):
    """Qwen3VLMoeForConditionalGeneration in NNX. ``model(input_ids, ...) -> logits [B, T, V]``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        t, rt = cfg.text, cfg.runtime
        dtype, pdtype = as_dtype(rt.dtype), as_dtype(rt.param_dtype)
        self.cfg, self.dtype = cfg, dtype
        self.mesh = None  # set by load_hf(mesh=...); forward then runs under jax.set_mesh(mesh)
        self.embed_vd = param(normal(rngs, (t.vocab_size, t.hidden_size), pdtype), ("vocab", "embed"))
        self.vision = VisionModel(cfg.vision, rngs=rngs, dtype=dtype, param_dtype=pdtype,
                                  scan=rt.scan_layers, remat=rt.remat, attention=rt.attention)
        self.layer_groups = layer_groups(cfg)
        self.decoder = nnx.List([
            LayerStack(functools.partial(lambda sp, r: DecoderLayer(cfg, sp, rngs=r), g.spec), g.size, rngs=rngs)
            for g in self.layer_groups])
        self.final_norm = RMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=pdtype)
        self.lm_head_dv = (None if cfg.tie_word_embeddings else
                           param(normal(rngs, (t.hidden_size, t.vocab_size), pdtype, t.hidden_size),
                                 ("embed", "vocab")))

    # -- pure forward on prepared arrays --------------------------------------------------------

    def head_dv(self) -> jax.Array:
        """The LM head as [D, V] (the transposed embedding when tied)."""
        return self.embed_vd[...].T if self.lm_head_dv is None else self.lm_head_dv[...]

    def forward_arrays(self, inputs: JudgeInputs, *, return_hidden: bool = False,
                       logits: bool = True, return_kv: bool = False) -> JudgeOutput:
        """Pure forward. ``logits=False`` skips the [B, T, V] head (a chunked loss uses
        ``final_hidden_btd`` and ``head_dv()`` instead, which is then always returned).
        ``return_hidden`` adds every layer's output ([L, B, T, D]: memory, so not for training).
        ``return_kv`` adds every layer's rotated keys and values ``kv_lbtkh`` (a KV-cache prefill,
        rm_jax.model.decode)."""
        cfg, dt = self.cfg, self.dtype
        ids_bt = constrain(jnp.asarray(inputs.input_ids_bt), ("batch", "length"))
        mask_bt = jnp.asarray(inputs.attention_mask_bt)
        x_btd = jnp.take(self.embed_vd[...], ids_bt, axis=0).astype(dt)
        x_btd = constrain(x_btd, ("batch", "length", "act_embed"))

        image_nd, deepstack, gather_bt, is_image_bt1 = None, [], None, None
        if inputs.vision is not None:
            image_nd, deepstack = self.vision(inputs.vision)
            image_nd = image_nd.astype(dt)
            index_bt = jnp.asarray(inputs.image_index_bt)
            is_image_bt1 = (index_bt >= 0)[..., None]
            gather_bt = jnp.maximum(index_bt, 0)
            x_btd = jnp.where(is_image_bt1, jnp.take(image_nd, gather_bt, axis=0), x_btd)
        inputs_embeds = x_btd

        t = cfg.text
        cos_btd, sin_btd = mrope_cos_sin(jnp.asarray(inputs.positions_3bt), t.head_dim, t.rope_theta,
                                         t.mrope_section, dt)
        if inputs.kv_lengths_b is not None:
            attn_mask = AttentionMask(kv_lengths_b=jnp.asarray(inputs.kv_lengths_b))
        else:
            attn_mask = AttentionMask(mask_b1ts=causal_padding_mask(mask_bt))

        def body(layer, x, _):
            y, aux, kv = layer(x, cos_btd, sin_btd, attn_mask, mask_bt, return_kv=True)
            return y, (y if return_hidden else None, aux, kv if return_kv else None)

        hidden, auxes, kvs = [], [], []
        for group, stack in zip(self.layer_groups, self.decoder):
            start = group.start
            x_btd, (h_lbtd, aux, kv) = stack.apply(body, x_btd, scan=cfg.runtime.scan_layers,
                                                   remat=cfg.runtime.remat, codec=cfg.runtime.stack_codec)
            hidden.append(h_lbtd)
            auxes.append(aux)
            kvs.append(kv)
            if start < len(deepstack):
                # Layer `start` is alone in its group (layer_groups guarantees it).
                feats_nd = deepstack[start].astype(dt)
                x_btd = x_btd + jnp.where(is_image_bt1, jnp.take(feats_nd, gather_bt, axis=0), 0)

        final_btd = self.final_norm(x_btd)
        if logits:
            logits = jnp.einsum("btd,dv->btv", final_btd, self.head_dv().astype(dt))
            logits = constrain(logits.astype(jnp.float32), ("batch", "length", "act_vocab"))
        else:
            logits = None

        auxes = [a for a in auxes if a is not None]
        moe_aux = jax.tree.map(lambda *a: jnp.concatenate(a), *auxes) if auxes else None
        kv_lbtkh = jax.tree.map(lambda *a: jnp.concatenate(a), *kvs) if return_kv else None
        if not return_hidden:
            # Without logits the caller needs the normed hidden states for its own (chunked) head.
            return JudgeOutput(logits_btv=logits, final_hidden_btd=None if logits is not None else final_btd,
                               moe_aux=moe_aux, kv_lbtkh=kv_lbtkh)
        return JudgeOutput(
            logits_btv=logits, layer_hidden_lbtd=jnp.concatenate(hidden), inputs_embeds_btd=inputs_embeds,
            final_hidden_btd=final_btd, image_embeds_nd=image_nd,
            deepstack_embeds=tuple(deepstack) if deepstack else None, moe_aux=moe_aux, kv_lbtkh=kv_lbtkh)

    # -- cached decoding (rm_jax.model.decode) ----------------------------------------------------

    def decode_tokens(self, state: DecodeState, tokens_bn: jax.Array,
                      valid_bn: jax.Array | None = None) -> tuple[jax.Array, NewTokenState]:
        """New text tokens after the cached ones -> (last layer's ``x_bnd`` before the final norm,
        each attention layer's new rotated k/v ``[L, B, N, K, Hd]``). ``valid_bn`` is unused: the
        KV cache needs no masking of right padding (the key-length mask hides it)."""
        del valid_bn
        cfg, dt, t = self.cfg, self.dtype, self.cfg.text
        b, n = tokens_bn.shape
        x_bnd = jnp.take(self.embed_vd[...], tokens_bn, axis=0).astype(dt)
        x_bnd = constrain(x_bnd, ("batch", "length", "act_embed"))
        # Text after the cached tokens: position next_pos + i on all three MRoPE axes.
        pos_bn = state.next_pos_b[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
        cos_bnd, sin_bnd = mrope_cos_sin(jnp.broadcast_to(pos_bn[None], (3, b, n)), t.head_dim, t.rope_theta,
                                         t.mrope_section, dt)
        write_b = state.length_b
        kv_lengths_b = write_b + 1   # what the first new token sees: the cached tokens and itself

        def body(layer, x, kv):
            return layer.decode(x, cos_bnd, sin_bnd, kv[0], kv[1], write_b, kv_lengths_b)

        new_k, new_v = [], []
        for group, offset, stack in zip(self.layer_groups, kind_offsets(self.layer_groups), self.decoder):
            # New tokens are text: no image features and no deepstack additions here.
            xs = (state.kv.k_lbskh[offset:offset + group.size], state.kv.v_lbskh[offset:offset + group.size])
            x_bnd, (k_lbnkh, v_lbnkh) = stack.apply(body, x_bnd, xs, scan=cfg.runtime.scan_layers)
            new_k.append(k_lbnkh)
            new_v.append(v_lbnkh)
        return x_bnd, NewTokenState(kv=(jnp.concatenate(new_k), jnp.concatenate(new_v)), recurrent=None)


def init_model(cfg: ModelConfig, seed: int = 0) -> Qwen3VLMoeJudge:
    """A randomly initialized model (tests, benchmarks); real runs use ``load_hf``."""
    return Qwen3VLMoeJudge(cfg, rngs=nnx.Rngs(seed))


def abstract_model(cfg: ModelConfig) -> Qwen3VLMoeJudge:
    """Shapes and metadata only: no memory is allocated (the loader fills it)."""
    return nnx.eval_shape(lambda: Qwen3VLMoeJudge(cfg, rngs=nnx.Rngs(0)))
