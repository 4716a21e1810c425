"""Building blocks shared by the text decoders: params, norms, rotary/MRoPE, attention, MLP
(the layer stack is ``rm_jax.model.layer_stack``).

Design choices:

* **Params carry logical axis names** (``out_sharding`` metadata, mapped by ``rm_jax.sharding``'s
  one rules table). Modules are built without a mesh (``eager_sharding=False``); ``convert.load_hf``
  places every array with the sharding its names ask for, so model code never mentions mesh axes.
* **Weights are stored in ``x @ W`` orientation with heads split out** (``wq_dnh`` = [D, N, Hd]):
  no reshapes in the hot path, and the head axis is directly shardable over ``tensor``. The HF
  ``[out, in]`` Linear layout is handled once, in the key tables (``<arch>/params.py``).
* **Interleaved MRoPE** follows transformers' ``Qwen3VLMoeTextRotaryEmbedding`` exactly: the
  frequency slot ``j`` of the half head-dim takes its angle from the temporal position, except
  slots ``1, 4, 7, ...`` (< 3*section[1]) take the height position and ``2, 5, 8, ...``
  (< 3*section[2]) the width position. Angles are computed in fp32 and only then cast.
* **Attention is ``jax.nn.dot_product_attention``** (cuDNN flash on GPU, XLA on CPU) with native
  GQA (K heads shared by N/K query heads, no repeat_kv copy). The text mask is causal AND key-valid,
  which is what transformers' ``create_causal_mask`` builds from a padding mask. Right-padded
  batches (the loader's layout) pass key lengths + ``is_causal`` instead of a materialized
  [B, 1, T, T] mask, which keeps cuDNN's flash kernel eligible on GPU.
* **On CPU, attention runs the CPU kernel** (``attention_cpu.masked_attention``: normalization
  after PV, a hand-written backward that recomputes the probabilities) and causal attention is
  also query-blocked (``blocked_causal_attention``): query block i only needs keys [0, end of
  block i], so the masked upper triangle (about half the work) is skipped. Results equal
  ``dot_product_attention`` to fp32 rounding (tests/test_attention.py). ``attention="xla"``
  keeps the library call on CPU too.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from rm_jax.model import attention_cpu
from rm_jax.sharding import LOGICAL_RULES, constrain

Names = Sequence[str | None]


def param(value: jax.Array, names: Names) -> nnx.Param:
    """A Param with logical axis names; never eagerly sharded (placement happens at load)."""
    assert len(names) == value.ndim, (names, value.shape)
    return nnx.Param(value, out_sharding=tuple(names), sharding_rules=LOGICAL_RULES,
                     eager_sharding=False)


def normal(rngs: nnx.Rngs, shape, dtype, fan_in: int | None = None) -> jax.Array:
    # Random init only matters for tests/benchmarks built from scratch; real runs load weights.
    std = 0.02 if fan_in is None else fan_in ** -0.5
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def as_dtype(name_or_dtype) -> jnp.dtype:
    return jnp.dtype(name_or_dtype)


# ---------------------------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------------------------

class RMSNorm(nnx.Module):
    """T5/Qwen RMSNorm: normalize in fp32, cast back, then scale (the HF order of operations)."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32, names: Names = ("norm",)):
        self.eps = eps
        self.weight = param(jnp.ones((dim,), param_dtype), names)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        y = (x32 * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return self.weight[...].astype(x.dtype) * y


class LayerNorm(nnx.Module):
    """torch.nn.LayerNorm(eps) with affine weight and bias, statistics in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6, *, param_dtype=jnp.float32, names: Names = ("norm",)):
        self.eps = eps
        self.weight = param(jnp.ones((dim,), param_dtype), names)
        self.bias = param(jnp.zeros((dim,), param_dtype), names)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Rotary embeddings
# ---------------------------------------------------------------------------------------------

def rope_inv_freq(dim: int, theta: float) -> np.ndarray:
    """1 / theta^(2i/dim) for i < dim/2, computed in fp32 like transformers."""
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)


def mrope_slot_axis(head_dim: int, mrope_section: Sequence[int]) -> np.ndarray:
    """For each of the head_dim/2 frequency slots, which position axis (0=t, 1=h, 2=w) drives it."""
    axis = np.zeros(head_dim // 2, np.int32)
    for dim, offset in ((1, 1), (2, 2)):
        axis[offset:mrope_section[dim] * 3:3] = dim
    return axis


def mrope_cos_sin(pos_3bt: jax.Array, head_dim: int, theta: float, mrope_section: Sequence[int],
                  dtype) -> tuple[jax.Array, jax.Array]:
    """Interleaved MRoPE tables [B, T, head_dim] from 3-D positions [3, B, T]."""
    inv_freq_f = jnp.asarray(rope_inv_freq(head_dim, theta))
    slot_axis_f = mrope_slot_axis(head_dim, mrope_section)
    # Pick each slot's position axis first, then one multiply: identical to computing all three
    # angle tables and overwriting slots, at a third of the cost.
    pos_btf = jnp.moveaxis(pos_3bt.astype(jnp.float32)[slot_axis_f], 0, -1)  # [B, T, F]
    freqs_btf = pos_btf * inv_freq_f
    # The table is [f, f]: take cos/sin of one half and repeat it (XLA's CPU cos/sin are costly
    # enough that the duplicate half was ~4% of the tiny forward).
    cos_btf, sin_btf = jnp.cos(freqs_btf), jnp.sin(freqs_btf)
    double = lambda x_btf: jnp.concatenate([x_btf, x_btf], axis=-1).astype(dtype)
    return double(cos_btf), double(sin_btf)


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x_bthd, cos_btd, sin_btd):
    """x * cos + rotate_half(x) * sin, broadcast over the head axis."""
    cos, sin = cos_btd[:, :, None, :], sin_btd[:, :, None, :]
    return x_bthd * cos + rotate_half(x_bthd) * sin


# ---------------------------------------------------------------------------------------------
# Text attention and dense MLP
# ---------------------------------------------------------------------------------------------

@flax.struct.dataclass
class AttentionMask:
    """Causal text attention plus padding: key lengths (right padding) or an explicit mask."""
    kv_lengths_b: jax.Array | None = None    # causal + keys [0, len) valid
    mask_b1ts: jax.Array | None = None       # general padding (e.g. left padding), causal included


ATTENTION_IMPLS = ("auto", "xla", "cudnn", "blocked")
# cuDNN flash attention: half-precision inputs and head dims it has kernels for (multiples of 8
# up to 128 on every cuDNN 9 / sm80+ build jax ships with: 30B-A3B text is 128, its ViT 72; up to
# 256 on Hopper and later, as jax's own flash check admits: Qwen3.5's full attention is 256).
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 128
CUDNN_MAX_HEAD_DIM_SM90 = 256


def cudnn_max_head_dim(compute_capability: str | None) -> int:
    """The largest head_dim cuDNN flash attention runs on a GPU of this compute capability ("9.0")."""
    try:
        major = int(str(compute_capability).split(".")[0])
    except ValueError:
        return CUDNN_MAX_HEAD_DIM
    return CUDNN_MAX_HEAD_DIM_SM90 if major >= 9 else CUDNN_MAX_HEAD_DIM


def choose_attention(requested: str, platform: str, dtype, head_dim: int, *,
                     dense_mask: bool = False, compute_capability: str | None = None) -> tuple[str, str]:
    """The attention implementation to run, and why: a pure function of where and on what.

    ``requested`` is ``train.attention``. "auto" gives the CPU kernel ("blocked") on CPU; on a
    CUDA GPU cuDNN flash attention when it is eligible (bf16/fp16, head_dim a multiple of 8 and
    <= 128, or <= 256 on compute capability 9.0+, key lengths rather than a dense [B,1,T,S]
    mask), else XLA's attention, with the reason. An explicit choice is returned as is (cuDNN then
    fails loudly when ineligible, instead of silently running the non-flash path a memory plan
    did not count on)."""
    if requested not in ATTENTION_IMPLS:
        raise ValueError(f"train.attention={requested!r}; expected one of {ATTENTION_IMPLS}")
    if requested != "auto":
        return requested, "requested"
    if platform == "cpu":
        return "blocked", "CPU"
    if platform not in ("gpu", "cuda"):
        return "xla", f"platform {platform!r} has no cuDNN"
    name = jnp.dtype(dtype).name
    if name not in CUDNN_DTYPES:
        return "xla", f"dtype {name} (cuDNN flash needs bfloat16 or float16)"
    max_dim = cudnn_max_head_dim(compute_capability)
    if head_dim % 8 or head_dim > max_dim:
        return "xla", (f"head_dim {head_dim} (cuDNN flash needs a multiple of 8 <= {max_dim} on compute capability "
                       f"{compute_capability or 'unknown'}; <= {CUDNN_MAX_HEAD_DIM_SM90} from 9.0)")
    if dense_mask:
        return "xla", "a dense attention mask (cuDNN flash takes key lengths: right padding)"
    return "cudnn", "eligible"


_LOGGED_CHOICES: set = set()


def _resolve_attention(requested: str, q, dense_mask: bool) -> str:
    platform = jax.default_backend()
    capability = getattr(jax.devices()[0], "compute_capability", None) if platform in ("gpu", "cuda") else None
    impl, why = choose_attention(requested, platform, q.dtype, q.shape[-1], dense_mask=dense_mask,
                                 compute_capability=capability)
    if requested == "auto" and impl == "xla":
        key = (why, q.shape[-1])
        if key not in _LOGGED_CHOICES:      # at trace time, once per reason
            _LOGGED_CHOICES.add(key)
            logging.warning("attention=auto: XLA attention (not cuDNN flash) because of %s", why)
    return impl
# Rows per query block on CPU. The train step is flat over 64-256 (within noise at [16, 512]); the
# forward alone (scoring prefill) is ~10% faster at 64 than 128 at [16, 512]: less causal waste,
# and each block's fused logits/exp/PV kernel works on a cache-sized [64, S] tile.
QUERY_BLOCK = 64


def blocked_causal_attention(q_btnh, k_btkh, v_btkh, mask: AttentionMask, scale: float,
                             block: int = QUERY_BLOCK):
    """Causal attention computed one query block at a time against only the keys it can see,
    each block through the CPU kernel (``attention_cpu.masked_attention``)."""
    t = q_btnh.shape[1]
    outs = []
    for start in range(0, t, block):
        end = min(start + block, t)
        q_pos = np.arange(start, end)[:, None]
        k_pos = np.arange(end)[None, :]
        if mask.mask_b1ts is not None:
            valid_bqs = mask.mask_b1ts[:, 0, start:end, :end]
        else:
            in_len_bs = jnp.arange(end)[None, :] < mask.kv_lengths_b[:, None]
            valid_bqs = jnp.asarray(k_pos <= q_pos)[None] & in_len_bs[:, None, :]
        outs.append(attention_cpu.masked_attention(q_btnh[:, start:end], k_btkh[:, :end], v_btkh[:, :end],
                                                   valid_bqs, scale))
    return jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]


def causal_attention(q_btnh, k_btkh, v_btkh, mask: AttentionMask, scale: float, impl: str = "auto"):
    """Causal + padding self-attention through the chosen implementation (``ATTENTION_IMPLS``)."""
    impl = _resolve_attention(impl, q_btnh, dense_mask=mask.mask_b1ts is not None)
    if impl == "blocked":
        return blocked_causal_attention(q_btnh, k_btkh, v_btkh, mask, scale)
    kw = dict(scale=scale, implementation=None if impl == "xla" else impl)
    if mask.mask_b1ts is not None:
        return jax.nn.dot_product_attention(q_btnh, k_btkh, v_btkh, mask=mask.mask_b1ts, **kw)
    return jax.nn.dot_product_attention(q_btnh, k_btkh, v_btkh, is_causal=True,
                                        key_value_seq_lengths=mask.kv_lengths_b, **kw)


def key_length_attention(q_btnh, k_bskh, v_bskh, kv_lengths_b, scale: float, impl: str = "auto"):
    """Non-causal attention to keys [0, kv_lengths_b) (the vision tower's frame slots)."""
    impl = _resolve_attention(impl, q_btnh, dense_mask=False)
    if impl == "blocked":
        return attention_cpu.key_length_attention(q_btnh, k_bskh, v_bskh, kv_lengths_b, scale)
    return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, key_value_seq_lengths=kv_lengths_b, scale=scale,
                                        implementation=None if impl == "xla" else impl)


class Attention(nnx.Module):
    """GQA self-attention with per-head q/k RMSNorm before MRoPE (Qwen3)."""

    def __init__(self, d_model: int, n_heads: int, n_kv: int, head_dim: int, eps: float, *,
                 rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32, impl: str = "auto"):
        self.n_heads, self.n_kv, self.head_dim, self.dtype, self.impl = n_heads, n_kv, head_dim, dtype, impl
        self.wq_dnh = param(normal(rngs, (d_model, n_heads, head_dim), param_dtype, d_model),
                            ("embed", "heads", "head_dim"))
        self.wk_dkh = param(normal(rngs, (d_model, n_kv, head_dim), param_dtype, d_model),
                            ("embed", "kv_heads", "head_dim"))
        self.wv_dkh = param(normal(rngs, (d_model, n_kv, head_dim), param_dtype, d_model),
                            ("embed", "kv_heads", "head_dim"))
        self.wo_nhd = param(normal(rngs, (n_heads, head_dim, d_model), param_dtype, n_heads * head_dim),
                            ("heads", "head_dim", "embed"))
        self.q_norm = RMSNorm(head_dim, eps, param_dtype=param_dtype, names=("head_dim",))
        self.k_norm = RMSNorm(head_dim, eps, param_dtype=param_dtype, names=("head_dim",))

    def project_qkv(self, x_btd, cos_btd, sin_btd):
        """q, k (normed, then rotated) and v: what a KV cache stores is exactly this k and v."""
        dt = self.dtype
        q_btnh = jnp.einsum("btd,dnh->btnh", x_btd, self.wq_dnh[...].astype(dt))
        k_btkh = jnp.einsum("btd,dkh->btkh", x_btd, self.wk_dkh[...].astype(dt))
        v_btkh = jnp.einsum("btd,dkh->btkh", x_btd, self.wv_dkh[...].astype(dt))
        q_btnh = constrain(q_btnh, ("batch", "length", "act_heads", None))
        q_btnh = apply_rope(self.q_norm(q_btnh), cos_btd, sin_btd)
        k_btkh = apply_rope(self.k_norm(k_btkh), cos_btd, sin_btd)
        return q_btnh, k_btkh, v_btkh

    def project_out(self, out_btnh):
        out_btnh = constrain(out_btnh, ("batch", "length", "act_heads", None))
        y_btd = jnp.einsum("btnh,nhd->btd", out_btnh, self.wo_nhd[...].astype(self.dtype))
        return constrain(y_btd, ("batch", "length", "act_embed"))

    def __call__(self, x_btd, cos_btd, sin_btd, mask: AttentionMask, *, return_kv: bool = False):
        """``return_kv=True`` also returns ``(k_btkh, v_btkh)`` (a prefill filling a KV cache)."""
        q_btnh, k_btkh, v_btkh = self.project_qkv(x_btd, cos_btd, sin_btd)
        out_btnh = causal_attention(q_btnh, k_btkh, v_btkh, mask, self.head_dim ** -0.5, self.impl)
        y_btd = self.project_out(out_btnh)
        return (y_btd, (k_btkh, v_btkh)) if return_kv else y_btd

    def decode(self, x_bnd, cos_bnd, sin_bnd, k_cache_bskh, v_cache_bskh, write_b, kv_lengths_b):
        """``N >= 1`` new tokens per row against a static-size KV cache (rm_jax.model.decode).

        The new k/v are written at ``write_b`` (per row: right-padded prompts end at different
        places) into this layer's cache slice. New token ``i`` attends to keys
        ``[0, kv_lengths_b + i)``: ``kv_lengths_b`` (= ``write_b + 1``) already excludes the prompt
        padding and the unwritten tail, and the ``+ i`` is causality among the new tokens. One
        token (a decode step) passes key lengths (flash-eligible on GPU); several (a shared-prefix
        extension) pass a [B, 1, N, S] mask. Returns ``(y_bnd, k_bnkh, v_bnkh)``; the caller
        scatters k/v into the full cache (in place under buffer donation) when it keeps it."""
        q_bnnh, k_bnkh, v_bnkh = self.project_qkv(x_bnd, cos_bnd, sin_bnd)
        write = jax.vmap(lambda c_skh, u_nkh, i: jax.lax.dynamic_update_slice_in_dim(c_skh, u_nkh, i, 0))
        k_bskh = write(k_cache_bskh, k_bnkh.astype(k_cache_bskh.dtype), write_b)
        v_bskh = write(v_cache_bskh, v_bnkh.astype(v_cache_bskh.dtype), write_b)
        k_bskh, v_bskh = k_bskh.astype(q_bnnh.dtype), v_bskh.astype(q_bnnh.dtype)
        n, s = x_bnd.shape[1], k_bskh.shape[1]
        scale = self.head_dim ** -0.5
        if n == 1:
            out = jax.nn.dot_product_attention(q_bnnh, k_bskh, v_bskh, key_value_seq_lengths=kv_lengths_b,
                                               scale=scale)
        else:
            seen_bn = kv_lengths_b[:, None] + jnp.arange(n)[None, :]
            valid_bns = jnp.arange(s)[None, None, :] < seen_bn[:, :, None]
            if self.impl == "blocked" or (self.impl == "auto" and jax.default_backend() == "cpu"):
                out = attention_cpu.masked_attention(q_bnnh, k_bskh, v_bskh, valid_bns, scale)
            else:
                out = jax.nn.dot_product_attention(q_bnnh, k_bskh, v_bskh, mask=valid_bns[:, None], scale=scale)
        return self.project_out(out), k_bnkh, v_bnkh


class MLP(nnx.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        self.dtype = dtype
        self.wi_gate_df = param(normal(rngs, (d_model, d_ff), param_dtype, d_model), ("embed", "mlp"))
        self.wi_up_df = param(normal(rngs, (d_model, d_ff), param_dtype, d_model), ("embed", "mlp"))
        self.wo_fd = param(normal(rngs, (d_ff, d_model), param_dtype, d_ff), ("mlp", "embed"))

    def __call__(self, x_btd):
        dt = self.dtype
        gate_btf = jnp.einsum("btd,df->btf", x_btd, self.wi_gate_df[...].astype(dt))
        up_btf = jnp.einsum("btd,df->btf", x_btd, self.wi_up_df[...].astype(dt))
        h_btf = constrain(jax.nn.silu(gate_btf) * up_btf, ("batch", "length", "act_mlp"))
        return constrain(jnp.einsum("btf,fd->btd", h_btf, self.wo_fd[...].astype(dt)),
                         ("batch", "length", "act_embed"))


def causal_padding_mask(attention_mask_bt: jax.Array) -> jax.Array:
    """[B, 1, T, T] bool: query t sees key s iff s <= t and key s is not padding."""
    t = attention_mask_bt.shape[1]
    causal_ts = jnp.tril(jnp.ones((t, t), jnp.bool_))
    return causal_ts[None, None] & attention_mask_bt.astype(jnp.bool_)[:, None, None, :]


# ---------------------------------------------------------------------------------------------
# Qwen3.5 norms
# ---------------------------------------------------------------------------------------------

class ZeroCenteredRMSNorm(nnx.Module):
    """Qwen3.5's RMSNorm: ``x_hat * (1 + w)`` with ``w`` initialised to zero, the product taken in
    fp32 before the cast back (transformers' ``Qwen3_5MoeRMSNorm``; unlike ``RMSNorm``'s order)."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32, names: Names = ("norm",)):
        self.eps = eps
        self.weight = param(jnp.zeros((dim,), param_dtype), names)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        y = x32 * jax.lax.rsqrt(var + self.eps) * (1.0 + self.weight[...].astype(jnp.float32))
        return y.astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """RMSNorm then a SiLU gate: ``(w * norm(x)) * silu(z)`` (transformers' ``...RMSNormGated``).
    The normalised x is cast back before the weight, the gate is applied in fp32."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32, names: Names = ("norm",)):
        self.eps = eps
        self.weight = param(jnp.ones((dim,), param_dtype), names)

    def __call__(self, x, z):
        x32 = x.astype(jnp.float32)
        var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        y = self.weight[...].astype(x.dtype) * (x32 * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
