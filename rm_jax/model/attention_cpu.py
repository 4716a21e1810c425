"""Masked softmax attention for the CPU: normalize after PV, and a hand-written backward.

Why: on CPU, XLA lowers ``jax.nn.dot_product_attention`` as logits -> mask -> softmax -> PV and
autodiff saves the [.., T, S] probabilities. Every extra pass over a [T, S] buffer (the
softmax division, its backward, the layout copies between the two einsums) costs about as
much as a matmul at the tiny judge's head size (16). Profiled on the tiny train step at
[16, 512]: attention was ~60% of the step. This kernel:

* works head-major: q (pre-scaled), k, v are transposed to [B, K, G*T, H] / [B, K, S, H] first
  (small tensors), so each [T, S] einsum writes its natural dot layout; fed [B, T, ...] operands
  XLA wrote the logits S-major and paid a transposing copy of every [T, S] buffer;
* masks with an additive bias (0 or a large negative fill) instead of ``jnp.where``, which made
  XLA materialize the fill broadcast to the full [B, K, G, T, S] and a select in the backward;
* forward: ``o = (exp(l - max) @ v) / sum``: the division is on the [T, H] output, not on the
  [T, S] probabilities;
* backward: reads the saved unnormalized ``p`` (the query-blocked caller keeps each block's
  [T, S] small; recomputing q k^T, the mask and the exp cost more than storing ``p`` on CPU),
  then ``dv = p^T (do / sum)``, ``dp = do v^T``, ``ds = p / sum * (dp - rowsum(do * o))``,
  ``dq = ds k``, ``dk = ds^T q``; masked entries have ``p == 0`` exactly, so they get no
  gradient, as through ``jnp.where``.

Measured on the tiny train step at [4, 512] (benchmarks/train_vs_hf.py): 167 ms -> 121 ms.
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


def _mask_terms(valid_bts):
    """The mask as an additive bias (0 or the fill) and a per-query-row "has a valid key" factor.

    The add of a [B, T, S] bias costs one pass over the logits; a ``jnp.where`` against a scalar
    fill made XLA's CPU backend materialize the fill broadcast to the full [B, K, G, T, S] shape
    plus a select in the backward (~10% of the tiny train step's thread time). exp(l + fill - m) is
    exactly 0 in fp32, so masked entries get no probability and no gradient without a select.
    """
    bias_bts = jnp.where(valid_bts, 0.0, _NEG_FILL).astype(jnp.float32)
    live_bt1 = jnp.any(valid_bts, axis=-1, keepdims=True).astype(jnp.float32)
    return bias_bts[:, None, None], live_bt1[:, None, None]


def _head_major(q_btnh, k_bskh, v_bskh, scale):
    """q (pre-scaled) as [B, K, G*T, H] and k, v as [B, K, S, H]: the [T, S] einsums then
    produce their natural dot layout [B, K, G*T, S]. Fed [B, T, ...] operands, XLA wrote the
    logits S-major and paid a transposing copy of every [T, S] buffer; here only the small
    [T, H] / [S, H] sides are transposed."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    qs = (q_btnh.astype(jnp.float32) * scale).reshape(b, t, kv, n // kv, h)
    q_bkmh = jnp.transpose(qs, (0, 2, 3, 1, 4)).reshape(b, kv, (n // kv) * t, h)
    k_bksh, v_bksh = (jnp.transpose(x.astype(jnp.float32), (0, 2, 1, 3)) for x in (k_bskh, v_bskh))
    return q_bkmh, k_bksh, v_bksh


def _from_head_major(x_bkmh, t: int):
    """[B, K, G*T, H] -> [B, T, K*G, H]."""
    b, kv, m, h = x_bkmh.shape
    x_btkgh = jnp.transpose(x_bkmh.reshape(b, kv, m // t, t, h), (0, 3, 1, 2, 4))
    return x_btkgh.reshape(b, t, kv * (m // t), h)


def _forward(q_btnh, k_bskh, v_bskh, valid_bts, scale):
    """Returns the output [B, T, N, H] and what the backward reads: the head-major q, k, v and
    output, the unnormalized probabilities p = exp(l - max) [B, K, G*T, S], 1 / rowsum(p) and the
    live-row factor ([B, K, G*T, 1] each)."""
    b, t, n, _ = q_btnh.shape
    kv, s = k_bskh.shape[2], k_bskh.shape[1]
    q_bkmh, k_bksh, v_bksh = _head_major(q_btnh, k_bskh, v_bskh, scale)
    m = q_bkmh.shape[2]
    bias_b11ts, live_b11t1 = _mask_terms(valid_bts)
    logits_bkgts = jnp.einsum("bkmh,bksh->bkms", q_bkmh, k_bksh).reshape(b, kv, n // kv, t, s) + bias_b11ts
    max_bkgt1 = jnp.max(logits_bkgts, axis=-1, keepdims=True)
    p_bkms = jnp.exp(logits_bkgts - max_bkgt1).reshape(b, kv, m, s)
    inv_sum_bkm1 = 1.0 / jnp.sum(p_bkms, axis=-1, keepdims=True)
    o_bkmh = jnp.einsum("bkms,bksh->bkmh", p_bkms, v_bksh) * inv_sum_bkm1
    live_bkm1 = jnp.broadcast_to(live_b11t1, (b, kv, n // kv, t, 1)).reshape(b, kv, m, 1)
    o_btnh = _from_head_major(o_bkmh, t).astype(q_btnh.dtype)
    return o_btnh, (q_bkmh, k_bksh, v_bksh, o_bkmh, p_bkms, inv_sum_bkm1, live_bkm1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def masked_attention(q_btnh, k_bskh, v_bskh, valid_bts, scale: float):
    """Softmax attention of q [B, T, N, H] over k, v [B, S, K, H] where ``valid_bts`` (bool,
    broadcastable to [B, T, S]) is True; N must be a multiple of K."""
    return _forward(q_btnh, k_bskh, v_bskh, valid_bts, scale)[0]


def _fwd(q_btnh, k_bskh, v_bskh, valid_bts, scale):
    o_btnh, saved = _forward(q_btnh, k_bskh, v_bskh, valid_bts, scale)
    # Empty arrays carry the input dtypes (residuals must be arrays); q's is the cotangent's.
    return o_btnh, (saved, jnp.zeros((0,), k_bskh.dtype), jnp.zeros((0,), v_bskh.dtype))


def _bwd(scale, res, do_btnh):
    (q_bkmh, k_bksh, v_bksh, o_bkmh, p_bkms, inv_sum_bkm1, live_bkm1), k_like, v_like = res
    q_dt, k_dt, v_dt = do_btnh.dtype, k_like.dtype, v_like.dtype
    b, t, n, h = do_btnh.shape
    kv = k_bksh.shape[1]
    do_bkmh = jnp.transpose(do_btnh.astype(jnp.float32).reshape(b, t, kv, n // kv, h),
                            (0, 2, 3, 1, 4)).reshape(q_bkmh.shape)
    # P = p * inv_sum is never formed: dv = P^T do = p^T (do * inv_sum) scales the small [T, H]
    # side. dv and dk contract over the query rows m: written as [H, S] = x^T @ p, the [T, S]
    # operand is read in its own layout (contraction-major) and only the small [H, S] result is
    # transposed, instead of a transposed copy of the [T, S] buffer.
    dv_bkhs = jnp.einsum("bkmh,bkms->bkhs", do_bkmh * inv_sum_bkm1, p_bkms)
    dp_bkms = jnp.einsum("bkmh,bksh->bkms", do_bkmh, v_bksh)
    rowdot_bkm1 = jnp.sum(do_bkmh * o_bkmh, axis=-1, keepdims=True)
    # Masked entries have p == 0 already; a row with no valid key (uniform p) gets no ds, as
    # through jnp.where. q was pre-scaled, so ds is the gradient of the pre-scaled logits.
    ds_bkms = p_bkms * (dp_bkms - rowdot_bkm1) * (inv_sum_bkm1 * live_bkm1)
    dq_bkmh = jnp.einsum("bkms,bksh->bkmh", ds_bkms, k_bksh) * scale
    dk_bkhs = jnp.einsum("bkmh,bkms->bkhs", q_bkmh, ds_bkms)
    to_bskh = lambda x_bkhs: jnp.transpose(x_bkhs, (0, 3, 1, 2))
    return (_from_head_major(dq_bkmh, t).astype(q_dt), to_bskh(dk_bkhs).astype(k_dt),
            to_bskh(dv_bkhs).astype(v_dt), None)


masked_attention.defvjp(_fwd, _bwd)


def key_length_attention(q_btnh, k_bskh, v_bskh, kv_lengths_b, scale: float):
    """Non-causal attention to keys [0, kv_lengths_b) (the vision tower's frame slots)."""
    valid_b1s = (jnp.arange(k_bskh.shape[1])[None, :] < kv_lengths_b[:, None])[:, None, :]
    return masked_attention(q_btnh, k_bskh, v_bskh, valid_b1s, scale)
