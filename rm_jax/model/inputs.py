"""Processor tensors -> ``JudgeInputs`` (numpy, outside jit), for the Qwen-VL family.

Design choices:

* **Positions follow transformers exactly**: with ``image_grid_thw`` the 3-D positions come from
  the token-type runs of the unpadded tokens (padding gets 0); without it positions are
  ``arange(T)`` on all three axes, whatever the padding (that is what HF does too).
* **Image features are spliced with a gather**, not a boolean-mask scatter: ``image_index_bt``
  holds, for every image token, its row in the concatenated image features (-1 elsewhere), in
  row-major (batch, time) order -- the order of ``masked_scatter``.
* The config needs only ``image_token_id``, ``video_token_id`` and ``vision`` (a
  ``VisionConfig``), which every Qwen-VL architecture's config has.
"""

from __future__ import annotations

import jax
import numpy as np

from rm_jax.model.records import JudgeInputs
from rm_jax.model.vision import vision_inputs


def rope_index(cfg, input_ids_bt: np.ndarray, image_grid_thw: np.ndarray | None,
               attention_mask_bt: np.ndarray | None) -> np.ndarray:
    """3-D MRoPE positions [3, B, T]: transformers' ``get_rope_index`` for images, in numpy."""
    b, t = input_ids_bt.shape
    if image_grid_thw is None:
        return np.broadcast_to(np.arange(t, dtype=np.int32), (3, b, t)).copy()
    m = cfg.vision.spatial_merge_size
    grids = iter(np.asarray(image_grid_thw, np.int64).reshape(-1, 3).tolist())
    positions = np.zeros((3, b, t), np.int64)
    for row in range(b):
        keep = np.ones(t, bool) if attention_mask_bt is None else attention_mask_bt[row].astype(bool)
        is_image = input_ids_bt[row][keep] == cfg.image_token_id
        # Runs of text / image tokens (vectorized: a Python loop per token costs ~0.5 ms a row).
        cuts = np.flatnonzero(is_image[1:] != is_image[:-1]) + 1
        starts, ends = np.r_[0, cuts], np.r_[cuts, len(is_image)]
        row_pos = np.zeros((3, len(is_image)), np.int64)
        pos = 0
        for start, end in zip(starts.tolist(), ends.tolist()):
            n = end - start
            if n == 0:
                continue
            if not is_image[start]:
                row_pos[:, start:end] = np.arange(n) + pos
                pos += n
                continue
            try:
                gt, gh, gw = next(grids)
            except StopIteration:
                raise ValueError("input_ids contain more image-token runs than image_grid_thw rows") from None
            lt, lh, lw = gt, gh // m, gw // m
            if lt * lh * lw != n:
                raise ValueError(f"an image-token run of length {n} in batch row {row} does not match "
                                 f"its grid {(gt, gh, gw)} (expects {lt * lh * lw} tokens)")
            tt, hh, ww = np.meshgrid(np.arange(lt), np.arange(lh), np.arange(lw), indexing="ij")
            row_pos[:, start:end] = np.stack([tt, hh, ww]).reshape(3, -1) + pos
            pos += max(gh, gw) // m
        positions[:, row, keep] = row_pos
    return positions.astype(np.int32)


def _to_numpy(x):
    return None if x is None else np.asarray(jax.device_get(x))


def check_processor_extras(cfg, input_ids, mm_token_type_ids=None, pixel_values_videos=None,
                           video_grid_thw=None) -> None:
    """The processor outputs the judge does not consume: videos are refused; ``mm_token_type_ids``
    (Qwen3-VL processors return it by default) must agree with the types derived from the ids."""
    if pixel_values_videos is not None or video_grid_thw is not None:
        raise ValueError("video inputs (pixel_values_videos / video_grid_thw) are not supported: the judge "
                         "reads images only")
    if mm_token_type_ids is None:
        return
    ids = _to_numpy(input_ids)
    types = _to_numpy(mm_token_type_ids)
    if types.shape != ids.shape:
        raise ValueError(f"mm_token_type_ids has shape {types.shape} but input_ids has {ids.shape}")
    derived = np.where(ids == cfg.image_token_id, 1, np.where(ids == cfg.video_token_id, 2, 0))
    if not np.array_equal(types, derived):
        bad = tuple(int(i) for i in np.argwhere(types != derived)[0])
        raise ValueError(f"mm_token_type_ids disagrees with input_ids at {bad}: type {int(types[bad])}, but the "
                         f"token {int(ids[bad])} gives {int(derived[bad])} (image token id {cfg.image_token_id}, "
                         f"video {cfg.video_token_id}); the processor and the model config name different tokens")


def prepare_inputs(cfg, input_ids, attention_mask=None, pixel_values=None,
                   image_grid_thw=None, *, attention: str = "mask",
                   frame_capacity: int | None = None) -> JudgeInputs:
    """Processor tensors (numpy, jax or torch-converted arrays) -> static-shaped ``JudgeInputs``.

    ``attention`` picks the text-attention masking: "mask" (a [B,1,T,T] causal+padding mask, any
    padding), "lengths" (causal + per-row key lengths; requires right padding; cuDNN-flash
    eligible) or "auto" (lengths when every row is right-padded). It changes the pytree structure
    of the result, so a training loop should pick one value and keep it. ``frame_capacity`` is
    the vision tower's static patches-per-frame budget (``vision.vision_inputs``); a training loop
    passes one so that every batch has the same shapes.
    """
    if attention not in ("mask", "lengths", "auto"):
        raise ValueError(f"attention={attention!r}; expected 'mask', 'lengths' or 'auto'")
    ids = _to_numpy(input_ids).astype(np.int32)
    if ids.ndim == 1:
        ids = ids[None]
    mask = np.ones_like(ids) if attention_mask is None else _to_numpy(attention_mask).astype(np.int32).reshape(ids.shape)
    grid = None if image_grid_thw is None else _to_numpy(image_grid_thw).astype(np.int64).reshape(-1, 3)
    positions = rope_index(cfg, ids, grid, None if attention_mask is None else mask)
    if (pixel_values is None) != (grid is None):
        raise ValueError("pixel_values and image_grid_thw must be given together")
    image_index, vin = None, None
    n_img_tokens = int(np.sum(ids == cfg.image_token_id))
    if grid is not None:
        n_feats = int(np.sum(np.prod(grid, -1))) // cfg.vision.spatial_merge_size ** 2
        if n_img_tokens != n_feats:
            raise ValueError(f"input_ids hold {n_img_tokens} image tokens (id {cfg.image_token_id}) but "
                             f"image_grid_thw {grid.tolist()} gives {n_feats} image features")
        flat = (ids == cfg.image_token_id).reshape(-1)
        image_index = np.where(flat, np.cumsum(flat) - 1, -1).reshape(ids.shape).astype(np.int32)
        pv = pixel_values if isinstance(pixel_values, jax.Array) else _to_numpy(pixel_values)
        vin = vision_inputs(cfg.vision, pv, grid, frame_capacity)
    lengths = mask.sum(-1).astype(np.int32)
    is_prefix = bool(np.all(mask == (np.arange(mask.shape[1])[None, :] < lengths[:, None])))
    if attention == "lengths" and not is_prefix:
        raise ValueError("attention='lengths' needs right padding (each attention_mask row a prefix of ones)")
    use_lengths = attention == "lengths" or (attention == "auto" and is_prefix)
    return JudgeInputs(input_ids_bt=ids, attention_mask_bt=mask, positions_3bt=positions,
                       image_index_bt=image_index, kv_lengths_b=lengths if use_lengths else None, vision=vin)
