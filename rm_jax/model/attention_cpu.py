"""Masked softmax attention for the CPU: normalize after PV, and a hand-written backward.

Why: on CPU, XLA lowers ``jax.nn.dot_product_attention`` as logits -> mask -> softmax -> PV and
autodiff saves the [.., T, S] probabilities. Every extra pass over a [T, S] buffer (the
softmax division, its backward, the layout copies between the two einsums) costs about as
much as a matmul at the tiny judge's head size (16). Profiled on the tiny train step at
[16, 512]: attention was ~60% of the step. This kernel follows the flash-attention recipe:

* forward: ``o = (exp(l - max) @ v) / sum``: the division is on the [T, H] output, not on the
  [T, S] probabilities; it returns the log-sum-exp per query row;
* backward: recompute ``p = exp(l - lse)`` from q, k (nothing [T, S] is saved), then
  ``dv = p^T do``, ``dp = do v^T``, ``ds = p * (dp - rowsum(do * o))``, ``dq = ds k``,
  ``dk = ds^T q``, with masked logits getting no gradient, as with ``jnp.where``.

Numerics equal ``jax.nn.dot_product_attention``'s XLA path to fp32 rounding, gradients included
(tests/test_attention.py). A row with no valid key gets the same forward (a uniform average, as
with its large-negative fill) but the gradient of that average, which jax's path does not give;
the trainer never produces such rows (key lengths and frame lengths are at least 1). GQA is
native: q heads are grouped [K, G] against the K key/value heads. Used on CPU only; GPUs keep
``jax.nn.dot_product_attention`` (cuDNN flash).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# The fill jax.nn.dot_product_attention's XLA path uses for masked logits (a finite value, so a
# row with no valid key averages uniformly instead of producing NaN).
_NEG_FILL = -0.7 * float(jnp.finfo(jnp.float32).max)


def _logits_bkgts(q_btkgh, k_bskh, valid_bts, scale):
    logits = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32) * scale
    return jnp.where(valid_bts[:, None, None], logits, _NEG_FILL)


def _grouped(x_btnh, kv_heads: int):
    b, t, n, h = x_btnh.shape
    return x_btnh.reshape(b, t, kv_heads, n // kv_heads, h)


def _forward(q_btnh, k_bskh, v_bskh, valid_bts, scale):
    q = _grouped(q_btnh, k_bskh.shape[2])
    logits = _logits_bkgts(q, k_bskh, valid_bts, scale)
    max_bkgt1 = jnp.max(logits, axis=-1, keepdims=True)
    p_bkgts = jnp.exp(logits - max_bkgt1)
    sum_bkgt1 = jnp.sum(p_bkgts, axis=-1, keepdims=True)
    o_bkgth = jnp.einsum("bkgts,bskh->bkgth", p_bkgts, v_bskh.astype(jnp.float32))
    o_btkgh = jnp.transpose(o_bkgth / sum_bkgt1, (0, 3, 1, 2, 4))
    lse_bkgt1 = max_bkgt1 + jnp.log(sum_bkgt1)
    return o_btkgh.reshape(q_btnh.shape).astype(q_btnh.dtype), lse_bkgt1


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def masked_attention(q_btnh, k_bskh, v_bskh, valid_bts, scale: float):
    """Softmax attention of q [B, T, N, H] over k, v [B, S, K, H] where ``valid_bts`` (bool,
    broadcastable to [B, T, S]) is True; N must be a multiple of K."""
    return _forward(q_btnh, k_bskh, v_bskh, valid_bts, scale)[0]


def _fwd(q_btnh, k_bskh, v_bskh, valid_bts, scale):
    o_btnh, lse_bkgt1 = _forward(q_btnh, k_bskh, v_bskh, valid_bts, scale)
    return o_btnh, (q_btnh, k_bskh, v_bskh, valid_bts, o_btnh, lse_bkgt1)


def _bwd(scale, res, do_btnh):
    q_btnh, k_bskh, v_bskh, valid_bts, o_btnh, lse_bkgt1 = res
    kv = k_bskh.shape[2]
    q = _grouped(q_btnh, kv)
    do = _grouped(do_btnh, kv).astype(jnp.float32)
    o = _grouped(o_btnh, kv).astype(jnp.float32)
    mask = valid_bts[:, None, None]
    p_bkgts = jnp.exp(_logits_bkgts(q, k_bskh, valid_bts, scale) - lse_bkgt1)
    # dv and dk contract over the query rows (g, t): written as [h, s] = x^T @ p, the [T, S]
    # operand is read in its own layout (contraction-major) and only the small [S, H] result is
    # transposed, instead of a transposed copy of the [T, S] buffer.
    dv_bskh = jnp.transpose(jnp.einsum("btkgh,bkgts->bkhs", do, p_bkgts), (0, 3, 1, 2))
    dp_bkgts = jnp.einsum("btkgh,bskh->bkgts", do, v_bskh.astype(jnp.float32))
    rowdot_bkgt1 = jnp.transpose(jnp.sum(do * o, axis=-1), (0, 2, 3, 1))[..., None]
    ds_bkgts = jnp.where(mask, p_bkgts * (dp_bkgts - rowdot_bkgt1), 0.0) * scale
    dq = jnp.einsum("bkgts,bskh->btkgh", ds_bkgts, k_bskh.astype(jnp.float32))
    dk_bskh = jnp.transpose(jnp.einsum("btkgh,bkgts->bkhs", q.astype(jnp.float32), ds_bkgts), (0, 3, 1, 2))
    return (dq.reshape(q_btnh.shape).astype(q_btnh.dtype), dk_bskh.astype(k_bskh.dtype),
            dv_bskh.astype(v_bskh.dtype), None)


masked_attention.defvjp(_fwd, _bwd)


def key_length_attention(q_btnh, k_bskh, v_bskh, kv_lengths_b, scale: float):
    """Non-causal attention to keys [0, kv_lengths_b) (the vision tower's frame slots)."""
    valid_b1s = (jnp.arange(k_bskh.shape[1])[None, :] < kv_lengths_b[:, None])[:, None, :]
    return masked_attention(q_btnh, k_bskh, v_bskh, valid_b1s, scale)
