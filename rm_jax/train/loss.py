"""Verdict-JSON cross-entropy: target tokens only, fp32, vocabulary-chunked.

Two memory facts drive this module:

* Only the judge's JSON carries loss, a few dozen tokens after a prompt of thousands. We gather
  the hidden states that predict target tokens into a fixed-size buffer `[B, K, D]`
  (K = `max_target_tokens`, static) before touching the vocabulary, so the LM head runs on
  ~1% of positions instead of all of them.
* Qwen vocabularies are 150k-250k. Even on K positions we never form `[B, K, V]` fp32 logits or a
  one-hot: a `lax.scan` over vocabulary chunks keeps a running log-sum-exp and picks the label
  logit from the chunk that holds it; `jax.checkpoint` on the chunk body makes the backward pass
  recompute each chunk's logits instead of storing them all.

The loss is returned as a *sum* with its token count, so gradient accumulation divides once by
the global token count (a mean of means would weight short targets more).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LossConfig:
    max_target_tokens: int = 128      # K: static per-example target budget
    vocab_chunk: int = 8192


def target_positions(target_mask_bt: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Indices of the positions whose logits predict target tokens, padded to K.

    Token t is a target when target_mask[t] == 1; it is predicted by the logits at t-1.
    Returns (pred_pos_bk, valid_bk)."""
    b, t = target_mask_bt.shape
    is_pred_bt = jnp.concatenate([target_mask_bt[:, 1:], jnp.zeros((b, 1), target_mask_bt.dtype)], axis=1) > 0
    pos_bk = jax.vmap(lambda row: jnp.nonzero(row, size=k, fill_value=0)[0])(is_pred_bt)
    valid_bk = jnp.arange(k)[None, :] < is_pred_bt.sum(1, keepdims=True)
    return pos_bk.astype(jnp.int32), valid_bk


def check_target_budget(target_mask_bt: np.ndarray, k: int) -> None:
    """Host-side guard: a target longer than K would be silently cut by the static gather."""
    longest = int((np.asarray(target_mask_bt) > 0).sum(-1).max(initial=0))
    if longest > k:
        raise ValueError(f"a target has {longest} tokens > train.max_target_tokens={k}; raise it "
                         f"(targets are never truncated)")


def chunked_logsumexp_and_pick(h_nd: jax.Array, w_dv: jax.Array, labels_n: jax.Array,
                               chunk: int) -> tuple[jax.Array, jax.Array]:
    """(logsumexp over V, logit of the label) per row, in fp32, without materializing [N, V]."""
    d, v = w_dv.shape
    n_chunks = -(-v // chunk)
    pad = n_chunks * chunk - v
    w_cdk = jnp.pad(w_dv, ((0, 0), (0, pad))).reshape(d, n_chunks, chunk).transpose(1, 0, 2)
    h32_nd = h_nd.astype(jnp.float32)

    @jax.checkpoint
    def body(carry, xs):
        m_n, s_n, pick_n = carry
        w_dk, c = xs
        logits_nk = jnp.einsum("nd,dk->nk", h32_nd, w_dk.astype(jnp.float32))
        col_k = c * chunk + jnp.arange(chunk)
        logits_nk = jnp.where(col_k[None, :] < v, logits_nk, -jnp.inf)   # vocab padding
        m_new = jnp.maximum(m_n, logits_nk.max(-1))
        s_n = s_n * jnp.exp(m_n - m_new) + jnp.exp(logits_nk - m_new[:, None]).sum(-1)
        local = labels_n - c * chunk
        in_chunk = (local >= 0) & (local < chunk)
        got = jnp.take_along_axis(logits_nk, jnp.clip(local, 0, chunk - 1)[:, None], axis=1)[:, 0]
        pick_n = jnp.where(in_chunk, got, pick_n)
        return (m_new, s_n, pick_n), None

    n = h_nd.shape[0]
    init = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.float32))
    (m_n, s_n, pick_n), _ = jax.lax.scan(body, init, (w_cdk, jnp.arange(n_chunks)))
    return m_n + jnp.log(s_n), pick_n


@dataclasses.dataclass(frozen=True)
class TargetLoss:
    loss_sum: jax.Array        # sum of token NLL over targets (fp32 scalar)
    n_tokens: jax.Array        # number of target tokens (fp32 scalar)


def target_cross_entropy(final_btd: jax.Array, head_dv: jax.Array, input_ids_bt: jax.Array,
                         target_mask_bt: jax.Array, cfg: LossConfig) -> TargetLoss:
    """Token-sum NLL of target tokens given the final (normed) hidden states and the LM head.

    ``target_mask_bt`` is 0 off target and the token's weight on it: 1 everywhere by default (the
    plain token mean); ``train.verdict_weight`` raises the verdict token's. ``n_tokens`` is the
    weight sum, so ``loss_sum / n_tokens`` stays a (weighted) per-token mean."""
    pos_bk, valid_bk = target_positions(target_mask_bt, cfg.max_target_tokens)
    h_bkd = jnp.take_along_axis(final_btd, pos_bk[..., None], axis=1)
    labels_bk = jnp.take_along_axis(input_ids_bt, pos_bk + 1, axis=1, mode="clip")
    b, k, d = h_bkd.shape
    lse_n, pick_n = chunked_logsumexp_and_pick(h_bkd.reshape(b * k, d), head_dv, labels_bk.reshape(-1),
                                               cfg.vocab_chunk)
    weight_bk = jnp.take_along_axis(target_mask_bt.astype(jnp.float32), pos_bk + 1, axis=1, mode="clip")
    weight_n = (weight_bk * valid_bk).reshape(-1)
    return TargetLoss(loss_sum=jnp.sum((lse_n - pick_n) * weight_n), n_tokens=jnp.sum(weight_n))


jax.tree_util.register_dataclass(TargetLoss, data_fields=["loss_sum", "n_tokens"], meta_fields=[])

