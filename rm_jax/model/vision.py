"""Qwen3-VL vision tower: patch embedding, interpolated learned positions, ViT blocks with 2-D
rotary, spatial patch merger and the deepstack mergers.

Design choices:

* **Everything that depends on ``grid_thw`` is computed in numpy outside jit** (``vision_inputs``):
  bilinear interpolation taps/weights of the learned position table, the (h, w) rotary positions,
  and the frame-slot layout used by attention (below). The jitted tower then sees only arrays
  whose shapes depend on the patch budget, the number of frames and the frame capacity, so two
  batches with different image sizes but the same budgets share one compilation.
* **Conv3d with stride == kernel is a matmul** on the processor's flattened patches
  ([N, C*T*P*P], channel-major like the Conv3d weight), so the patch embedding is one
  ``[N, C*T*P*P] @ [C*T*P*P, D]``.
* **Per-frame attention in frame slots.** transformers attends within each frame (its
  ``cu_seqlens``). A block mask over all N patches of a batch costs N^2 (4096 patches: 16M logits
  per head, ~all masked). Instead q/k/v are gathered into ``[F, P]`` slots (F frames, P = the
  frame capacity, a static budget) and attend with per-slot key lengths -- F*P^2, no materialized
  mask, and cuDNN-flash eligible on GPU -- then are gathered back to the flat patch order. All
  the other tower ops are per patch and stay on the flat ``[N, D]`` rows.
* **Patch order.** The processor emits patches in spatial-merge-block order (each 2x2 block of
  neighbours is contiguous), so the merger is a reshape of 4 consecutive rows, and the rotary and
  position-table indices are generated in that same order (``_block_order_rows_cols``).
* **Deepstack**: the outputs of blocks ``deepstack_visual_indexes`` go through their own mergers
  (norm after the 2x2 shuffle) and are added to the first decoder layers' hidden states at image
  positions (``qwen3_vl_moe/model.py``). The blocks are scanned in runs that end at those indexes.
* **Activations**: ``gelu_pytorch_tanh`` in the blocks (``approximate=True``), exact GELU in the
  mergers (``nn.GELU()``), LayerNorm eps 1e-6, rotary applied in fp32 -- all as transformers.
"""

from __future__ import annotations


import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rm_jax.model.vision_config import VisionConfig
from rm_jax.model.layer_stack import LayerStack
from rm_jax.model.layers import (LayerNorm, key_length_attention, normal, param, rope_inv_freq,
                                 rotate_half)
from rm_jax.sharding import constrain


# ---------------------------------------------------------------------------------------------
# grid_thw -> index arrays (numpy, outside jit)
# ---------------------------------------------------------------------------------------------

@flax.struct.dataclass
class VisionInputs:
    pixel_values_nf: jax.Array      # [N, C*T*P*P] flattened patches, processor order
    interp_idx_n4: jax.Array        # [N, 4] int32 taps into the learned position table
    interp_w_n4: jax.Array          # [N, 4] fp32 bilinear weights
    rope_pos_n2: jax.Array          # [N, 2] int32 (row, col) of each patch in its image
    frame_rows_fp: jax.Array        # [F, P] int32: flat row of each frame slot's patches (0 past its end)
    frame_len_f: jax.Array          # [F] int32: patches in each frame (>= 1: padding slots hold one)
    row_slot_n: jax.Array           # [N] int32: f * P + p of each flat row (padding rows: 0, never read)


def _block_order_rows_cols(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch of one h x w frame in spatial-merge-block order."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return rows, cols


def _bilinear_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """align_corners=True bilinear taps (floor, floor+1) and weights, fp32 like transformers."""
    index = index.astype(np.float32)
    src = index * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    dist = np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32))
    return taps, np.clip(1 - dist, 0, None).astype(np.float32)


def frame_capacity_bucket(largest_frame: int, minimum: int = 64) -> int:
    """The frame capacity when no static one is given: a power of two (few compiles)."""
    return max(minimum, 1 << max(int(largest_frame) - 1, 0).bit_length())


def vision_inputs(cfg: VisionConfig, pixel_values, grid_thw, frame_capacity: int | None = None) -> VisionInputs:
    """Index arrays for the tower. Rows of `pixel_values` beyond sum(t*h*w) are padding (static
    batch shapes in training); their features are never gathered. Zero rows of `grid_thw` are
    padding images: each still gets one (empty) frame slot, so the slot count is static when the
    grid rows are. ``frame_capacity`` is P, the patches one frame slot holds; None picks a power
    of two that fits the largest frame (interactive use), a trainer passes its static budget."""
    grid_thw = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    pixel_values = np.asarray(pixel_values) if not isinstance(pixel_values, jax.Array) else pixel_values
    m, side = cfg.spatial_merge_size, int(cfg.num_position_embeddings ** 0.5)
    n_expected = int(np.sum(np.prod(grid_thw, axis=-1)))
    n_rows = int(pixel_values.shape[0])
    if pixel_values.ndim != 2 or pixel_values.shape[1] != cfg.patch_dim or n_rows < n_expected \
            or (n_rows - n_expected) % (m * m):
        raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)} but image_grid_thw "
                         f"{grid_thw.tolist()} needs ({n_expected}, {cfg.patch_dim}) "
                         "(= sum(t*h*w), in_channels*temporal_patch_size*patch_size**2), optionally "
                         f"followed by padding rows in multiples of spatial_merge_size**2={m * m}")
    idx, wts, pos, frame_len = [], [], [], []
    for t, h, w in grid_thw.tolist():
        if t * h * w == 0:
            frame_len.append(0)
            continue
        if h % m or w % m:
            raise ValueError(f"image grid {(t, h, w)} is not divisible by spatial_merge_size={m}")
        rows, cols = _block_order_rows_cols(h, w, m)
        h_taps, h_w = _bilinear_taps(rows, h, side)
        w_taps, w_w = _bilinear_taps(cols, w, side)
        frame_idx = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        frame_w = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
        for _ in range(t):
            idx.append(frame_idx)
            wts.append(frame_w)
            pos.append(np.stack([rows, cols], -1))
            frame_len.append(h * w)
    pad = n_rows - n_expected
    idx.append(np.zeros((pad, 4), np.int64))
    wts.append(np.zeros((pad, 4), np.float32))
    pos.append(np.zeros((pad, 2), np.int64))
    rows_fp, len_f, slot_n = frame_slots(np.asarray(frame_len, np.int64), n_rows, frame_capacity)
    return VisionInputs(pixel_values_nf=pixel_values,
                        interp_idx_n4=np.concatenate(idx).astype(np.int32),
                        interp_w_n4=np.concatenate(wts).astype(np.float32),
                        rope_pos_n2=np.concatenate(pos).astype(np.int32),
                        frame_rows_fp=rows_fp, frame_len_f=len_f, row_slot_n=slot_n)


def frame_slots(frame_len_f: np.ndarray, n_rows: int, capacity: int | None):
    """Frames laid out back to back in the flat rows -> (rows [F, P], lengths [F], slot of each row [N])."""
    largest = int(frame_len_f.max(initial=1))
    p = frame_capacity_bucket(largest) if capacity is None else int(capacity)
    if largest > p:
        raise ValueError(f"an image frame has {largest} patches, more than the frame capacity {p} "
                         "(the image pixel budget: data.image.max_pixels / patch_size**2)")
    n_frames = max(len(frame_len_f), 1)
    starts_f = np.concatenate([[0], np.cumsum(frame_len_f)[:-1]]) if len(frame_len_f) else np.zeros(1, np.int64)
    lens_f = np.zeros(n_frames, np.int64)
    lens_f[:len(frame_len_f)] = frame_len_f
    offset_p = np.arange(p)
    rows_fp = np.where(offset_p[None, :] < lens_f[:, None], starts_f[:, None] + offset_p[None, :], 0)
    slot_n = np.zeros(n_rows, np.int64)
    for f, (start, length) in enumerate(zip(starts_f.tolist(), lens_f.tolist())):
        slot_n[start:start + length] = f * p + np.arange(length)
    return rows_fp.astype(np.int32), np.maximum(lens_f, 1).astype(np.int32), slot_n.astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------

class Dense(nnx.Module):
    """x @ W + b with logical names for W's two axes."""

    def __init__(self, d_in: int, d_out: int, names, *, rngs, dtype, param_dtype):
        self.dtype = dtype
        self.w = param(normal(rngs, (d_in, d_out), param_dtype, d_in), names)
        self.b = param(jnp.zeros((d_out,), param_dtype), names[1:])

    def __call__(self, x):
        return x @ self.w[...].astype(self.dtype) + self.b[...].astype(self.dtype)


def vision_rope_cos_sin(pos_n2, head_dim: int, theta: float):
    """Axial 2-D rotary: the same head_dim/4 frequencies for rows then cols, repeated twice."""
    inv_freq = jnp.asarray(rope_inv_freq(head_dim // 2, theta))
    freqs_n2f = pos_n2.astype(jnp.float32)[..., None] * inv_freq
    freqs_nf = jnp.concatenate([freqs_n2f[:, 0], freqs_n2f[:, 1]], axis=-1)
    emb_nd = jnp.concatenate([freqs_nf, freqs_nf], axis=-1)
    return jnp.cos(emb_nd), jnp.sin(emb_nd)


class VisionAttention(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, rngs, dtype, param_dtype, impl: str = "auto"):
        self.impl = impl
        d, n, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.dtype, self.head_dim = dtype, hd
        for name in ("q", "k", "v"):
            setattr(self, f"w{name}_dnh", param(normal(rngs, (d, n, hd), param_dtype, d),
                                                ("vis_embed", "vis_heads", "head_dim")))
            setattr(self, f"b{name}_nh", param(jnp.zeros((n, hd), param_dtype), ("vis_heads", "head_dim")))
        self.wo_nhd = param(normal(rngs, (n, hd, d), param_dtype, d), ("vis_heads", "head_dim", "vis_embed"))
        self.bo_d = param(jnp.zeros((d,), param_dtype), ("vis_embed",))

    def __call__(self, x_nd, cos_nd, sin_nd, vin: VisionInputs):
        dt = self.dtype

        def proj(w, b):
            return jnp.einsum("nd,dkh->nkh", x_nd, w[...].astype(dt)) + b[...].astype(dt)

        q_nkh, k_nkh, v_nkh = (proj(self.wq_dnh, self.bq_nh), proj(self.wk_dnh, self.bk_nh),
                               proj(self.wv_dnh, self.bv_nh))
        # Rotary in fp32, then back to the activation dtype (transformers does the same).
        cos, sin = cos_nd[:, None, :], sin_nd[:, None, :]
        rot = lambda x: (x.astype(jnp.float32) * cos + rotate_half(x.astype(jnp.float32)) * sin).astype(dt)
        q_nkh, k_nkh = rot(q_nkh), rot(k_nkh)
        to_slots = lambda x_nkh: jnp.take(x_nkh, vin.frame_rows_fp, axis=0)      # [F, P, K, H]
        out_fpkh = key_length_attention(to_slots(q_nkh), to_slots(k_nkh), to_slots(v_nkh), vin.frame_len_f,
                                        self.head_dim ** -0.5, self.impl)
        f, p = vin.frame_rows_fp.shape
        out_nkh = jnp.take(out_fpkh.reshape(f * p, *out_fpkh.shape[2:]), vin.row_slot_n, axis=0)
        return jnp.einsum("nkh,khd->nd", out_nkh, self.wo_nhd[...].astype(dt)) + self.bo_d[...].astype(dt)


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, rngs, dtype, param_dtype, attention: str = "auto"):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.norm1 = LayerNorm(cfg.hidden_size, 1e-6, param_dtype=param_dtype)
        self.norm2 = LayerNorm(cfg.hidden_size, 1e-6, param_dtype=param_dtype)
        self.attn = VisionAttention(cfg, **kw, impl=attention)
        self.fc1 = Dense(cfg.hidden_size, cfg.intermediate_size, ("vis_embed", "vis_mlp"), **kw)
        self.fc2 = Dense(cfg.intermediate_size, cfg.hidden_size, ("vis_mlp", "vis_embed"), **kw)

    def __call__(self, x_nd, cos_nd, sin_nd, vin: VisionInputs):
        x_nd = x_nd + self.attn(self.norm1(x_nd), cos_nd, sin_nd, vin)
        return x_nd + self.fc2(jax.nn.gelu(self.fc1(self.norm2(x_nd)), approximate=True))


class PatchMerger(nnx.Module):
    """LayerNorm (before or after the 2x2 shuffle) -> Linear -> GELU -> Linear to the text width."""

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool, *, rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.postshuffle_norm = postshuffle_norm
        self.merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm = LayerNorm(self.merged if postshuffle_norm else cfg.hidden_size, 1e-6,
                              param_dtype=param_dtype)
        self.fc1 = Dense(self.merged, self.merged, (None, "vis_mlp"), **kw)
        self.fc2 = Dense(self.merged, cfg.out_hidden_size, ("vis_mlp", None), **kw)

    def __call__(self, x_nd):
        if self.postshuffle_norm:
            x_md = self.norm(x_nd.reshape(-1, self.merged))
        else:
            x_md = self.norm(x_nd).reshape(-1, self.merged)
        return self.fc2(jax.nn.gelu(self.fc1(x_md), approximate=False))


def vision_segments(cfg: VisionConfig) -> list[tuple[int, int]]:
    """Runs of blocks [start, end) that end right after each deepstack tap."""
    cuts = sorted({i + 1 for i in cfg.deepstack_visual_indexes} | {cfg.depth})
    out, start = [], 0
    for end in cuts:
        if end > start:
            out.append((start, end))
            start = end
    return out


class VisionModel(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32,
                 scan: bool = True, remat: str = "none", attention: str = "auto"):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.cfg, self.dtype, self.scan, self.remat = cfg, dtype, scan, remat
        self.patch_w_pd = param(normal(rngs, (cfg.patch_dim, cfg.hidden_size), param_dtype, cfg.patch_dim),
                                ("patch", "vis_embed"))
        self.patch_b_d = param(jnp.zeros((cfg.hidden_size,), param_dtype), ("vis_embed",))
        self.pos_embed_pd = param(normal(rngs, (cfg.num_position_embeddings, cfg.hidden_size), param_dtype),
                                  (None, "vis_embed"))
        self.segments = tuple(vision_segments(cfg))
        self.blocks = nnx.List([LayerStack(lambda r: VisionBlock(cfg, rngs=r, dtype=dtype, param_dtype=param_dtype,
                                                                       attention=attention),
                                           end - start, rngs=rngs) for start, end in self.segments])
        self.merger = PatchMerger(cfg, False, **kw)
        self.deepstack_mergers = nnx.List([PatchMerger(cfg, True, **kw)
                                           for _ in cfg.deepstack_visual_indexes])

    def __call__(self, vin: VisionInputs) -> tuple[jax.Array, list[jax.Array]]:
        """-> merged image embeddings [N/m^2, D_text] and one deepstack feature per tap."""
        cfg, dt = self.cfg, self.dtype
        x_nd = vin.pixel_values_nf.astype(dt) @ self.patch_w_pd[...].astype(dt) + self.patch_b_d[...].astype(dt)
        pos_n4d = jnp.take(self.pos_embed_pd[...], vin.interp_idx_n4, axis=0)
        x_nd = x_nd + jnp.sum(pos_n4d * vin.interp_w_n4[..., None].astype(pos_n4d.dtype), axis=1).astype(dt)
        x_nd = constrain(x_nd, ("length", "act_embed"))
        cos_nd, sin_nd = vision_rope_cos_sin(vin.rope_pos_n2, cfg.head_dim, cfg.rope_theta)

        def body(block, x, _):
            return block(x, cos_nd, sin_nd, vin), None

        deepstack = []
        for (start, end), stack in zip(self.segments, self.blocks):
            x_nd, _ = stack.apply(body, x_nd, scan=self.scan, remat=self.remat)
            if end - 1 in cfg.deepstack_visual_indexes:
                merger = self.deepstack_mergers[cfg.deepstack_visual_indexes.index(end - 1)]
                deepstack.append(merger(x_nd))
        return self.merger(x_nd), deepstack
