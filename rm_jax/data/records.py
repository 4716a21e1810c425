"""The on-disk example: one rendered sample, msgpack-encoded inside ArrayRecord shards.

Tokenization, image preprocessing and length filtering happen once, at build time; a record
holds exactly the arrays the train step needs, so the loader only decodes and pads.
A per-split index (`{split}_index.npz`) carries the few scalars the loader needs to oversample
and bucket without decoding any record.
"""

from __future__ import annotations

import os

import numpy as np
from flax import serialization

from rm_jax.data.render import ROUTE_TOOL_CALL, JudgeInput

SPLITS = ("train", "heldout")
# `prompt` numbers the split's prompt_ids in first-seen order (the loader groups a prompt's responses).
INDEX_FIELDS = ("length", "label", "route_tool_call", "has_image", "n_patches", "n_images", "prompt")


def encode(ex: JudgeInput, pixel_dtype: np.dtype) -> bytes:
    return serialization.msgpack_serialize({
        "id": ex.id, "prompt_id": ex.prompt_id,
        "input_ids": ex.input_ids.astype(np.int32),
        "target_mask": ex.target_mask.astype(np.uint8),
        "verdict_pos": int(ex.verdict_pos),
        "pixel_values": ex.pixel_values.astype(pixel_dtype),
        "image_grid_thw": ex.image_grid_thw.astype(np.int32),
        "label": int(ex.label),
        "route_tool_call": int(ex.route == ROUTE_TOOL_CALL),
        "has_image": int(ex.has_image),
        "response_start": int(ex.response_span[0]), "response_end": int(ex.response_span[1]),
    })


def decode(raw: bytes) -> dict:
    return serialization.msgpack_restore(raw)


def index_row(ex: JudgeInput) -> dict:
    return {"length": ex.length, "label": ex.label, "route_tool_call": int(ex.route == ROUTE_TOOL_CALL),
            "has_image": int(ex.has_image), "n_patches": int(ex.pixel_values.shape[0]),
            "n_images": int(ex.image_grid_thw.shape[0])}


def index_path(data_dir: str, split: str) -> str:
    return os.path.join(data_dir, f"{split}_index.npz")


def shard_paths(data_dir: str, split: str) -> list[str]:
    return sorted(os.path.join(data_dir, f) for f in os.listdir(data_dir) if is_shard_file(f, split))


def is_shard_file(name: str, split: str) -> bool:
    return name.startswith(split + "-") and name.endswith(".array_record")


def build_output_files(data_dir: str) -> list[str]:
    """The files a build writes into its folder (shards, indexes, reports), as found there now."""
    reports = {"stats.json", "manifest.json", "rejects.jsonl"} | {os.path.basename(index_path(data_dir, s))
                                                                  for s in SPLITS}
    return sorted(os.path.join(data_dir, f) for f in os.listdir(data_dir)
                  if f in reports or any(is_shard_file(f, s) for s in SPLITS))


def load_index(data_dir: str, split: str) -> dict[str, np.ndarray]:
    with np.load(index_path(data_dir, split)) as z:
        return {k: z[k] for k in z.files}


class ShardWriter:
    """Writes `{split}-NNNNN.array_record` shards, rolling over at a size bound so no shard
    grows into a multi-GB file, and collects the split index."""

    def __init__(self, data_dir: str, split: str, max_bytes: int, max_examples: int):
        self.data_dir, self.split = data_dir, split
        self.max_bytes, self.max_examples = max_bytes, max_examples
        self.rows: list[dict] = []
        self.ids: list[str] = []
        self.prompt_numbers: dict[str, int] = {}
        self.paths: list[str] = []
        self._writer = None
        self._bytes = self._count = 0

    def _roll(self) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter
        self.close_shard()
        path = os.path.join(self.data_dir, f"{self.split}-{len(self.paths):05d}.array_record")
        # group_size:1 keeps every record individually seekable (Grain reads randomly).
        self._writer = ArrayRecordWriter(path, "group_size:1")
        self.paths.append(path)
        self._bytes = self._count = 0

    def write(self, ex: JudgeInput, pixel_dtype: np.dtype) -> None:
        raw = encode(ex, pixel_dtype)
        if self._writer is None or self._count >= self.max_examples or \
                (self._count and self._bytes + len(raw) > self.max_bytes):
            self._roll()
        self._writer.write(raw)
        self._bytes += len(raw)
        self._count += 1
        prompt = self.prompt_numbers.setdefault(ex.prompt_id, len(self.prompt_numbers))
        self.rows.append({**index_row(ex), "prompt": prompt})
        self.ids.append(ex.id)

    def close_shard(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def finish(self) -> dict:
        self.close_shard()
        if not self.paths:   # an empty split still gets one (empty) shard so readers need no case
            self._roll()
            self.close_shard()
        cols = {k: np.asarray([r[k] for r in self.rows], np.int32).reshape(-1) for k in INDEX_FIELDS}
        np.savez(index_path(self.data_dir, self.split), **cols)
        return {"examples": len(self.rows), "shards": [os.path.basename(p) for p in self.paths]}
