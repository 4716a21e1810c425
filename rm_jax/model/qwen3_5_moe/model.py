"""The Qwen3.5-MoE judge in NNX: vision tower (no deepstack) + a hybrid decoder of Gated DeltaNet
and gated full-attention layers, each followed by routed experts plus a shared expert.

Design choices:

* **A ``JudgeModule``** (``interface.JudgeModel``): ``cfg``, ``forward_arrays(JudgeInputs, ...) ->
  JudgeOutput``, ``head_dv()``, ``forward``/``__call__``; inputs come from ``inputs.prepare_inputs``
  (the MRoPE positions of Qwen3.5 follow the same rule as Qwen3-VL's).
* **Any layer pattern, scanned by period.** ``layer_types`` is split into its shortest repeating
  unit (``layer_period``): 40 layers of "3 x GDN, 1 x attention" are 10 blocks of 4 layers, one
  ``LayerStack`` scanned over blocks, so 4 layer bodies are compiled, not 40. A pattern with no
  repeat is one block of all the layers (unrolled). ``params.py`` places HF layer ``i`` at
  block ``i // p``, sub-layer ``i % p``.
* **Decode state per layer kind** (``rm_jax.model.decode_state``). ``forward_arrays(return_kv=True)``
  returns the rotated k/v of the attention layers (``kv_lbtkh``) and the (conv, fp32 recurrent)
  state of the GDN layers (``recurrent``), each stacked in layer order within its kind;
  ``decode_tokens`` runs new tokens against a ``DecodeState`` block by block, each layer's
  ``decode`` advancing it by N tokens from its own slice, so ``rm_jax.model.decode`` (the
  scorer's and server's decoder) drives this model unchanged.
* **Padding.** GDN layers get the attention mask as ``valid_bt``: pad positions neither decay nor
  write the recurrent state (and the conv sees zeros there, as transformers does), so right
  padding never reaches a row's state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rm_jax.model.gated_attention import GatedAttention
from rm_jax.model.gated_deltanet import GatedDeltaNet
from rm_jax.model.judge_module import JudgeModule
from rm_jax.model.layer_stack import REMAT_POLICIES, LayerStack
from rm_jax.model.layers import (AttentionMask, ZeroCenteredRMSNorm, as_dtype, causal_padding_mask, mrope_cos_sin,
                                 normal, param)
from rm_jax.model.moe import MoeConfig
from rm_jax.model.qwen3_5_moe.config import Qwen35MoeConfig
from rm_jax.model.records import DecodeState, JudgeInputs, JudgeOutput, NewTokenState
from rm_jax.model.shared_expert import SharedExpertMoeBlock
from rm_jax.model.vision import VisionModel
from rm_jax.sharding import constrain


def layer_period(layer_types) -> int:
    """The shortest p such that the pattern is its first p entries repeated."""
    n = len(layer_types)
    for p in range(1, n + 1):
        if n % p == 0 and all(layer_types[i] == layer_types[i % p] for i in range(n)):
            return p
    return n


def rope_tables(cfg: Qwen35MoeConfig, pos_3bt, dtype):
    """Interleaved MRoPE cos/sin over the rotary part of the head only: [B, T, rotary_dim]."""
    t = cfg.text
    return mrope_cos_sin(pos_3bt, t.rotary_dim, t.rope_theta, t.mrope_section, dtype)


class Qwen35DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen35MoeConfig, kind: str, *, rngs: nnx.Rngs):
        t, rt = cfg.text, cfg.runtime
        dtype, pdtype = as_dtype(rt.dtype), as_dtype(rt.param_dtype)
        self.kind = kind
        self.input_norm = ZeroCenteredRMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=pdtype)
        if kind == "full_attention":
            self.mixer = GatedAttention(t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
                                        t.rms_norm_eps, rngs=rngs, dtype=dtype, param_dtype=pdtype,
                                        impl=rt.attention)
        else:
            self.mixer = GatedDeltaNet(t.gdn(cfg.gdn_backend), rngs=rngs, dtype=dtype, param_dtype=pdtype)
        self.post_norm = ZeroCenteredRMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=pdtype)
        moe_cfg = MoeConfig(d_model=t.hidden_size, d_ff=t.moe_intermediate_size, num_experts=t.num_experts,
                            top_k=t.num_experts_per_tok, norm_topk_prob=t.norm_topk_prob,
                            backend=rt.moe_backend, ragged_dot=rt.ragged_dot)
        self.mlp = SharedExpertMoeBlock(moe_cfg, t.shared_expert_intermediate_size, rngs=rngs, dtype=dtype,
                                        param_dtype=pdtype)

    def __call__(self, x_btd, cos_btr, sin_btr, attn_mask, mask_bt, *, return_state: bool = False):
        """``(y_btd, aux, state)``: state is (k, v) or a GatedDeltaNetState (None without return_state)."""
        h_btd = self.input_norm(x_btd)
        if self.kind == "full_attention":
            h_btd, state = self.mixer(h_btd, cos_btr, sin_btr, attn_mask, return_kv=True)
        elif return_state:
            h_btd, state = self.mixer(h_btd, valid_bt=mask_bt, return_state=True)
        else:
            h_btd, state = self.mixer(h_btd, valid_bt=mask_bt), None
        y_btd, aux = self._ffn(x_btd + h_btd, mask_bt)
        return y_btd, aux, state if return_state else None

    def _ffn(self, x_btd, mask_bt):
        y_btd, aux = self.mlp(self.post_norm(x_btd), mask_bt=mask_bt)
        return constrain(x_btd + y_btd, ("batch", "length", "act_embed")), aux

    def decode(self, x_bnd, cos_bnr, sin_bnr, state, write_b, kv_lengths_b, valid_bn=None):
        """N new tokens from this layer's state -> ``(y_bnd, new state part)``.

        Attention: ``state`` is the (k, v) cache slice; returns the new tokens' (k, v) (the caller
        writes them at ``write_b``). GDN: ``state`` is a GatedDeltaNetState; returns the state
        after the row's valid new tokens (``valid_bn``: right-padded suffixes)."""
        h_bnd = self.input_norm(x_bnd)
        if self.kind == "full_attention":
            h_bnd, k_bnkh, v_bnkh = self.mixer.decode(h_bnd, cos_bnr, sin_bnr, state[0], state[1], write_b,
                                                      kv_lengths_b)
            new = (k_bnkh, v_bnkh)
        elif x_bnd.shape[1] == 1:
            h_bd, new = self.mixer.step(h_bnd[:, 0], state, valid_b=None if valid_bn is None else valid_bn[:, 0])
            h_bnd = h_bd[:, None]
        else:
            h_bnd, new = self.mixer(h_bnd, valid_bt=valid_bn, state=state, return_state=True)
        y_bnd, _ = self._ffn(x_bnd + h_bnd, None)
        return y_bnd, new


class HybridBlock(nnx.Module):
    """One period of the layer pattern (the unit ``LayerStack`` scans over)."""

    def __init__(self, cfg: Qwen35MoeConfig, kinds: tuple[str, ...], *, rngs: nnx.Rngs):
        self.kinds = kinds
        self.layers = nnx.List([Qwen35DecoderLayer(cfg, k, rngs=rngs) for k in kinds])


def _stack_kind(per_sublayer, js):
    """[n_blocks, ...] per sub-layer j in ``js`` -> [n_blocks * len(js), ...] in layer order."""
    if not js:
        return None
    return jax.tree.map(lambda *a: jnp.stack(a, 1).reshape((-1,) + a[0].shape[1:]),
                        *[per_sublayer[j] for j in js])


def _call_layer(layer, remat: str, *args, return_state: bool):
    """``layer(*args)``, each layer checkpointed on its own when remat is on (as the Qwen3-VL
    decoder, whose scan unit is one layer). The scan unit here is a whole block: checkpointing
    the block instead would recompute, and keep live, all its layers' internals (gathered
    experts, GDN chunk tensors) at once in its backward."""
    if remat == "none":
        return layer(*args, return_state=return_state)
    graphdef, state = nnx.split(layer)
    fn = jax.checkpoint(lambda st, *a: nnx.merge(graphdef, st)(*a, return_state=return_state),
                        policy=REMAT_POLICIES[remat], prevent_cse=False)
    return fn(state, *args)


class Qwen35MoeJudge(JudgeModule):
    """Qwen3_5MoeForConditionalGeneration (or ForCausalLM, ``cfg.vision is None``) in NNX.

    ``JudgeModule`` supplies the convenience API (``forward``/``__call__``, the cached split and
    jit) over this class's ``forward_arrays``; the decoder is one ``LayerStack`` of
    ``HybridBlock``s scanned over pattern periods."""

    def __init__(self, cfg: Qwen35MoeConfig, *, rngs: nnx.Rngs):
        t, rt = cfg.text, cfg.runtime
        dtype, pdtype = as_dtype(rt.dtype), as_dtype(rt.param_dtype)
        self.cfg, self.dtype = cfg, dtype
        self.mesh = None
        self.embed_vd = param(normal(rngs, (t.vocab_size, t.hidden_size), pdtype), ("vocab", "embed"))
        self.vision = (None if cfg.vision is None else
                       VisionModel(cfg.vision, rngs=rngs, dtype=dtype, param_dtype=pdtype, scan=rt.scan_layers,
                                   remat=rt.remat, attention=rt.attention))
        self.period = layer_period(t.layer_types)
        kinds = tuple(t.layer_types[:self.period])
        self.blocks = LayerStack(lambda r: HybridBlock(cfg, kinds, rngs=r), t.num_hidden_layers // self.period,
                                 rngs=rngs)
        self.final_norm = ZeroCenteredRMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=pdtype)
        self.lm_head_dv = (None if cfg.tie_word_embeddings else
                           param(normal(rngs, (t.hidden_size, t.vocab_size), pdtype, t.hidden_size),
                                 ("embed", "vocab")))

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.cfg.text.layer_types[:self.period])

    def head_dv(self) -> jax.Array:
        return self.embed_vd[...].T if self.lm_head_dv is None else self.lm_head_dv[...]

    def embed(self, inputs: JudgeInputs):
        """Token embeddings with the image features spliced in -> (x_btd, image_nd)."""
        dt = self.dtype
        ids_bt = constrain(jnp.asarray(inputs.input_ids_bt), ("batch", "length"))
        x_btd = constrain(jnp.take(self.embed_vd[...], ids_bt, axis=0).astype(dt), ("batch", "length", "act_embed"))
        image_nd = None
        if inputs.vision is not None:
            if self.vision is None:
                raise ValueError("this is a text-only (ForCausalLM) checkpoint: it takes no images")
            image_nd, _ = self.vision(inputs.vision)
            image_nd = image_nd.astype(dt)
            index_bt = jnp.asarray(inputs.image_index_bt)
            x_btd = jnp.where((index_bt >= 0)[..., None], jnp.take(image_nd, jnp.maximum(index_bt, 0), axis=0),
                              x_btd)
        return x_btd, image_nd

    def forward_arrays(self, inputs: JudgeInputs, *, return_hidden: bool = False,
                       logits: bool = True, return_kv: bool = False) -> JudgeOutput:
        """As ``Qwen3VLMoeJudge.forward_arrays``; ``return_kv`` adds the attention layers' (k, v)
        ``kv_lbtkh`` and the GDN layers' ``recurrent`` state (a ``DecodeState`` prefill)."""
        cfg, dt = self.cfg, self.dtype
        mask_bt = jnp.asarray(inputs.attention_mask_bt)
        x_btd, image_nd = self.embed(inputs)
        inputs_embeds = x_btd
        cos_btr, sin_btr = rope_tables(cfg, jnp.asarray(inputs.positions_3bt), dt)
        if inputs.kv_lengths_b is not None:
            attn_mask = AttentionMask(kv_lengths_b=jnp.asarray(inputs.kv_lengths_b))
        else:
            attn_mask = AttentionMask(mask_b1ts=causal_padding_mask(mask_bt))

        remat = cfg.runtime.remat

        def body(block, x, _):
            hs, auxes, states = [], [], []
            for layer in block.layers:
                x, aux, state = _call_layer(layer, remat, x, cos_btr, sin_btr, attn_mask, mask_bt,
                                            return_state=return_kv)
                hs.append(x if return_hidden else None)
                auxes.append(aux)
                states.append(state)
            stack = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)
            return x, (stack(hs) if return_hidden else None, stack(auxes), tuple(states) if return_kv else None)

        # Remat is per layer (_call_layer), not per block.
        x_btd, (h_nplbtd, aux_np, states) = self.blocks.apply(body, x_btd, scan=cfg.runtime.scan_layers,
                                                              codec=cfg.runtime.stack_codec)
        flat = lambda a: a.reshape((-1,) + a.shape[2:])     # [blocks, period, ...] -> [layers, ...]
        moe_aux = jax.tree.map(flat, aux_np)
        kv = recurrent = None
        if return_kv:
            attn_js = [j for j, k in enumerate(self.kinds) if k == "full_attention"]
            gdn_js = [j for j, k in enumerate(self.kinds) if k != "full_attention"]
            kv, recurrent = _stack_kind(states, attn_js), _stack_kind(states, gdn_js)

        final_btd = self.final_norm(x_btd)
        logits_btv = None
        if logits:
            logits_btv = jnp.einsum("btd,dv->btv", final_btd, self.head_dv().astype(dt))
            logits_btv = constrain(logits_btv.astype(jnp.float32), ("batch", "length", "act_vocab"))
        if not return_hidden:
            return JudgeOutput(logits_btv=logits_btv, final_hidden_btd=None if logits_btv is not None else final_btd,
                               moe_aux=moe_aux, kv_lbtkh=kv, recurrent=recurrent)
        return JudgeOutput(logits_btv=logits_btv, layer_hidden_lbtd=flat(h_nplbtd), inputs_embeds_btd=inputs_embeds,
                           final_hidden_btd=final_btd, image_embeds_nd=image_nd, moe_aux=moe_aux, kv_lbtkh=kv,
                           recurrent=recurrent)

    # -- cached decoding (rm_jax.model.decode) ----------------------------------------------------

    def decode_tokens(self, state: DecodeState, tokens_bn: jax.Array,
                      valid_bn: jax.Array | None = None) -> tuple[jax.Array, NewTokenState]:
        """N new text tokens per row after the cached ones -> (last layer's ``x_bnd`` before the
        final norm, the attention layers' new k/v ``[L_attn, B, N, K, Hd]`` (not yet written) and
        the GDN layers' state after each row's valid new tokens). ``valid_bn`` False marks right
        padding, which leaves a GDN state unchanged (the KV side needs no mask: key lengths hide it)."""
        dt = self.dtype
        b, n = tokens_bn.shape
        x_bnd = constrain(jnp.take(self.embed_vd[...], tokens_bn, axis=0).astype(dt),
                          ("batch", "length", "act_embed"))
        # Text after the cached tokens: position next_pos + i on all three MRoPE axes.
        pos_bn = state.next_pos_b[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
        cos_bnr, sin_bnr = rope_tables(self.cfg, jnp.broadcast_to(pos_bn[None], (3, b, n)), dt)
        write_b = state.length_b
        kv_lengths_b = write_b + 1   # what the first new token sees: the cached tokens and itself
        n_blocks = self.blocks.n
        # Each kind's stack is in layer order, so block i's sub-layers of that kind are rows
        # [i * per_block, (i + 1) * per_block): a reshape gives the scan's per-block slices.
        per_block = lambda a: a.reshape((n_blocks, -1) + a.shape[1:])
        kv = None if state.kv is None else (per_block(state.kv.k_lbskh), per_block(state.kv.v_lbskh))
        rec = None if state.recurrent is None else jax.tree.map(per_block, state.recurrent)

        def body(block, x, xs):
            kv_cache, gdn = xs
            new_kv, new_gdn = [], []
            for layer in block.layers:
                if layer.kind == "full_attention":
                    a = len(new_kv)
                    x, out = layer.decode(x, cos_bnr, sin_bnr, (kv_cache[0][a], kv_cache[1][a]), write_b,
                                          kv_lengths_b)
                    new_kv.append(out)
                else:
                    g = len(new_gdn)
                    x, out = layer.decode(x, cos_bnr, sin_bnr, jax.tree.map(lambda s: s[g], gdn), write_b,
                                          kv_lengths_b, valid_bn)
                    new_gdn.append(out)
            stack = lambda parts: jax.tree.map(lambda *a: jnp.stack(a), *parts) if parts else None
            return x, (stack(new_kv), stack(new_gdn))

        x_bnd, (kv_new, rec_new) = self.blocks.apply(body, x_bnd, (kv, rec), scan=self.cfg.runtime.scan_layers)
        flat = lambda a: a.reshape((-1,) + a.shape[2:])     # [blocks, per block, ...] -> [layers, ...]
        return x_bnd, NewTokenState(kv=None if kv_new is None else jax.tree.map(flat, kv_new),
                                    recurrent=None if rec_new is None else jax.tree.map(flat, rec_new))

def init_model(cfg: Qwen35MoeConfig, seed: int = 0) -> Qwen35MoeJudge:
    return Qwen35MoeJudge(cfg, rngs=nnx.Rngs(seed))


def abstract_model(cfg: Qwen35MoeConfig) -> Qwen35MoeJudge:
    return nnx.eval_shape(lambda: Qwen35MoeJudge(cfg, rngs=nnx.Rngs(0)))
