"""Cached decoding for the hybrid decoder: a KV cache for the attention layers and the
(conv, fp32 recurrent) state for the Gated DeltaNet layers, advanced together.

The functions mirror ``rm_jax.model.decode`` (``prefill_fn`` / ``step_fn`` /
``extend_slot_logits_fn``: same arguments, same right-padding contract) so a decoder loop can
drive either architecture. GDN state is per row, so a shared prefix is prefilled once and its
state rows are gathered for each continuation, exactly like the KV rows.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from rm_jax.model.decode import _head, _last_hidden, _lengths
from rm_jax.model.gated_deltanet import GatedDeltaNetState
from rm_jax.model.interface import JudgeInputs
from rm_jax.model.qwen3_5_moe.model import Qwen35MoeJudge, rope_tables
from rm_jax.sharding import constrain

_CACHE_NAMES = (None, "batch", None, "act_heads", None)


@flax.struct.dataclass
class HybridCache:
    k_lbskh: jax.Array | None          # attention layers' rotated keys (layer order)
    v_lbskh: jax.Array | None
    gdn: GatedDeltaNetState | None     # GDN layers' state [L_gdn, B, ...] (layer order)
    length_b: jax.Array                # tokens held per row = the next KV write slot
    next_pos_b: jax.Array              # MRoPE position (all three axes) of the next token


def prefill_fn(model: Qwen35MoeJudge, inputs: JudgeInputs, cache_len: int) -> tuple[jax.Array, HybridCache]:
    """Prompt forward that fills a ``cache_len``-slot cache; returns last-position logits [B, V]."""
    lengths_b = _lengths(inputs)
    out = model.forward_arrays(inputs, logits=False, return_kv=True)
    logits_bv = _head(model, _last_hidden(out.final_hidden_btd, lengths_b))
    states = out.kv_lbtkh
    k, v = states.k_lbtkh, states.v_lbtkh
    if k is not None:
        t = k.shape[2]
        if cache_len < t:
            raise ValueError(f"cache_len={cache_len} is shorter than the prompt bucket {t}")
        pad = ((0, 0), (0, 0), (0, cache_len - t), (0, 0), (0, 0))
        k, v = (constrain(jnp.pad(a, pad), _CACHE_NAMES) for a in (k, v))
    mask_bt = jnp.asarray(inputs.attention_mask_bt) > 0
    next_pos_b = jnp.max(jnp.where(mask_bt[None], jnp.asarray(inputs.positions_3bt), -1), axis=(0, 2)) + 1
    return logits_bv, HybridCache(k, v, states.gdn, lengths_b, next_pos_b.astype(jnp.int32))


def _per_block(a, n_blocks: int):
    """[L_kind, ...] in layer order -> [n_blocks, L_kind / n_blocks, ...] (the scan's xs)."""
    return None if a is None else a.reshape((n_blocks, -1) + a.shape[1:])


def _new_tokens(model: Qwen35MoeJudge, cache: HybridCache, tokens_bn: jax.Array, valid_bn=None):
    """N new text tokens per row through every layer, from ``cache``.

    Returns the last layer's output ``x_bnd`` and each kind's new state: the new k/v
    [L_attn, B, N, K, Hd] (not yet written) and the GDN states after the valid new tokens."""
    dt = model.dtype
    b, n = tokens_bn.shape
    x_bnd = constrain(jnp.take(model.embed_vd[...], tokens_bn, axis=0).astype(dt), ("batch", "length", "act_embed"))
    pos_bn = cache.next_pos_b[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    cos_bnr, sin_bnr = rope_tables(model.cfg, jnp.broadcast_to(pos_bn[None], (3, b, n)), dt)
    write_b = cache.length_b
    kv_lengths_b = write_b + 1
    n_blocks = model.blocks.n
    xs = (_per_block(cache.k_lbskh, n_blocks), _per_block(cache.v_lbskh, n_blocks),
          None if cache.gdn is None else jax.tree.map(lambda a: _per_block(a, n_blocks), cache.gdn))

    def body(block, x, xs):
        k_cache, v_cache, gdn = xs
        new_kv, new_gdn = [], []
        for layer in block.layers:
            if layer.kind == "full_attention":
                a = len(new_kv)
                x, kv = layer.decode(x, cos_bnr, sin_bnr, (k_cache[a], v_cache[a]), write_b, kv_lengths_b)
                new_kv.append(kv)
            else:
                g = len(new_gdn)
                x, st = layer.decode(x, cos_bnr, sin_bnr, jax.tree.map(lambda s: s[g], gdn), write_b,
                                     kv_lengths_b, valid_bn)
                new_gdn.append(st)
        stack = lambda xs: None if not xs else jax.tree.map(lambda *a: jnp.stack(a), *xs)
        return x, (stack(new_kv), stack(new_gdn))

    x_bnd, (kv, gdn) = model.blocks.apply(body, x_bnd, xs, scan=model.cfg.runtime.scan_layers)
    flat = lambda a: a.reshape((-1,) + a.shape[2:])
    kv = None if kv is None else jax.tree.map(flat, kv)
    gdn = None if gdn is None else jax.tree.map(flat, gdn)
    return x_bnd, kv, gdn


def step_fn(model: Qwen35MoeJudge, cache: HybridCache, token_b: jax.Array) -> tuple[jax.Array, HybridCache]:
    """Append one token per row; logits [B, V] of the new position."""
    x_b1d, kv, gdn = _new_tokens(model, cache, token_b[:, None])
    k, v = cache.k_lbskh, cache.v_lbskh
    if kv is not None:
        b_idx, write_b = jnp.arange(token_b.shape[0]), cache.length_b
        k = constrain(k.at[:, b_idx, write_b].set(kv[0][:, :, 0].astype(k.dtype)), _CACHE_NAMES)
        v = constrain(v.at[:, b_idx, write_b].set(kv[1][:, :, 0].astype(v.dtype)), _CACHE_NAMES)
    logits_bv = _head(model, model.final_norm(x_b1d)[:, 0])
    return logits_bv, HybridCache(k, v, gdn, cache.length_b + 1, cache.next_pos_b + 1)


def cache_rows(cache: HybridCache, rows_b: jax.Array) -> HybridCache:
    """Row ``b`` of the result is row ``rows_b[b]`` of ``cache`` (one shared prefix, many rows)."""
    take = lambda a, axis: None if a is None else jnp.take(a, rows_b, axis=axis)
    return HybridCache(take(cache.k_lbskh, 1), take(cache.v_lbskh, 1),
                       None if cache.gdn is None else jax.tree.map(lambda a: take(a, 1), cache.gdn),
                       take(cache.length_b, 0), take(cache.next_pos_b, 0))


def extend_slot_logits_fn(model: Qwen35MoeJudge, cache: HybridCache, rows_b: jax.Array, tokens_bn: jax.Array,
                          n_b: jax.Array, pass_id: int, fail_id: int):
    """Shared-prefix P(pass): as ``rm_jax.model.decode.extend_slot_logits_fn``; the suffixes'
    right padding is masked out of the GDN states (``valid_bn``)."""
    cache = cache_rows(cache, rows_b)
    valid_bn = jnp.arange(tokens_bn.shape[1])[None, :] < n_b[:, None]
    x_bnd, _, _ = _new_tokens(model, cache, tokens_bn, valid_bn)
    logits_bv = _head(model, model.final_norm(_last_hidden(x_bnd, n_b)))
    return logits_bv[:, pass_id], logits_bv[:, fail_id], jax.nn.logsumexp(logits_bv, axis=-1)
