"""Gated full attention (Qwen3.5 / Qwen3-Next): GQA self-attention whose ``q_proj`` also carries a
per-head output gate, zero-centred q/k RMSNorm, and partial rotary embeddings.

Design choices:

* **The gate is its own weight.** transformers' ``q_proj`` emits ``[N, 2*Hd]`` per token, query
  then gate within each head (interleaved per head); ``params.py`` splits it once at load into
  ``wq_dnh`` and ``wgate_dnh`` so the hot path has no strided slices. The output is
  ``o_proj(attn * sigmoid(gate))``.
* **Partial rotary.** Only the first ``rotary_dim`` channels of each head are rotated (MRoPE
  tables of that width, ``layers.mrope_cos_sin``); the rest pass through.
* Attention kernels, masks and the KV-cache decode follow ``layers.Attention`` (same kernels,
  same cache contract), so the two attention kinds cannot drift apart in what a cache holds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rm_jax.model import attention_cpu
from rm_jax.model.layers import AttentionMask, ZeroCenteredRMSNorm, apply_rope, causal_attention, normal, param
from rm_jax.sharding import constrain


def apply_partial_rope(x_bthd, cos_btr, sin_btr):
    """Rotate the first ``r`` channels (r = the tables' width), pass the rest through."""
    r = cos_btr.shape[-1]
    if r == x_bthd.shape[-1]:
        return apply_rope(x_bthd, cos_btr, sin_btr)
    return jnp.concatenate([apply_rope(x_bthd[..., :r], cos_btr, sin_btr), x_bthd[..., r:]], axis=-1)


class GatedAttention(nnx.Module):
    """transformers' ``Qwen3_5MoeAttention``."""

    def __init__(self, d_model: int, n_heads: int, n_kv: int, head_dim: int, eps: float, *,
                 rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32, impl: str = "auto"):
        self.n_heads, self.n_kv, self.head_dim, self.dtype, self.impl = n_heads, n_kv, head_dim, dtype, impl
        q_shape, kv_shape = (d_model, n_heads, head_dim), (d_model, n_kv, head_dim)
        self.wq_dnh = param(normal(rngs, q_shape, param_dtype, d_model), ("embed", "heads", "head_dim"))
        self.wgate_dnh = param(normal(rngs, q_shape, param_dtype, d_model), ("embed", "heads", "head_dim"))
        self.wk_dkh = param(normal(rngs, kv_shape, param_dtype, d_model), ("embed", "kv_heads", "head_dim"))
        self.wv_dkh = param(normal(rngs, kv_shape, param_dtype, d_model), ("embed", "kv_heads", "head_dim"))
        self.wo_nhd = param(normal(rngs, (n_heads, head_dim, d_model), param_dtype, n_heads * head_dim),
                            ("heads", "head_dim", "embed"))
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps, param_dtype=param_dtype, names=("head_dim",))
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps, param_dtype=param_dtype, names=("head_dim",))

    def project(self, x_btd, cos_btr, sin_btr):
        """q, k (normed, then partially rotated), v and the gate logits; a KV cache stores this k, v."""
        dt = self.dtype
        q_btnh = jnp.einsum("btd,dnh->btnh", x_btd, self.wq_dnh[...].astype(dt))
        gate_btnh = jnp.einsum("btd,dnh->btnh", x_btd, self.wgate_dnh[...].astype(dt))
        k_btkh = jnp.einsum("btd,dkh->btkh", x_btd, self.wk_dkh[...].astype(dt))
        v_btkh = jnp.einsum("btd,dkh->btkh", x_btd, self.wv_dkh[...].astype(dt))
        q_btnh = constrain(q_btnh, ("batch", "length", "act_heads", None))
        gate_btnh = constrain(gate_btnh, ("batch", "length", "act_heads", None))
        q_btnh = apply_partial_rope(self.q_norm(q_btnh), cos_btr, sin_btr)
        k_btkh = apply_partial_rope(self.k_norm(k_btkh), cos_btr, sin_btr)
        return q_btnh, k_btkh, v_btkh, gate_btnh

    def project_out(self, out_btnh, gate_btnh):
        out_btnh = constrain(out_btnh * jax.nn.sigmoid(gate_btnh), ("batch", "length", "act_heads", None))
        y_btd = jnp.einsum("btnh,nhd->btd", out_btnh, self.wo_nhd[...].astype(self.dtype))
        return constrain(y_btd, ("batch", "length", "act_embed"))

    def __call__(self, x_btd, cos_btr, sin_btr, mask: AttentionMask, *, return_kv: bool = False):
        q_btnh, k_btkh, v_btkh, gate_btnh = self.project(x_btd, cos_btr, sin_btr)
        out_btnh = causal_attention(q_btnh, k_btkh, v_btkh, mask, self.head_dim ** -0.5, self.impl)
        y_btd = self.project_out(out_btnh, gate_btnh)
        return (y_btd, (k_btkh, v_btkh)) if return_kv else y_btd

    def decode(self, x_bnd, cos_bnr, sin_bnr, k_cache_bskh, v_cache_bskh, write_b, kv_lengths_b):
        """N new tokens per row against a static-size KV cache, as ``layers.Attention.decode``:
        written at ``write_b``, token ``i`` sees keys ``[0, kv_lengths_b + i)``. Returns
        ``(y_bnd, k_bnkh, v_bnkh)`` and the updated caches are the caller's to keep."""
        q_bnnh, k_bnkh, v_bnkh, gate_bnnh = self.project(x_bnd, cos_bnr, sin_bnr)
        write = jax.vmap(lambda c_skh, u_nkh, i: jax.lax.dynamic_update_slice_in_dim(c_skh, u_nkh, i, 0))
        k_bskh = write(k_cache_bskh, k_bnkh.astype(k_cache_bskh.dtype), write_b).astype(q_bnnh.dtype)
        v_bskh = write(v_cache_bskh, v_bnkh.astype(v_cache_bskh.dtype), write_b).astype(q_bnnh.dtype)
        n, s = x_bnd.shape[1], k_bskh.shape[1]
        scale = self.head_dim ** -0.5
        seen_bn = kv_lengths_b[:, None] + jnp.arange(n)[None, :]
        valid_bns = jnp.arange(s)[None, None, :] < seen_bn[:, :, None]
        if self.impl == "blocked" or (self.impl == "auto" and jax.default_backend() == "cpu"):
            out = attention_cpu.masked_attention(q_bnnh, k_bskh, v_bskh, valid_bns, scale)
        elif n == 1:
            out = jax.nn.dot_product_attention(q_bnnh, k_bskh, v_bskh, key_value_seq_lengths=kv_lengths_b,
                                               scale=scale)
        else:
            out = jax.nn.dot_product_attention(q_bnnh, k_bskh, v_bskh, mask=valid_bns[:, None], scale=scale)
        return self.project_out(out, gate_bnnh), k_bnkh, v_bnkh
