"""Host batch assembly: loader batches (numpy) -> one ``StepBatch`` of the train step.

What the host adds to the loader's arrays before a step:

* **Token weights** (``TokenWeights``): the verdict token's loss weight, and the context LM mask
  (the last prompt tokens before the target).
* **Auxiliary labels**: the swapped-value term (``ValueCheck``, rm_jax.data.value_swap) and the
  seen-token term (``SeenCheck``, rm_jax.data.seen_tokens), at most one of them.
* **Images**: model inputs prepared with a static frame budget; with several processes the
  microbatch's patches are exchanged so the replicated vision arrays are the one-process ones.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rm_jax.data import loader as loader_lib
from rm_jax.data import seen_tokens, value_swap
from rm_jax.data.images import ImageBudget
from rm_jax.model import registry
from rm_jax.model.vision import vision_inputs
from rm_jax.run_config import RunConfig, TrainSection
from rm_jax.train import distributed
from rm_jax.train.step import StepBatch


@dataclasses.dataclass(frozen=True)
class TokenWeights:
    """How the host turns a loader batch's masks into the step's loss weights (train.*)."""
    verdict_weight: float = 1.0
    context_tokens: int = 0             # 0: no context LM term
    context_passing_only: bool = False
    image_token_id: int = -1

    @classmethod
    def from_config(cls, train: TrainSection, mcfg) -> "TokenWeights":
        return cls(verdict_weight=train.verdict_weight,
                   context_tokens=train.context_lm_tokens if train.context_lm_weight else 0,
                   context_passing_only=train.context_lm_passing_only, image_token_id=int(mcfg.image_token_id))


@dataclasses.dataclass(frozen=True)
class ValueCheck:
    """The host side of the swapped-value term (train.value_check_*, rm_jax.data.value_swap): in a
    ``rate`` share of the passing examples one value token is swapped, and the class tokens of
    every passing response are labelled, ``tokens`` at most a row."""
    classes: value_swap.ValueClasses
    rate: float
    tokens: int
    seed: int
    # A swapped value contradicts what the response copied it from, so the swapped example is a
    # failure: with ``fail_id`` its verdict token is trained as fail (the reason and the rest of
    # its target stay dropped: they describe the unswapped response). None: the whole target drops.
    fail_id: int | None = None

    @classmethod
    def from_config(cls, run: RunConfig, manifest: dict) -> "ValueCheck | None":
        t = run.train
        if not t.value_check_weight:
            return None
        rows = manifest.get("value_classes")
        if rows is None:
            raise ValueError(f"train.value_check_weight: the shards in {run.data.dir} record no value classes "
                             "(built before they were); rebuild them with launch.build_data")
        if not rows:
            raise ValueError("train.value_check_weight: the data has no value classes (no tool-call argument "
                             "takes two or more single-token values), so there is nothing to swap")
        fail_id = int(manifest["verdict_tokens"]["fail_id"]) if t.value_check_verdict else None
        return cls(value_swap.ValueClasses.from_json(rows), t.value_check_rate, t.value_check_tokens, run.seed,
                   fail_id)

    def apply(self, b: dict, step: int, micro_index: int) -> tuple[dict, np.ndarray]:
        """A loader batch with its swaps applied (swapped rows lose their target) and its labels."""
        got = value_swap.swap_batch(b, self.classes, self.rate, (self.seed, step, micro_index),
                                    row_offset=jax.process_index() * len(b["label"]), max_positions=self.tokens)
        target = np.where(got.swapped[:, None], 0, b["target_mask"]).astype(b["target_mask"].dtype)
        ids = got.input_ids
        if self.fail_id is not None:
            rows = np.flatnonzero(got.swapped & (b["verdict_pos"] >= 0))
            pos = b["verdict_pos"][rows]
            ids[rows, pos] = self.fail_id
            target[rows, pos] = 1
        return {**b, "input_ids": ids, "target_mask": target}, got.value_target


@dataclasses.dataclass(frozen=True)
class SeenCheck:
    """The host side of the seen-token term (train.seen_check_*, rm_jax.data.seen_tokens): every
    judged response's first ``tokens`` tokens labelled by whether they occur before it."""
    tokens: int
    skip_ids: np.ndarray
    only_ids: np.ndarray | None = None    # the value classes' tokens (train.seen_check_values_only)
    cumulative: bool = False              # train.seen_check_cumulative

    @classmethod
    def from_config(cls, train: TrainSection, manifest: dict) -> "SeenCheck | None":
        if not train.seen_check_weight:
            return None
        special = [manifest.get("pad_id", 0), manifest.get("eos_id", 0), manifest.get("image_pad_id", 0)]
        only = None
        if train.seen_check_values_only:
            rows = manifest.get("value_classes")
            if not rows:
                raise ValueError("train.seen_check_values_only: the shards record no value classes; rebuild them")
            only = np.asarray(sorted({int(x) for c in rows for x in c}), np.int32)
        return cls(train.seen_check_tokens, np.asarray(sorted(set(int(x) for x in special)), np.int32), only,
                   train.seen_check_cumulative)

    def apply(self, b: dict, step: int, micro_index: int) -> tuple[dict, np.ndarray]:
        del step, micro_index   # the labels are a function of the batch alone
        return b, seen_tokens.seen_targets(b, self.tokens, self.skip_ids, self.only_ids, self.cumulative)


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


def context_mask(b: dict, n_tokens: int, image_token_id: int, passing_only: bool) -> np.ndarray:
    """1.0 on the last ``n_tokens`` prompt tokens before each example's target: the judged
    response and the turn around it (image placeholders excluded, as they are not text).

    Why: a random-init judge must learn to compare a value in the response with the request or
    a tool result before any verdict can depend on it. Predicting the response's own tokens
    (a call's arguments copy the request; a delivery note copies the tool result) trains exactly
    that lookup, on every example, where the verdict gives one bit per example. With
    ``passing_only`` only responses the teacher passed are modelled (no copying of errors)."""
    is_target_bt = b["target_mask"] > 0
    rows_ok_b = is_target_bt.any(1) & b["example_valid"].astype(bool)
    if passing_only:
        rows_ok_b &= b["label"] == 0
    first_b = np.argmax(is_target_bt, axis=1)
    t_1t = np.arange(is_target_bt.shape[1])[None, :]
    mask = ((t_1t >= first_b[:, None] - n_tokens) & (t_1t < first_b[:, None]) & (t_1t >= 1)
            & rows_ok_b[:, None] & (b["input_ids"] != image_token_id))
    return mask.astype(np.float32)


def assemble(mcfg, micro: list[dict], frame_capacity: int,
             weights: TokenWeights = TokenWeights(), value_check: ValueCheck | SeenCheck | None = None,
             step: int = 0) -> HostBatch:
    """Loader batches (numpy) -> one StepBatch with a leading accumulation axis. ``step``: the
    step the batch trains (the swapped-value term's draws are a function of it, for resume)."""
    value_target = None
    if value_check is not None:
        swapped = [value_check.apply(b, step, k) for k, b in enumerate(micro)]
        micro = [b for b, _ in swapped]
        value_target = np.stack([v for _, v in swapped])
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
    ctx = None
    if weights.context_tokens:
        ctx = np.stack([context_mask(b, weights.context_tokens, weights.image_token_id, weights.context_passing_only)
                        for b in micro])
    target = np.stack([weighted_target_mask(b, weights.verdict_weight) for b in micro])
    return HostBatch(StepBatch(inputs=inputs, target_mask=target, context_mask=ctx, value_target=value_target),
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
