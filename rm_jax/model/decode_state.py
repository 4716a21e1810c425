"""How the decode state grows: built from a prompt forward, rows taken for a shared prefix, new
tokens written. The records themselves (``DecodeState``, ``KVState``, ``NewTokenState``) are in
``rm_jax.model.records``.

Design choices:

* **One record per kind, stacked over the layers of that kind only** (``records``): a KV cache for
  attention layers, a recurrent state for Gated DeltaNet layers (conv history ``[L, B, W-1, C]``
  and the fp32 delta-rule state ``[L, B, H, Dk, Dv]``). A layer group finds its slice of its
  kind's stack through ``layer_stack.kind_offsets``.
* **The two kinds grow differently.** Attention appends: each new token's k/v is written at the
  row's next slot (``length_b``), and the key-length mask hides what lies beyond. A recurrent
  state is replaced: the model returns the state after the new tokens (pads leave it as it was),
  which costs the same whatever the prompt length.
* **Right padding.** Row ``b``'s prompt holds slots ``[0, length_b)``; ``next_pos_b`` is the
  MRoPE position of its next token (not ``length_b`` when the prompt has images).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rm_jax.model.records import DecodeState, JudgeOutput, KVState, NewTokenState
from rm_jax.sharding import constrain

_CACHE_NAMES = (None, "batch", None, "act_heads", None)


def from_prefill(out: JudgeOutput, cache_len: int, lengths_b: jax.Array, next_pos_b: jax.Array) -> DecodeState:
    """The state after a prompt forward (``forward_arrays(return_kv=True)``), with ``cache_len``
    KV slots per row."""
    kv = None
    if out.kv_lbtkh is not None:
        k_lbtkh, v_lbtkh = out.kv_lbtkh
        t = k_lbtkh.shape[2]
        if cache_len < t:
            raise ValueError(f"cache_len={cache_len} is shorter than the prompt bucket {t}")
        pad = ((0, 0), (0, 0), (0, cache_len - t), (0, 0), (0, 0))
        kv = KVState(constrain(jnp.pad(k_lbtkh, pad), _CACHE_NAMES), constrain(jnp.pad(v_lbtkh, pad), _CACHE_NAMES))
    return DecodeState(kv, out.recurrent, lengths_b, next_pos_b.astype(jnp.int32))


def take_rows(state: DecodeState, rows_b: jax.Array) -> DecodeState:
    """Row ``b`` of the result is row ``rows_b[b]`` of ``state`` (one shared prefix, many rows)."""
    kv = None if state.kv is None else KVState(state.kv.k_lbskh[:, rows_b], state.kv.v_lbskh[:, rows_b])
    rec = None if state.recurrent is None else jax.tree.map(lambda a: a[:, rows_b], state.recurrent)
    return DecodeState(kv, rec, state.length_b[rows_b], state.next_pos_b[rows_b])


def write_one(state: DecodeState, new: NewTokenState) -> DecodeState:
    """Append one token per row (a decode step)."""
    kv = state.kv
    if kv is not None:
        k_lb1kh, v_lb1kh = new.kv
        write_b, b_idx = state.length_b, jnp.arange(state.length_b.shape[0])
        kv = KVState(
            constrain(kv.k_lbskh.at[:, b_idx, write_b].set(k_lb1kh[:, :, 0].astype(kv.k_lbskh.dtype)), _CACHE_NAMES),
            constrain(kv.v_lbskh.at[:, b_idx, write_b].set(v_lb1kh[:, :, 0].astype(kv.v_lbskh.dtype)), _CACHE_NAMES))
    return DecodeState(kv, new.recurrent if state.recurrent is not None else None,
                       state.length_b + 1, state.next_pos_b + 1)


def write_many(state: DecodeState, new: NewTokenState, n_b: jax.Array) -> DecodeState:
    """Append each row's ``n_b`` new tokens (right-padded to N). The k/v of the padding past a
    row's tokens are written too; they lie beyond the new length, so the next step overwrites
    them before any query can see them. The recurrent state already skipped them."""
    kv = state.kv
    if kv is not None:
        write = jax.vmap(jax.vmap(lambda c_skh, u_nkh, i: jax.lax.dynamic_update_slice_in_dim(c_skh, u_nkh, i, 0),
                                  in_axes=(0, 0, 0)), in_axes=(0, 0, None))
        k_lbnkh, v_lbnkh = new.kv
        kv = KVState(constrain(write(kv.k_lbskh, k_lbnkh.astype(kv.k_lbskh.dtype), state.length_b), _CACHE_NAMES),
                     constrain(write(kv.v_lbskh, v_lbnkh.astype(kv.v_lbskh.dtype), state.length_b), _CACHE_NAMES))
    return DecodeState(kv, new.recurrent if state.recurrent is not None else None,
                       state.length_b + n_b, state.next_pos_b + n_b)
