"""Compile the server's whole shape ladder before it takes traffic, and count compiles after.

Every scoring device call pads to a static shape: a length bucket x an image ladder rung for
whole prompts; for shared prefixes (GRPO groups) a prefill of a prefix bucket x rung x cache room,
then member suffixes of a power-of-two width. Left to traffic, each new shape compiles while
requests wait (minutes for a 30B judge; OpenRLHF gives up after 180 s). So at start the server
runs one device call of every shape that traffic can reach, for each mode it serves
(``p_pass`` and ``full``), with synthetic rows of exactly that shape, and reports ready only then.

The ladder (``shape_ladder``):

* **Lengths**: every bucket of the run.
* **Images**: text only, and every ladder rung up to a full batch with one largest image per row
  (rows carrying more images than that are possible, rare, and compile on demand: counted).
* **Shared prefixes**: every (prefix bucket, suffix width) pair a rendered sample can produce: a
  prefix of at least ``min_shared_tokens`` tokens in that bucket plus a suffix of that width fits
  the largest bucket.

``CompileCounter`` listens to JAX's monitoring events: backend compiles (and persistent-cache
hits), so a load run can check that traffic after ready compiled nothing.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import jax
import numpy as np
from absl import logging

from rm_jax.data.render import JudgeInput
from rm_jax.score.scorer import SUFFIX_ROOM, PrefixGroup, Scorer, ScoreItem, ScoreMode
from rm_jax.serve.map_budget import MapBudget

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Process-wide counts of XLA backend compiles (JAX's monitoring events)."""

    _lock = threading.Lock()
    compiles = 0
    cache_hits = 0
    _installed = False

    @classmethod
    def install(cls) -> type["CompileCounter"]:
        with cls._lock:
            if not cls._installed:
                jax.monitoring.register_event_duration_secs_listener(cls._on_duration)
                jax.monitoring.register_event_listener(cls._on_event)
                cls._installed = True
        return cls

    @classmethod
    def _on_duration(cls, event: str, _secs: float, **_kw) -> None:
        if event == BACKEND_COMPILE_EVENT:
            with cls._lock:
                cls.compiles += 1

    @classmethod
    def _on_event(cls, event: str, **_kw) -> None:
        if event == CACHE_HIT_EVENT:
            with cls._lock:
                cls.cache_hits += 1


@dataclasses.dataclass(frozen=True)
class LadderShape:
    mode: ScoreMode
    bucket: int                  # whole: the prompt bucket; shared: the prefix bucket
    images: int                  # image rows of the rung (0: text only)
    width: int = 0               # shared prefixes: the member suffix width (0: whole prompts)

    def __str__(self) -> str:
        path = f"shared prefix, suffix width {self.width}" if self.width else "whole"
        return f"{self.mode.value} {path}, bucket {self.bucket}, {self.images} image rows"


def image_rungs(scorer: Scorer) -> list[int]:
    """Image rows of every rung a batch can reach with at most one largest image per row."""
    if scorer.ladder is None or scorer.frame_capacity is None:
        return [0]
    top = scorer.ladder.pad(scorer.batch_size * scorer.frame_capacity, scorer.batch_size)[1]
    return [0] + [1 << k for k in range(top.bit_length())]


def _fits(scorer: Scorer, bucket: int, images: int) -> bool:
    return images == 0 or _rows_tokens(scorer, images) <= bucket


def _image_tokens(scorer: Scorer) -> int:
    merge = scorer.model.cfg.vision.spatial_merge_size
    return scorer.ladder.patches_per_image // (merge * merge)


def _rows_tokens(scorer: Scorer, images: int) -> int:
    """Tokens of the fullest row when ``images`` images are spread over a batch."""
    per_row = -(-images // scorer.batch_size)
    return per_row * (_image_tokens(scorer) + 2) + 1


def shape_ladder(scorer: Scorer, modes=tuple(ScoreMode)) -> list[LadderShape]:
    buckets = scorer.buckets
    out: list[LadderShape] = []
    for mode in modes:
        for images in image_rungs(scorer):
            out += [LadderShape(mode, b, images) for b in buckets if _fits(scorer, b, images)]
        if not (scorer.verdict_first and scorer.share_prefix):
            continue
        for i, b in enumerate(buckets):
            n_min = max(buckets[i - 1] + 1 if i else 1, scorer.min_shared_tokens)
            widths, w = [], 16
            while n_min + (w // 2 + 1 if w > 16 else 1) <= buckets[-1]:
                widths.append(w)
                w *= 2
            # The member step's shape is the width's alone; the prefill's, the rung's and the cache
            # room's: every width once (text), then one width per room for each image rung.
            per_room = list({max(w, SUFFIX_ROOM): w for w in reversed(widths)}.values())
            for images in image_rungs(scorer):
                if _fits(scorer, b, images):
                    out += [LadderShape(mode, b, images, w) for w in (per_room if images else widths)]
    return out


def _row(scorer: Scorer, index: int, length: int, images: int) -> ScoreItem:
    """A synthetic rendered row of ``length`` tokens holding ``images`` images of one rung unit each."""
    cfg = scorer.model.cfg
    ids: list[int] = []
    grids, pixels = [], []
    if images:
        merge = cfg.vision.spatial_merge_size
        ppi = scorer.ladder.patches_per_image
        for _ in range(images):
            ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * _image_tokens(scorer) + [scorer.pad_id]
            grids.append((1, merge, ppi // merge))
            # The renderer's storage dtype: pixel values are a jit argument, so float32 here would
            # compile a twin of every image shape that float16 traffic then compiles again.
            pixels.append(np.zeros((ppi, cfg.vision.patch_dim), scorer.renderer.image_pre.storage_dtype))
    ids += [scorer.pad_id] * (length - len(ids))
    rendered = JudgeInput(
        id=f"warmup-{index}", prompt_id="", input_ids=np.asarray(ids, np.int32), target_mask=np.zeros(length, np.uint8),
        verdict_pos=-1, pixel_values=np.concatenate(pixels) if pixels else np.zeros(
            (0, cfg.vision.patch_dim), scorer.renderer.image_pre.storage_dtype),
        image_grid_thw=np.asarray(grids, np.int32).reshape(-1, 3), route="tool_call", label=-1, has_image=bool(images),
        n_image_tokens=images * _image_tokens(scorer) if images else 0)
    return ScoreItem(index=index, rendered=rendered, ids=rendered.input_ids)


def _spread(scorer: Scorer, images: int) -> list[int]:
    """Images per row of a batch holding ``images`` images (as even as rows allow)."""
    rows = min(max(images, 1), scorer.batch_size)
    return [images // rows + (1 if r < images % rows else 0) for r in range(rows)] if images else [0]


def warm(scorer: Scorer, shape: LadderShape) -> None:
    """One device call of ``shape``, fetched (compiles it unless already compiled)."""
    if not shape.width:
        rows = [_row(scorer, k, shape.bucket, n) for k, n in enumerate(_spread(scorer, shape.images))]
        jax.block_until_ready(scorer.dispatch_whole(shape.mode, rows)[1])
        return
    buckets = scorer.buckets
    at = buckets.index(shape.bucket)
    n = max(buckets[at - 1] + 1 if at else 1, scorer.min_shared_tokens, _rows_tokens(scorer, shape.images))
    suffix = shape.width // 2 + 1 if shape.width > 16 else 1
    groups = []
    for k, n_images in enumerate(_spread(scorer, shape.images)):
        prefix = _row(scorer, 2 * k, n, n_images)
        whole = np.concatenate([prefix.ids, np.full(suffix, scorer.pad_id, np.int32)])
        members = [dataclasses.replace(prefix, index=2 * k + j, ids=whole) for j in range(2)]
        groups.append(PrefixGroup(items=members, n_shared=n))
    for _rows, result in scorer.dispatch_shared(shape.mode, groups):
        jax.block_until_ready(result)


def warm_ladder(scorer: Scorer, shapes: list[LadderShape], progress: Callable[[int, int, LadderShape], None] | None = None,
                budget: MapBudget | None = None) -> dict:
    """Warm every shape; returns {"shapes", "seconds", "compiles"} (compiles counted meanwhile).
    With a ``budget``, raises ``MapBudgetExceeded`` as soon as the rest of the ladder projects past
    the process's mapping cap (rm_jax.serve.map_budget)."""
    counter = CompileCounter.install()
    before, t0 = counter.compiles, time.perf_counter()
    mapped = budget.at_start if budget is not None else 0
    for k, shape in enumerate(shapes):
        warm(scorer, shape)
        if budget is not None:
            mapped = budget.check(k + 1, len(shapes), mapped)
        if progress is not None:
            progress(k + 1, len(shapes), shape)
    return {"shapes": len(shapes), "seconds": time.perf_counter() - t0, "compiles": counter.compiles - before}


def log_progress(done: int, total: int, shape: LadderShape) -> None:
    if done == total or done % max(total // 20, 1) == 0:
        logging.info("compiling the shape ladder: %d/%d (%s)", done, total, shape)
