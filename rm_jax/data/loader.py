"""The Grain loader: built shards -> static-shape batches, with a resumable iterator.

* A MapDataset over the split's ArrayRecord shards. Random access makes order a pure function of
  (seed, step): shuffling is per epoch (Grain reseeds each epoch), and the iterator state saved
  beside a checkpoint restores the stream exactly.
* The training stream oversamples failures by index repetition (x3 by default, the factor the
  build recorded); the held-out split is never oversampled or shuffled.
* `group_by_prompt` shuffles prompts instead of records: a prompt's responses (its passes and
  fails, which differ in the value that decides) stay adjacent, so they mostly share a batch.
* Multi-host: the shuffled global stream is cut into global batches, and process p takes rows
  [p * B/P, (p+1) * B/P) of each (index batches of B/P, every P-th one). The processes' slices,
  in process order, are exactly the one-process batch, so a P-process run sees the batches a
  one-process run sees (tests/test_multihost.py). A finite stream (held-out) is padded with
  invalid rows to whole global batches, so every process yields the same number of batches
  (a process that stopped early would hang the others in a collective).
* Static shapes: sequences are padded to the smallest configured length bucket, image patches
  and image rows to powers of two, and a short final eval batch is filled with invalid rows,
  so the jitted step compiles once per bucket, never per batch.
* No tokenization here: records already hold token ids and pixel values.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from typing import Sequence

import grain
import numpy as np

from rm_jax.data import records


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    batch_size: int                       # global batch
    buckets: tuple[int, ...]              # padded sequence lengths, ascending
    seed: int = 0
    shuffle: bool = True
    oversample_fail: int | None = None    # None: the factor recorded by the build (train only)
    group_by_prompt: bool = False         # shuffle prompts, keep each prompt's responses adjacent
    num_epochs: int | None = None         # None: repeat forever
    process_index: int = 0
    process_count: int = 1
    drop_remainder: bool = True
    min_patch_bucket: int = 64
    fixed_patches: int | None = None      # pad patches/images to exactly this (one shape per run)
    fixed_images: int | None = None


def _next_pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


@dataclasses.dataclass(frozen=True)
class ImageLadder:
    """One rung per power of two of image rows, with patches tied to it, for traffic whose batches
    differ (a server): a batch of G images and P patches pads to the lowest rung k with
    G <= 2**k and P <= 2**k * patches_per_image. Padding patches and image rows independently to
    powers of two gives a static shape per (patch rung, image rung) pair, each its own compile;
    the two counts move together, so one ladder of a few rungs covers them."""
    patches_per_image: int          # a multiple of spatial_merge_size**2 (padding rows come in those)
    min_patches: int = 64

    def __post_init__(self):
        if self.patches_per_image <= 0 or self.min_patches <= 0:
            raise ValueError(f"ImageLadder needs positive sizes, got {self}")

    @classmethod
    def for_frame_capacity(cls, frame_capacity: int, merge: int, min_patches: int = 64) -> "ImageLadder":
        """Half the largest image per rung: typical images fill a rung, the largest push one up."""
        unit = merge * merge
        return cls(max(unit, -(-(frame_capacity // 2) // unit) * unit), -(-min_patches // unit) * unit)

    def pad(self, n_patches: int, n_images: int) -> tuple[int, int]:
        """(padded patches, padded image rows) of a batch holding n_patches over n_images."""
        k = max(0, (max(n_images, 1) - 1).bit_length())
        while (1 << k) * self.patches_per_image < n_patches:
            k += 1
        return max(self.min_patches, (1 << k) * self.patches_per_image), 1 << k


def pick_bucket(length: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if length <= b:
            return int(b)
    raise ValueError(f"sequence of {length} tokens exceeds the largest bucket {buckets[-1]}")


class Collate:
    """Pads a list of decoded records into one static-shape batch dict.

    Patches and image rows are padded to powers of two, to exactly `fixed_patches` /
    `fixed_images` when given (training: one shape for the whole run; a batch that exceeds a
    fixed budget raises rather than dropping images), or to a rung of `ladder` (scoring and
    serving: few shapes over batches that differ)."""

    def __init__(self, batch_size: int, buckets: Sequence[int], pad_id: int, patch_dim: int,
                 min_patch_bucket: int = 64, fixed_patches: int | None = None, fixed_images: int | None = None,
                 ladder: ImageLadder | None = None):
        if ladder is not None and (fixed_patches is not None or fixed_images is not None):
            raise ValueError("Collate takes either fixed image budgets or an ImageLadder, not both")
        self.batch_size, self.buckets, self.pad_id = batch_size, tuple(sorted(buckets)), pad_id
        self.patch_dim, self.min_patch_bucket = patch_dim, min_patch_bucket
        self.fixed_patches, self.fixed_images, self.ladder = fixed_patches, fixed_images, ladder

    def _pad_size(self, n: int, fixed: int | None, floor: int, what: str) -> int:
        if fixed is None:
            return _next_pow2(n, floor)
        if n > fixed:
            raise ValueError(f"a batch holds {n} {what} > the fixed budget {fixed}; raise train.max_{what}")
        return fixed

    def __call__(self, items: Sequence[dict]) -> dict[str, np.ndarray]:
        B = self.batch_size
        # (a process's slice of the last held-out batch may hold no example at all)
        L = pick_bucket(max((len(it["input_ids"]) for it in items), default=1), self.buckets)
        input_ids = np.full((B, L), self.pad_id, np.int32)
        attention = np.zeros((B, L), np.int32)
        target = np.zeros((B, L), np.int32)
        scalars = {k: np.zeros((B,), np.int32) for k in ("verdict_pos", "label", "route_tool_call", "has_image")}
        # Shards built before the response span was recorded read as "not found" (-1).
        spans = {k: np.full((B,), -1, np.int32) for k in ("response_start", "response_end")}
        valid = np.zeros((B,), np.int32)
        pixels, grids = [], []
        for i, it in enumerate(items):
            T = len(it["input_ids"])
            input_ids[i, :T] = it["input_ids"]
            attention[i, :T] = 1
            target[i, :T] = it["target_mask"]
            for k in scalars:
                scalars[k][i] = it[k]
            for k in spans:
                spans[k][i] = it.get(k, -1)
            valid[i] = 1
            if len(it["image_grid_thw"]):
                pixels.append(it["pixel_values"])
                grids.append(it["image_grid_thw"])
        P = sum(p.shape[0] for p in pixels)
        G = sum(g.shape[0] for g in grids)
        if self.ladder is not None:
            P_pad, G_pad = self.ladder.pad(P, G)
        else:
            P_pad = self._pad_size(P, self.fixed_patches, self.min_patch_bucket, "patches")
            G_pad = self._pad_size(G, self.fixed_images, 1, "images")
        pixel_values = np.zeros((P_pad, self.patch_dim), pixels[0].dtype if pixels else np.float16)
        if pixels:
            pixel_values[:P] = np.concatenate(pixels)
        grid = np.zeros((G_pad, 3), np.int32)  # zero rows: 0 patches
        if grids:
            grid[:G] = np.concatenate(grids)
        image_valid = (grid.prod(-1) > 0).astype(np.int32)
        return {"input_ids": input_ids, "attention_mask": attention, "target_mask": target,
                "example_valid": valid, "pixel_values": pixel_values, "image_grid_thw": grid,
                "image_valid": image_valid, **scalars, **spans}


def read_manifest(data_dir: str) -> dict:
    with open(os.path.join(data_dir, "manifest.json")) as f:
        return json.load(f)


def stream_indices(labels: np.ndarray, oversample_fail: int) -> np.ndarray:
    """Record indices of one epoch of the stream: each failure repeated `oversample_fail` times."""
    reps = np.where(labels == 1, max(1, oversample_fail), 1)
    return np.repeat(np.arange(len(labels)), reps)


def grouped_epoch(prompts: np.ndarray, stream: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """One epoch of `stream` (record indices) reordered by prompt: the prompts in a permutation
    drawn from (seed, epoch), each prompt's entries together in their stream order."""
    group_of = prompts[stream]
    rank = np.empty(int(prompts.max(initial=-1)) + 1, np.int64)
    rank[np.random.default_rng((seed, epoch)).permutation(len(rank))] = np.arange(len(rank))
    return stream[np.argsort(rank[group_of], kind="stable")]


def _grouped_stream(index: dict, stream: np.ndarray, cfg: LoaderConfig) -> grain.MapDataset:
    if "prompt" not in index:
        raise ValueError("group_by_prompt needs shards whose index numbers the prompts "
                         "(built before that column existed): rebuild them with launch.build_data")
    epoch_len = len(stream)
    epoch = functools.lru_cache(maxsize=2)(lambda e: grouped_epoch(index["prompt"], stream, cfg.seed, e))
    total = sys.maxsize if cfg.num_epochs is None else epoch_len * cfg.num_epochs
    return grain.MapDataset.range(total).map(lambda j: int(epoch(j // epoch_len)[j % epoch_len]))


def make_dataset(data_dir: str, split: str, cfg: LoaderConfig) -> grain.MapDataset:
    """Batches of `split` as a Grain MapDataset (index i = batch i of this process)."""
    manifest = read_manifest(data_dir)
    index = records.load_index(data_dir, split)
    if len(index["label"]) == 0:
        raise ValueError(f"{data_dir}: split '{split}' has no examples")
    if cfg.batch_size % cfg.process_count:
        raise ValueError(f"global batch {cfg.batch_size} is not divisible by process_count {cfg.process_count}")
    factor = cfg.oversample_fail if cfg.oversample_fail is not None else manifest["oversampling"]["factor"]
    idx = stream_indices(index["label"], factor if split == "train" else 1)
    source = grain.sources.ArrayRecordDataSource(records.shard_paths(data_dir, split))
    if cfg.group_by_prompt and cfg.shuffle and split == "train":   # grouping is a way to shuffle
        ds = _grouped_stream(index, idx, cfg)
    else:
        ds = grain.MapDataset.source(idx)
        if cfg.shuffle:
            ds = ds.shuffle(seed=cfg.seed)
        ds = ds.repeat(cfg.num_epochs)
    P, local_batch = cfg.process_count, cfg.batch_size // cfg.process_count
    if P > 1 and cfg.num_epochs is not None:
        # Whole global batches only: truncated (drop_remainder) or padded with -1 (invalid rows).
        n = len(ds)
        total = n - n % cfg.batch_size if cfg.drop_remainder else -(-n // cfg.batch_size) * cfg.batch_size
        stream = ds
        ds = grain.MapDataset.range(total).map(lambda j: stream[j] if j < n else -1)
    # Index batches first (cheap), then each process keeps every P-th one: its contiguous slice.
    ds = ds.batch(local_batch, drop_remainder=cfg.drop_remainder)
    if P > 1:
        ds = ds[cfg.process_index::P]
    collate = Collate(local_batch, cfg.buckets, manifest["pad_id"], int(manifest["patch_dim"]), cfg.min_patch_bucket,
                      cfg.fixed_patches, cfg.fixed_images)
    return ds.map(lambda ids: collate([records.decode(source[int(i)]) for i in ids if i >= 0]))


def make_iterator(ds: grain.MapDataset, state: dict | None = None):
    """A checkpointable iterator (`get_state()` / `set_state()`), optionally restored."""
    it = iter(ds.to_iter_dataset())
    if state is not None:
        it.set_state(state)
    return it
