"""A tiny attention + Gated DeltaNet judge, for tests only: it implements ``interface.JudgeModel``
with both decode-state kinds, so the architecture-free decoding in ``rm_jax.model.decode`` can be
checked against a full re-forward before a real hybrid architecture (Qwen3.5) is registered.

Text only, 1-D positions (all three MRoPE axes equal), right padding. Each layer: pre-norm mixer
(GQA attention with q/k-norm, or ``gated_deltanet.GatedDeltaNet``) then a pre-norm dense MLP.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from rm_jax.model.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
from rm_jax.model.judge_module import JudgeModule
from rm_jax.model.layer_stack import LayerSpec, LayerStack, group_layers, kind_offsets
from rm_jax.model.layers import MLP, Attention, AttentionMask, RMSNorm, mrope_cos_sin, normal, param
from rm_jax.model.records import DecodeState, JudgeInputs, JudgeOutput, NewTokenState

SECTION = (4, 2, 2)      # MRoPE sections of a 16-dim head


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    specs: tuple[LayerSpec, ...]
    vocab_size: int = 96
    hidden_size: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    gdn: GatedDeltaNetConfig = GatedDeltaNetConfig(hidden_size=32, num_key_heads=2, num_value_heads=4,
                                                   key_head_dim=8, value_head_dim=8, chunk_size=8)
    image_token_id: int = -1      # what rm_jax.model.inputs reads; no images here
    video_token_id: int = -2


class HybridLayer(nnx.Module):
    def __init__(self, cfg: HybridConfig, spec: LayerSpec, *, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.mixer_norm = RMSNorm(d, 1e-6)
        if spec.mixer == "attention":
            self.mixer = Attention(d, cfg.heads, cfg.kv_heads, cfg.head_dim, 1e-6, rngs=rngs, impl="xla")
        else:
            self.mixer = GatedDeltaNet(cfg.gdn, rngs=rngs)
        self.mlp_norm = RMSNorm(d, 1e-6)
        self.mlp = MLP(d, 2 * d, rngs=rngs)

    def _ffn(self, x):
        return x + self.mlp(self.mlp_norm(x))

    def prefill(self, x_btd, cos, sin, mask, valid_bt):
        h = self.mixer_norm(x_btd)
        if isinstance(self.mixer, Attention):
            y, kv = self.mixer(h, cos, sin, mask, return_kv=True)
            return self._ffn(x_btd + y), (kv, None)
        y, state = self.mixer(h, valid_bt=valid_bt, state=None, return_state=True)
        return self._ffn(x_btd + y), (None, state)

    def decode(self, x_bnd, cos, sin, kv, rec, write_b, kv_lengths_b, valid_bn):
        h = self.mixer_norm(x_bnd)
        if isinstance(self.mixer, Attention):
            y, k, v = self.mixer.decode(h, cos, sin, kv[0], kv[1], write_b, kv_lengths_b)
            return self._ffn(x_bnd + y), ((k, v), None)
        if x_bnd.shape[1] == 1:      # a decode step: the recurrent form
            y_bd, state = self.mixer.step(h[:, 0], rec, valid_b=None if valid_bn is None else valid_bn[:, 0])
            return self._ffn(x_bnd + y_bd[:, None]), (None, state)
        y, state = self.mixer(h, valid_bt=valid_bn, state=rec, return_state=True)   # chunked
        return self._ffn(x_bnd + y), (None, state)


class HybridJudge(JudgeModule):
    def __init__(self, cfg: HybridConfig, *, rngs: nnx.Rngs):
        self.cfg, self.dtype, self.mesh = cfg, jnp.float32, None
        d = cfg.hidden_size
        self.embed_vd = param(normal(rngs, (cfg.vocab_size, d), jnp.float32), ("vocab", "embed"))
        self.layer_groups = group_layers(cfg.specs)
        self.decoder = nnx.List([
            LayerStack(functools.partial(lambda sp, r: HybridLayer(cfg, sp, rngs=r), g.spec), g.size, rngs=rngs)
            for g in self.layer_groups])
        self.final_norm = RMSNorm(d, 1e-6)
        self.lm_head_dv = param(normal(rngs, (d, cfg.vocab_size), jnp.float32, d), ("embed", "vocab"))

    def head_dv(self):
        return self.lm_head_dv[...]

    def _cos_sin(self, pos_3bt):
        return mrope_cos_sin(pos_3bt, self.cfg.head_dim, self.cfg.rope_theta, SECTION, jnp.float32)

    def forward_arrays(self, inputs: JudgeInputs, *, return_hidden=False, logits=True, return_kv=False):
        mask_bt = jnp.asarray(inputs.attention_mask_bt)
        x = jnp.take(self.embed_vd[...], jnp.asarray(inputs.input_ids_bt), axis=0)
        cos, sin = self._cos_sin(jnp.asarray(inputs.positions_3bt))
        attn_mask = AttentionMask(kv_lengths_b=jnp.asarray(inputs.kv_lengths_b))
        kvs, recs = [], []
        for group, stack in zip(self.layer_groups, self.decoder):
            x, (kv, rec) = stack.apply(lambda layer, h, _: layer.prefill(h, cos, sin, attn_mask, mask_bt > 0), x,
                                       scan=True)
            (kvs if group.spec.mixer == "attention" else recs).append(kv if kv is not None else rec)
        final = self.final_norm(x)
        cat = lambda parts: jax.tree.map(lambda *a: jnp.concatenate(a), *parts) if parts else None
        out_logits = jnp.einsum("btd,dv->btv", final, self.head_dv()) if logits else None
        return JudgeOutput(logits_btv=out_logits, final_hidden_btd=None if logits else final,
                           kv_lbtkh=cat(kvs) if return_kv else None, recurrent=cat(recs) if return_kv else None)

    def decode_tokens(self, state: DecodeState, tokens_bn, valid_bn=None):
        b, n = tokens_bn.shape
        x = jnp.take(self.embed_vd[...], tokens_bn, axis=0)
        pos_bn = state.next_pos_b[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
        cos, sin = self._cos_sin(jnp.broadcast_to(pos_bn[None], (3, b, n)))
        write_b = state.length_b
        kvs, recs = [], []
        for group, offset, stack in zip(self.layer_groups, kind_offsets(self.layer_groups), self.decoder):
            sl = lambda a: a[offset:offset + group.size]
            if group.spec.mixer == "attention":
                xs = ((sl(state.kv.k_lbskh), sl(state.kv.v_lbskh)), None)
            else:
                xs = (None, jax.tree.map(sl, state.recurrent))
            x, (kv, rec) = stack.apply(
                lambda layer, h, s: layer.decode(h, cos, sin, s[0], s[1], write_b, write_b + 1, valid_bn), x, xs,
                scan=True)
            (kvs if group.spec.mixer == "attention" else recs).append(kv if kv is not None else rec)
        cat = lambda parts: jax.tree.map(lambda *a: jnp.concatenate(a), *parts) if parts else None
        return x, NewTokenState(kv=cat(kvs), recurrent=cat(recs))
