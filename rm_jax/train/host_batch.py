"""Host batch assembly: loader batches (numpy) -> one ``StepBatch`` of the train step.

What the host adds to the loader's arrays before a step:

* **Token weights** (``weighted_target_mask``): the verdict token's loss weight.
* **Images**: model inputs prepared with a static frame budget; with several processes the
  microbatch's patches are exchanged so the replicated vision arrays are the one-process ones.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rm_jax.data import loader as loader_lib
from rm_jax.data.images import ImageBudget
from rm_jax.model import registry
from rm_jax.model.vision import vision_inputs
from rm_jax.run_config import RunConfig
from rm_jax.train import distributed
from rm_jax.train.step import StepBatch


@dataclasses.dataclass(frozen=True)
class HostBatch:
    batch: StepBatch
    n_examples: int
    n_fail: int           # the oversampling ratio, visible in the stream itself


def frame_capacity(run: RunConfig, mcfg) -> int:
    """Patches per vision frame slot: the image budget's largest image (one static shape)."""
    return ImageBudget.from_config(run.data.image).max_patches(mcfg.vision.patch_size, mcfg.vision.spatial_merge_size)


def weighted_target_mask(b: dict, verdict_weight: float) -> np.ndarray:
    """The loader's 0/1 target mask, with the verdict token weighted (1.0: the plain token mean).
    The verdict is one token of a few dozen in the target; its weight lets the one token the
    reward reads compete with the reason's tokens for the gradient."""
    mask = b["target_mask"]
    if verdict_weight == 1.0:
        return mask
    mask = mask.astype(np.float32)
    rows = np.flatnonzero(b["example_valid"].astype(bool))
    pos = b["verdict_pos"][rows]
    on_target = mask[rows, pos] > 0          # never turns a non-target token into one
    mask[rows[on_target], pos[on_target]] = verdict_weight
    return mask


def assemble(mcfg, micro: list[dict], frame_capacity: int, verdict_weight: float = 1.0) -> HostBatch:
    """Loader batches (numpy) -> one StepBatch with a leading accumulation axis."""
    # The loader right-pads, so attention takes per-row key lengths (cuDNN flash on GPU) instead
    # of a [B, T, T] mask; an all-padding row gets length 1 so its softmax stays finite.
    prepared = [registry.prepare_inputs(mcfg, b["input_ids"], b["attention_mask"], b["pixel_values"],
                                         b["image_grid_thw"], attention="lengths", frame_capacity=frame_capacity)
                for b in micro]
    if jax.process_count() > 1:
        prepared = [_with_global_images(mcfg, p, b, frame_capacity) for p, b in zip(prepared, micro)]
    prepared = [p.replace(kv_lengths_b=np.maximum(p.kv_lengths_b, 1)) for p in prepared]
    top = max(int(b["input_ids"].max(initial=0)) for b in micro)
    if top >= mcfg.text.vocab_size:
        raise ValueError(f"token id {top} >= the model's vocab_size {mcfg.text.vocab_size}: the data was "
                         "tokenized with a larger vocabulary than the model has (train.init_from a checkpoint "
                         "whose vocabulary does not cover the data's tokenizer?)")
    inputs = jax.tree.map(lambda *xs: np.stack(xs), *prepared)
    valid = [b["example_valid"].astype(bool) for b in micro]
    target = np.stack([weighted_target_mask(b, verdict_weight) for b in micro])
    return HostBatch(StepBatch(inputs=inputs, target_mask=target),
                     n_examples=int(sum(v.sum() for v in valid)),
                     n_fail=int(sum((b["label"][v] == 1).sum() for b, v in zip(micro, valid))))


def gather_images(b: dict, merge: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Several processes: the microbatch's images over all of them.

    Returns (pixel_values, image_grid_thw) laid out as the one-process collate lays out the
    whole microbatch (every real patch in process order, then padding; real grid rows, then zero
    rows; the same static shapes), and this process's offset into the merged image features
    (those of the processes before it). Only real rows travel (padded to the largest process's
    count, a power of two so the exchange compiles a few times, not per batch)."""
    pix, grid = b["pixel_values"], b["image_grid_thw"]
    n_rows, n_img = int(grid.prod(-1).sum()), int((grid.prod(-1) > 0).sum())
    counts = distributed.allgather_host(np.array([n_rows, n_img], np.int64))
    pad_rows = loader_lib._next_pow2(int(counts[:, 0].max()), 1)
    pad_img = loader_lib._next_pow2(int(counts[:, 1].max()), 1)
    local_pix = np.zeros((pad_rows, pix.shape[1]), pix.dtype)
    local_pix[:n_rows] = pix[:n_rows]
    local_grid = np.zeros((pad_img, 3), grid.dtype)
    local_grid[:n_img] = grid[:n_img]
    all_pix, all_grid = distributed.allgather_host(local_pix), distributed.allgather_host(local_grid)
    total_rows, total_img = int(counts[:, 0].sum()), int(counts[:, 1].sum())
    if total_rows > pix.shape[0] or total_img > grid.shape[0]:
        raise ValueError(f"the microbatch holds {total_rows} patches / {total_img} images over "
                         f"{len(counts)} processes, over the budget train.max_patches={pix.shape[0]} / "
                         f"train.max_images={grid.shape[0]}; raise them")
    out_pix = np.zeros_like(pix)
    out_grid = np.zeros_like(grid)
    out_pix[:total_rows] = np.concatenate([all_pix[p, :n] for p, n in enumerate(counts[:, 0])])
    out_grid[:total_img] = np.concatenate([all_grid[p, :n] for p, n in enumerate(counts[:, 1])])
    offset = int(counts[:jax.process_index(), 0].sum()) // (merge * merge)
    return out_pix, out_grid, offset


def _with_global_images(mcfg, prepared, b: dict, frame_capacity: int):
    """This process's token arrays, with the whole microbatch's (replicated) vision inputs."""
    pix, grid, offset = gather_images(b, mcfg.vision.spatial_merge_size)
    image_index = None
    if prepared.image_index_bt is not None:
        image_index = np.where(prepared.image_index_bt >= 0, prepared.image_index_bt + offset, -1).astype(np.int32)
    return prepared.replace(image_index_bt=image_index, vision=vision_inputs(mcfg.vision, pix, grid, frame_capacity))
