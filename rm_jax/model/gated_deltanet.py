"""Gated DeltaNet (GDN): the linear-attention mixer of Qwen3.5-MoE's ``linear_attention`` layers.

Per value head the layer keeps a matrix state ``S`` [K, V] and, for every token,

    S <- exp(g) * S                      decay (g <= 0 is a log-decay)
    S <- S + k (beta * (v - S^T k))^T    delta rule: write the part of v that S does not predict
    o  = S^T q

with q, k L2-normalised and q scaled by K^-0.5. transformers' ``Qwen3_5MoeGatedDeltaNet`` (and its
``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``) is the reference.

Letters in tensor names:

    B batch          T tokens            D model width (hidden_size)
    G key heads      H value heads (H = G * R, each key head serves R consecutive value heads)
    K key head dim   V value head dim    C conv channels (2*G*K + H*V: q | k | v)
    W conv taps      N chunks            L, M positions inside a chunk (row, column)

Design choices:

* **Two pure kernels over the same math.** ``recurrent_gated_delta_rule`` is the token-by-token
  rule (decode; the test oracle). ``chunk_gated_delta_rule`` is the chunkwise-parallel (WY/UT)
  form for prefill and training: everything inside a chunk is batched matmuls over all chunks at
  once; only the [K, V] state is carried sequentially, by a ``lax.scan`` doing two [L, K]-sized
  matmuls per chunk (``v_n = u_n - w_n S_n``, ``S' = exp(g_last) S_n + kd_n^T v_n``). The
  outputs are read off the emitted start states and ``v_n`` in one batched matmul pair after the
  scan (``o_n = qd_n S_n + P_n v_n``), where transformers does them inside its loop. (Folding the
  scan into one ``M_n S_n`` matmul, ``M_n = exp(g_last) I - kd^T w``, halves the sequential
  matmuls but costs K^2 V per chunk: measured slower forward+backward at K = 64 and much slower
  at K = 128, Qwen3.5's head size.)
* **The UT transform ``(I + A)^-1``** (A strictly lower triangular, per chunk) is matmuls only:
  a Neumann product ``(I - A)(I + A^2)(I + A^4)`` on the 8 x 8 diagonal blocks (nilpotent there),
  then block doubling (``X = (I + A_b)^-1`` per b-block gives the 2b-block inverse
  ``[[X1, 0], [-X2 A21 X1, X2]]``). Its backward is the closed form ``dA = -T^T dT T^T``
  (a ``custom_vjp``), not the transpose of every round. On CPU this beats a row-sequential
  triangular solve; on GPU/TPU it is MXU/tensor-core work.
* **Layout** is chunk-major ``[N, B, heads, L, ...]`` inside the kernel, so the scan slices and
  stacks its leading axis without transposes. On CPU (benchmarks/gdn_vs_hf.py) the elementwise
  work on the [L, L] intra-chunk tensors (decays, masks) is about half the time, the batched
  matmuls most of the rest.
* **State in fp32.** Both kernels compute in fp32 whatever the input dtype (as transformers does)
  and return outputs in the input dtype; the decode state (recurrent and conv) is fp32.
* **Padding never reaches the state.** A per-token ``valid_bt`` mask sets ``g = 0`` and
  ``beta = 0`` at pads, so a pad is the identity on ``S``: the final state of a right-padded row
  is the state after its valid tokens only, in batched prefill and in a continuation from a given
  state (shared-prefix prefill). The module also zeroes pad inputs before the projections (as
  transformers does), and the conv state it returns is the last W-1 inputs ending at each row's
  last valid token, so decoding continues from the right history.
* **Parameter layout = transformers' modules**, one param per HF key (``in_proj_qkv``,
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``conv1d``, ``A_log``, ``dt_bias``, ``norm``,
  ``out_proj``), stored in ``x @ W`` orientation with heads split out where the math needs them;
  ``HF_PARAMS`` lists each with its transform, so a checkpoint key table maps 1:1.
  ``in_proj_qkv`` keeps the fused q|k|v channel axis because the depthwise conv runs over it.
* **Kernel seam.** ``GDN_BACKENDS`` maps a backend name to a function with
  ``chunk_gated_delta_rule``'s signature; ``GatedDeltaNetConfig.backend`` picks one. Today
  ``"xla"`` (the chunked kernel above) and ``"recurrent"`` (the token-by-token oracle). For GPU: tokamax (0.0.17) has no linear-attention op and MaxText's
  Qwen3-Next GDN is plain JAX (an open PR, MaxText #4348, fuses the inter-chunk scan and the
  triangular inversion into Pallas *TPU* kernels). The candidate for our H100/H200 hosts is
  ``jax-linear-attention`` (PyPI, jla-org): Pallas Mosaic GPU forward+backward kernels for Gated
  DeltaNet with grouped heads and initial/final state, Hopper sm_90a only, pinned to JAX 0.11.2.
  Otherwise a Pallas-Triton port of flash-linear-attention's ``chunk_gated_delta_rule`` (the
  Triton kernels transformers dispatches to). Either registers here under a new name; the layer
  zeroes g and beta at pads before the call, so a kernel needs no mask of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rm_jax.model.layers import GatedRMSNorm, normal, param
from rm_jax.sharding import constrain

F32 = jnp.float32
# Size of the UT-transform blocks inverted by a Neumann product before block doubling takes over.
NEUMANN_BLOCK = 8


# ---------------------------------------------------------------------------------------------
# Kernels (pure functions)
# ---------------------------------------------------------------------------------------------

def l2norm(x, eps: float = 1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis (transformers' / FLA's l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q_btgk, k_btgk, v_bthv, g_bth, beta_bth, valid_bt, use_qk_l2norm):
    """fp32, optional L2 norm, q scaled by K^-0.5, pads turned into identity updates
    (g = beta = 0). q and k stay on the G key heads."""
    h, g = v_bthv.shape[2], q_btgk.shape[2]
    if h % g:
        raise ValueError(f"value heads {h} are not a multiple of key heads {g}")
    q, k, v = (x.astype(F32) for x in (q_btgk, k_btgk, v_bthv))
    g_bth, beta_bth = g_bth.astype(F32), beta_bth.astype(F32)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5)
    if valid_bt is not None:
        valid = valid_bt.astype(bool)[:, :, None]
        g_bth, beta_bth = jnp.where(valid, g_bth, 0.0), jnp.where(valid, beta_bth, 0.0)
    return q, k, v, g_bth, beta_bth


def _init_state(initial_state, b, h, dk, dv):
    if initial_state is None:
        return jnp.zeros((b, h, dk, dv), F32)
    return initial_state.astype(F32)


def recurrent_gated_delta_rule(q_btgk, k_btgk, v_bthv, g_bth, beta_bth, *, initial_state=None,
                               output_final_state: bool = False, use_qk_l2norm: bool = False,
                               valid_bt=None):
    """The gated delta rule one token at a time (``lax.scan`` over T).

    ``initial_state`` is [B, H, K, V]. Returns ``(o_bthv, state_bhkv or None)``; ``o`` in q's dtype.
    """
    out_dtype = q_btgk.dtype
    q, k, v, g_bth, beta_bth = _prepare(q_btgk, k_btgk, v_bthv, g_bth, beta_bth, valid_bt, use_qk_l2norm)
    r = v.shape[2] // q.shape[2]
    # Consecutive value heads share a key head (transformers' repeat_interleave).
    q, k = jnp.repeat(q, r, axis=2), jnp.repeat(k, r, axis=2)
    b, _, h, dk = q.shape
    state_bhkv = _init_state(initial_state, b, h, dk, v.shape[-1])

    def step(s_bhkv, xs):
        q_bhk, k_bhk, v_bhv, g_bh, beta_bh = xs
        s_bhkv = s_bhkv * jnp.exp(g_bh)[..., None, None]
        pred_bhv = jnp.einsum("bhkv,bhk->bhv", s_bhkv, k_bhk)
        delta_bhv = (v_bhv - pred_bhv) * beta_bh[..., None]
        s_bhkv = s_bhkv + k_bhk[..., :, None] * delta_bhv[..., None, :]
        return s_bhkv, jnp.einsum("bhkv,bhk->bhv", s_bhkv, q_bhk)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g_bth, beta_bth))
    state_bhkv, o_tbhv = jax.lax.scan(step, state_bhkv, xs)
    o_bthv = jnp.moveaxis(o_tbhv, 0, 1).astype(out_dtype)
    return o_bthv, (state_bhkv if output_final_state else None)


@jax.custom_vjp
def unit_lower_inverse(a_xll):
    """``(I + A)^-1`` for strictly lower-triangular ``A`` [..., L, L] (L a power of two), by block
    doubling: the 2s-block inverse is ``[[X1, 0], [-X2 A21 X1, X2]]`` from its two s-blocks.

    The backward is the closed form ``dA = -(T^T dT T^T)`` on the strict lower triangle (two
    matmuls) rather than the transpose of every doubling round."""
    return _unit_lower_inverse(a_xll)


def _unit_lower_inverse_fwd(a_xll):
    t_xll = _unit_lower_inverse(a_xll)
    return t_xll, t_xll


def _unit_lower_inverse_bwd(t_xll, dt_xll):
    t_t = jnp.swapaxes(t_xll, -1, -2)
    da_xll = -jnp.matmul(t_t, jnp.matmul(dt_xll, t_t))
    l = t_xll.shape[-1]
    return (jnp.where(jnp.asarray(np.tril(np.ones((l, l), bool), -1)), da_xll, 0.0),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def _unit_lower_inverse(a_xll):
    l = a_xll.shape[-1]
    if l & (l - 1):
        raise ValueError(f"chunk size {l} must be a power of two")
    lead = a_xll.shape[:-2]
    # Top-down: the diagonal blocks of each size (levels[s] is [..., L/s, s, s]), each level sliced
    # out of the one above, so no level reads the whole [L, L] matrix again.
    levels = {l: a_xll[..., None, :, :]}
    s = l
    while s > min(l, NEUMANN_BLOCK):
        half = s // 2
        x = levels[s]
        levels[half] = jnp.stack([x[..., :half, :half], x[..., half:, half:]], axis=-3).reshape(
            *lead, l // half, half, half)
        s = half
    # The base blocks by the Neumann product (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: A is
    # nilpotent (A^s = 0 for an s x s strictly lower block), a few s^3 matmuls on all blocks at once.
    s = min(l, NEUMANN_BLOCK)
    a_p = levels[s]
    inv = jnp.eye(s, dtype=a_xll.dtype) - a_p
    power = 2
    while power < s:
        a_p = jnp.matmul(a_p, a_p)
        inv = inv + jnp.matmul(inv, a_p)
        power *= 2
    while s < l:
        n = l // (2 * s)
        a21 = levels[2 * s][..., s:, :s]                             # [..., n, s, s]
        pairs = inv.reshape(*lead, n, 2, s, s)
        x1, x2 = pairs[..., 0, :, :], pairs[..., 1, :, :]
        low = -jnp.matmul(x2, jnp.matmul(a21, x1))
        inv = jnp.concatenate([jnp.concatenate([x1, jnp.zeros_like(x1)], axis=-1),
                               jnp.concatenate([low, x2], axis=-1)], axis=-2)
        s *= 2
    return inv[..., 0, :, :]


def chunk_gated_delta_rule(q_btgk, k_btgk, v_bthv, g_bth, beta_bth, *, chunk_size: int = 64,
                           initial_state=None, output_final_state: bool = False,
                           use_qk_l2norm: bool = False, valid_bt=None):
    """The gated delta rule chunkwise (WY/UT form): same arguments and results as
    ``recurrent_gated_delta_rule``, plus ``chunk_size`` (a power of two)."""
    out_dtype = q_btgk.dtype
    q, k, v, g_bth, beta_bth = _prepare(q_btgk, k_btgk, v_bthv, g_bth, beta_bth, valid_bt, use_qk_l2norm)
    b, t, gh, dk = q.shape
    h, dv = v.shape[2:]
    r = h // gh
    l = chunk_size
    pad = (-t) % l
    if pad:  # zero q/k/v and g = beta = 0: identity updates, like transformers' padding
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g_bth, beta_bth = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g_bth, beta_bth))
    n = (t + pad) // l

    # Chunk-major layout [N, B, heads, L, ...]: the scan slices and stacks its leading axis, so
    # neither its inputs nor the per-chunk start states need a transpose.
    def chunks(x_bt_):  # [B, T, heads, ...] -> [N, B, heads, L, ...]
        x = x_bt_.reshape(b, n, l, *x_bt_.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    def per_value_head(x_nbg_):  # key head g serves value heads g*R .. g*R + R-1
        return jnp.repeat(x_nbg_, r, axis=2) if r > 1 else x_nbg_

    q_nbglk, k_nbglk, v_nbhlv = chunks(q), chunks(k), chunks(v)
    g_nbhl, beta_nbhl = chunks(g_bth), chunks(beta_bth)
    # The Gram matrices depend only on the key head: computed once per key head, then shared.
    kk_nbhlm = per_value_head(jnp.einsum("nbglk,nbgmk->nbglm", k_nbglk, k_nbglk))
    qk_nbhlm = per_value_head(jnp.einsum("nbglk,nbgmk->nbglm", q_nbglk, k_nbglk))
    q_nbhlk, k_nbhlk = per_value_head(q_nbglk), per_value_head(k_nbglk)

    cum_nbhl = jnp.cumsum(g_nbhl, axis=-1)               # log decay from chunk start to l
    causal_lm = jnp.asarray(np.tril(np.ones((l, l), bool)))
    strict_lm = jnp.asarray(np.tril(np.ones((l, l), bool), -1))
    # exp(cum_l - cum_m) for m <= l; masked before exp so the upper triangle cannot overflow.
    diff_nbhlm = cum_nbhl[..., :, None] - cum_nbhl[..., None, :]
    decay_nbhlm = jnp.exp(jnp.where(causal_lm, diff_nbhlm, -jnp.inf))

    a_nbhlm = jnp.where(strict_lm, beta_nbhl[..., :, None] * kk_nbhlm * decay_nbhlm, 0.0)
    p_nbhlm = qk_nbhlm * decay_nbhlm                       # intra-chunk attention (causal)
    t_nbhlm = unit_lower_inverse(a_nbhlm)                  # UT transform (I + A)^-1

    u_nbhlv = jnp.einsum("nbhlm,nbhmv->nbhlv", t_nbhlm, beta_nbhl[..., None] * v_nbhlv)
    w_nbhlk = jnp.einsum("nbhlm,nbhmk->nbhlk", t_nbhlm,
                         (beta_nbhl * jnp.exp(cum_nbhl))[..., None] * k_nbhlk)
    last_nbh = cum_nbhl[..., -1]
    kd_nbhlk = k_nbhlk * jnp.exp(last_nbh[..., None] - cum_nbhl)[..., None]   # decayed to chunk end
    qd_nbhlk = q_nbhlk * jnp.exp(cum_nbhl)[..., None]                          # decayed from chunk start

    state_bhkv = _init_state(initial_state, b, h, dk, dv)
    # The sequential part: S_{n+1} = exp(last_n) S_n + kd_n^T v_n with the delta-corrected values
    # v_n = u_n - w_n S_n. The scan emits each chunk's start state and v_n; outputs are one batched
    # matmul pair after it: o_n = qd_n S_n + P_n v_n.
    decay_nbh = jnp.exp(last_nbh)

    def step(s_bhkv, xs):
        u_bhlv, w_bhlk, kd_bhlk, decay_bh = xs
        vnew_bhlv = u_bhlv - jnp.einsum("bhlk,bhkv->bhlv", w_bhlk, s_bhkv)
        s_next = decay_bh[..., None, None] * s_bhkv + jnp.einsum("bhlk,bhlv->bhkv", kd_bhlk, vnew_bhlv)
        return s_next, (s_bhkv, vnew_bhlv)

    state_bhkv, (starts_nbhkv, vnew_nbhlv) = jax.lax.scan(
        step, state_bhkv, (u_nbhlv, w_nbhlk, kd_nbhlk, decay_nbh))
    o_nbhlv = (jnp.einsum("nbhlk,nbhkv->nbhlv", qd_nbhlk, starts_nbhkv)
               + jnp.einsum("nbhlm,nbhmv->nbhlv", p_nbhlm, vnew_nbhlv))
    o_bthv = jnp.transpose(o_nbhlv, (1, 0, 3, 2, 4)).reshape(b, n * l, h, dv)[:, :t]
    return o_bthv.astype(out_dtype), (state_bhkv if output_final_state else None)


def _recurrent_backend(*args, chunk_size=None, **kwargs):
    del chunk_size
    return recurrent_gated_delta_rule(*args, **kwargs)


# "recurrent" is the token-by-token oracle behind the same signature (tests, tiny decodes).
GDN_BACKENDS: dict[str, Callable] = {"xla": chunk_gated_delta_rule, "recurrent": _recurrent_backend}


def register_backend(name: str, fn: Callable) -> None:
    """Add a chunked kernel (``chunk_gated_delta_rule``'s signature) under ``name``."""
    GDN_BACKENDS[name] = fn


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig:
    """The sizes of one GDN mixer (transformers' ``linear_*`` text-config keys)."""
    hidden_size: int
    num_key_heads: int = 16           # linear_num_key_heads (G)
    num_value_heads: int = 32         # linear_num_value_heads (H)
    key_head_dim: int = 128           # linear_key_head_dim (K)
    value_head_dim: int = 128         # linear_value_head_dim (V)
    conv_kernel: int = 4              # linear_conv_kernel_dim (W)
    eps: float = 1e-6                 # rms_norm_eps (the gated norm)
    chunk_size: int = 64
    backend: str = "xla"              # a key of GDN_BACKENDS

    def __post_init__(self):
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.num_value_heads} is not a multiple of "
                             f"linear_num_key_heads={self.num_key_heads}")
        if self.backend not in GDN_BACKENDS:
            raise ValueError(f"gdn backend={self.backend!r}; expected one of {sorted(GDN_BACKENDS)}")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_hf(cls, text_config, **overrides) -> "GatedDeltaNetConfig":
        """From a transformers text config (object or dict)."""
        get = text_config.get if isinstance(text_config, dict) else lambda k: getattr(text_config, k)
        act = get("hidden_act")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r}: the GDN conv and gate are SiLU only")
        return cls(hidden_size=get("hidden_size"), num_key_heads=get("linear_num_key_heads"),
                   num_value_heads=get("linear_num_value_heads"), key_head_dim=get("linear_key_head_dim"),
                   value_head_dim=get("linear_value_head_dim"), conv_kernel=get("linear_conv_kernel_dim"),
                   eps=get("rms_norm_eps"), **overrides)


@flax.struct.dataclass
class GatedDeltaNetState:
    """What decoding carries per GDN layer: the last W-1 conv inputs and the delta-rule state."""
    conv_bwc: jax.Array           # [B, W-1, C] fp32, oldest first
    recurrent_bhkv: jax.Array     # [B, H, K, V] fp32

    @classmethod
    def zeros(cls, cfg: GatedDeltaNetConfig, batch: int) -> "GatedDeltaNetState":
        return cls(jnp.zeros((batch, cfg.conv_kernel - 1, cfg.conv_dim), F32),
                   jnp.zeros((batch, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim), F32))


# Our param path -> (transformers key under ``...linear_attn.``, HF tensor -> ours). Transposes and
# reshapes only, so each has an exact inverse for export.
HF_PARAMS: dict[str, tuple[str, Callable[[np.ndarray, GatedDeltaNetConfig], np.ndarray]]] = {
    "in_proj_qkv_dc": ("in_proj_qkv.weight", lambda w, c: w.T),                            # [C, D]
    "in_proj_z_dhv": ("in_proj_z.weight",
                      lambda w, c: w.T.reshape(c.hidden_size, c.num_value_heads, c.value_head_dim)),
    "in_proj_b_dh": ("in_proj_b.weight", lambda w, c: w.T),                                # [H, D]
    "in_proj_a_dh": ("in_proj_a.weight", lambda w, c: w.T),                                # [H, D]
    "conv1d_wc": ("conv1d.weight", lambda w, c: w[:, 0, :].T),                             # [C, 1, W]
    "A_log_h": ("A_log", lambda w, c: w),
    "dt_bias_h": ("dt_bias", lambda w, c: w),
    "norm.weight": ("norm.weight", lambda w, c: w),
    "out_proj_hvd": ("out_proj.weight",                                                   # [D, H*V]
                     lambda w, c: w.T.reshape(c.num_value_heads, c.value_head_dim, c.hidden_size)),
}


def load_hf_tensors(layer: "GatedDeltaNet", tensors: dict[str, np.ndarray]) -> None:
    """Fill ``layer`` (possibly abstract, from ``nnx.eval_shape``) from one transformers GDN
    layer's tensors (keys as in ``HF_PARAMS``)."""
    for path, (key, to_ours) in HF_PARAMS.items():
        if key not in tensors:
            raise KeyError(f"GDN tensor {key!r} missing (have {sorted(tensors)})")
        target = layer
        *parents, leaf = path.split(".")
        for name in parents:
            target = getattr(target, name)
        var = getattr(target, leaf)
        value = np.asarray(to_ours(np.asarray(tensors[key]), layer.cfg))
        if value.shape != tuple(var.shape):
            raise ValueError(f"GDN tensor {key!r}: shape {value.shape} after transform, expected {var.shape}")
        var.set_value(jnp.asarray(value, var.dtype))


def causal_conv(x_btc, history_bwc, w_wc):
    """Depthwise causal conv of ``x`` after ``history`` (the W-1 inputs before it), then SiLU, in
    fp32: out[t] = sum_j w[j] * xh[t + j] over xh = history | x (the last tap is the current token)."""
    xh_btc = jnp.concatenate([history_bwc.astype(F32), x_btc.astype(F32)], axis=1)
    t, w = x_btc.shape[1], w_wc.shape[0]
    w32 = w_wc.astype(F32)
    out_btc = sum(xh_btc[:, j:j + t] * w32[j] for j in range(w))
    return jax.nn.silu(out_btc), xh_btc


class GatedDeltaNet(nnx.Module):
    """transformers' ``Qwen3_5MoeGatedDeltaNet``: projections, causal conv + SiLU over q|k|v, the
    gated delta rule, gated RMSNorm with silu(z), ``out_proj``."""

    def __init__(self, cfg: GatedDeltaNetConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        self.cfg, self.dtype = cfg, dtype
        d, c, h, dv = cfg.hidden_size, cfg.conv_dim, cfg.num_value_heads, cfg.value_head_dim
        # q|k|v stay one channel axis: the depthwise conv runs over it, and sharding it over
        # `tensor` would cut q from k and v, so only its model dim is (FSDP) sharded.
        self.in_proj_qkv_dc = param(normal(rngs, (d, c), param_dtype, d), ("embed", None))
        self.in_proj_z_dhv = param(normal(rngs, (d, h, dv), param_dtype, d), ("embed", "heads", "head_dim"))
        self.in_proj_b_dh = param(normal(rngs, (d, h), param_dtype, d), ("embed", "heads"))
        self.in_proj_a_dh = param(normal(rngs, (d, h), param_dtype, d), ("embed", "heads"))
        self.conv1d_wc = param(normal(rngs, (cfg.conv_kernel, c), param_dtype, cfg.conv_kernel), (None, None))
        # transformers' init: A ~ U(0.01, 16) stored as log A, dt_bias = 1.
        a_h = jax.random.uniform(rngs.params(), (h,), F32, 0.01, 16.0)
        self.A_log_h = param(jnp.log(a_h).astype(param_dtype), ("heads",))
        self.dt_bias_h = param(jnp.ones((h,), param_dtype), ("heads",))
        self.norm = GatedRMSNorm(dv, cfg.eps, param_dtype=param_dtype, names=("head_dim",))
        self.out_proj_hvd = param(normal(rngs, (h, dv, d), param_dtype, h * dv), ("heads", "head_dim", "embed"))

    # -- pieces shared by prefill and decode ------------------------------------------------------

    def _project(self, x_btd):
        dt = self.dtype
        qkv_btc = jnp.einsum("btd,dc->btc", x_btd, self.in_proj_qkv_dc[...].astype(dt))
        z_bthv = jnp.einsum("btd,dhv->bthv", x_btd, self.in_proj_z_dhv[...].astype(dt))
        b_bth = jnp.einsum("btd,dh->bth", x_btd, self.in_proj_b_dh[...].astype(dt))
        a_bth = jnp.einsum("btd,dh->bth", x_btd, self.in_proj_a_dh[...].astype(dt))
        beta_bth = jax.nn.sigmoid(b_bth.astype(F32))
        # g = -A * softplus(a + dt_bias) <= 0, in fp32 (A = exp(A_log) overflows bf16 ranges).
        g_bth = -jnp.exp(self.A_log_h[...].astype(F32)) * jax.nn.softplus(
            a_bth.astype(F32) + self.dt_bias_h[...].astype(F32))
        return qkv_btc, z_bthv, g_bth, beta_bth

    def _split(self, conv_btc):
        cfg = self.cfg
        b, t = conv_btc.shape[:2]
        q_btgk = conv_btc[..., :cfg.key_dim].reshape(b, t, cfg.num_key_heads, cfg.key_head_dim)
        k_btgk = conv_btc[..., cfg.key_dim:2 * cfg.key_dim].reshape(b, t, cfg.num_key_heads, cfg.key_head_dim)
        v_bthv = conv_btc[..., 2 * cfg.key_dim:].reshape(b, t, cfg.num_value_heads, cfg.value_head_dim)
        return q_btgk, k_btgk, v_bthv

    def _output(self, core_bthv, z_bthv):
        core_bthv = constrain(core_bthv.astype(self.dtype), ("batch", "length", "act_heads", None))
        y_bthv = self.norm(core_bthv, z_bthv)
        y_btd = jnp.einsum("bthv,hvd->btd", y_bthv, self.out_proj_hvd[...].astype(self.dtype))
        return constrain(y_btd, ("batch", "length", "act_embed"))

    # -- prefill / training -----------------------------------------------------------------------

    def __call__(self, x_btd, *, valid_bt=None, state: GatedDeltaNetState | None = None,
                 return_state: bool = False):
        """Chunked forward over T tokens, optionally continuing from ``state``.

        ``valid_bt`` (bool, e.g. the attention mask) marks real tokens; pads leave the state as it
        was. With ``return_state=True`` returns ``(y_btd, GatedDeltaNetState)``: the state after
        each row's valid tokens (the conv state ends at the row's last valid token)."""
        cfg = self.cfg
        b, t = x_btd.shape[:2]
        if valid_bt is not None:  # transformers zeroes pad inputs: the conv sees zeros there
            x_btd = x_btd * valid_bt[..., None].astype(x_btd.dtype)
        qkv_btc, z_bthv, g_bth, beta_bth = self._project(x_btd)
        if state is None:
            state = GatedDeltaNetState.zeros(cfg, b)
        conv_btc, xh_btc = causal_conv(qkv_btc, state.conv_bwc, self.conv1d_wc[...])
        q_btgk, k_btgk, v_bthv = self._split(conv_btc)
        if valid_bt is not None:  # pads: no decay, no write (done here, so backends need no mask)
            valid_bt1 = valid_bt.astype(bool)[:, :, None]
            g_bth, beta_bth = jnp.where(valid_bt1, g_bth, 0.0), jnp.where(valid_bt1, beta_bth, 0.0)
        core_bthv, rec_bhkv = GDN_BACKENDS[cfg.backend](
            q_btgk, k_btgk, v_bthv, g_bth, beta_bth, chunk_size=cfg.chunk_size,
            initial_state=state.recurrent_bhkv, output_final_state=return_state, use_qk_l2norm=True)
        y_btd = self._output(core_bthv, z_bthv)
        if not return_state:
            return y_btd
        # The W-1 conv inputs that end at each row's last valid token (xh[end : end + W-1]).
        if valid_bt is None:
            end_b = jnp.full((b,), t, jnp.int32)
        else:
            end_b = jnp.max(jnp.where(valid_bt.astype(bool), jnp.arange(1, t + 1), 0), axis=1)
        conv_bwc = jax.vmap(lambda xh_tc, e: jax.lax.dynamic_slice_in_dim(xh_tc, e, cfg.conv_kernel - 1))(
            xh_btc, end_b)
        return y_btd, GatedDeltaNetState(conv_bwc, rec_bhkv)

    # -- decode -----------------------------------------------------------------------------------

    def step(self, x_bd, state: GatedDeltaNetState, *, valid_b=None):
        """One token per row from ``state`` (the recurrent form). Rows with ``valid_b`` False keep
        their state. Returns ``(y_bd, GatedDeltaNetState)``."""
        x_b1d = x_bd[:, None]
        qkv_b1c, z_b1hv, g_b1h, beta_b1h = self._project(x_b1d)
        conv_b1c, xh_bwc = causal_conv(qkv_b1c, state.conv_bwc, self.conv1d_wc[...])
        q_b1gk, k_b1gk, v_b1hv = self._split(conv_b1c)
        valid_b1 = None if valid_b is None else valid_b[:, None]
        core_b1hv, rec_bhkv = recurrent_gated_delta_rule(
            q_b1gk, k_b1gk, v_b1hv, g_b1h, beta_b1h, initial_state=state.recurrent_bhkv,
            output_final_state=True, use_qk_l2norm=True, valid_bt=valid_b1)
        conv_bwc = xh_bwc[:, 1:]
        if valid_b is not None:
            conv_bwc = jnp.where(valid_b[:, None, None], conv_bwc, state.conv_bwc)
        return self._output(core_b1hv, z_b1hv)[:, 0], GatedDeltaNetState(conv_bwc, rec_bhkv)
