"""One input line -> its outcome: rejected with a reason, or a finished record and its scalars.

The same ``RowRenderer`` runs in the building process and in each worker (`build_chunks`), so a
line's outcome cannot depend on the worker count.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from rm_jax.data import records
from rm_jax.data.render import JudgeInput, Renderer
from rm_jax.data.schema import Reject, Sample, SampleError, parse_line

def split_of(prompt_id: str, heldout_fraction: float, seed: int) -> str:
    h = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()
    u = int.from_bytes(h[:8], "big") / 2.0 ** 64
    return "heldout" if u < heldout_fraction else "train"


@dataclasses.dataclass(frozen=True)
class RowOptions:
    """What rendering one row needs besides the renderer (picklable, sent to each worker)."""
    max_len: int
    heldout_fraction: float
    split_seed: int
    pixel_dtype: str


@dataclasses.dataclass(frozen=True)
class KeptRow:
    """A rendered row as the chunk writer needs it: the record's bytes and its scalars."""
    split: str
    record: bytes                 # records.encode of the example (pixels in the storage dtype)
    index: dict                   # records.index_row
    id: str
    prompt_id: str
    length: int
    n_image_tokens: int
    n_images: int
    route: str
    label: int
    flags: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class RowOutcome:
    """One non-blank input line: kept, or rejected with its reason."""
    line: int
    parsed_id: str | None          # the id when the line parsed as a Sample (duplicates key on it)
    kept: KeptRow | None = None
    reject: Reject | None = None
    too_long_length: int | None = None


class RowRenderer:
    """Line bytes -> RowOutcome. The same code runs in-process (one worker) and in each worker."""

    def __init__(self, renderer: Renderer, opts: RowOptions, base_dir: str):
        self.renderer, self.opts, self.base_dir = renderer, opts, base_dir
        self.pixel_dtype = np.dtype(opts.pixel_dtype)

    def __call__(self, line: int, raw: bytes) -> RowOutcome | None:
        item = parse_line(raw, line=line, base_dir=self.base_dir)
        if item is None:
            return None
        if isinstance(item, Reject):
            return RowOutcome(line, None, reject=item)
        sample: Sample = item
        try:
            ex: JudgeInput = self.renderer.render(sample)
        except SampleError as e:
            return RowOutcome(line, sample.id, reject=Reject(
                sample.line, sample.id, e.reason, f"line {sample.line}, id {sample.id}, field {e.field}: {e.detail}"))
        except Exception as e:   # noqa: BLE001 -- one bad row is rejected with its reason, never fatal
            return RowOutcome(line, sample.id, reject=Reject(
                sample.line, sample.id, "render_error", f"line {sample.line}, id {sample.id}: {type(e).__name__}: {e}"))
        if ex.length > self.opts.max_len:
            return RowOutcome(line, sample.id, too_long_length=ex.length, reject=Reject(
                sample.line, sample.id, "too_long",
                f"line {sample.line}, id {sample.id}: {ex.length} tokens > max_len {self.opts.max_len}"))
        split = split_of(sample.prompt_id, self.opts.heldout_fraction, self.opts.split_seed)
        return RowOutcome(line, sample.id, kept=KeptRow(
            split=split, record=records.encode(ex, self.pixel_dtype), index=records.index_row(ex), id=ex.id,
            prompt_id=ex.prompt_id, length=ex.length, n_image_tokens=ex.n_image_tokens,
            n_images=int(ex.image_grid_thw.shape[0]), route=ex.route, label=ex.label, flags=tuple(ex.flags)))
