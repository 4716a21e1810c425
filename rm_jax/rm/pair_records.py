"""The on-disk pair example: one prompt group per record, msgpack-encoded in ArrayRecord shards.

A record holds everything the RM step needs for one prompt: its candidates' token ids (prompt +
response, concatenated with offsets), prompt and response lengths, their image patches and grids,
and the group's pairs as indices into its own candidates (with label p, weight, margin). A prompt's
pairs never leave its record, so a microbatch of whole records keeps every pair with both of its
candidates, in one process or several.

Shards are ``{split}-NNNNN.array_record`` (the judge's naming, rm_jax.data.records), rolled over at
a size bound; ``{split}_pairs_index.npz`` carries the few per-group counts the loader and the run
planner read without decoding any record.
"""

from __future__ import annotations

import os

import numpy as np
from flax import serialization

from rm_jax.data import records as judge_records

INDEX_FIELDS = ("n_candidates", "n_pairs", "max_length", "n_patches", "n_images")


def encode(group: dict) -> bytes:
    return serialization.msgpack_serialize(group)


def decode(raw: bytes) -> dict:
    return serialization.msgpack_restore(raw)


def index_path(data_dir: str, split: str) -> str:
    return os.path.join(data_dir, f"{split}_pairs_index.npz")


def shard_paths(data_dir: str, split: str) -> list[str]:
    return judge_records.shard_paths(data_dir, split)


def load_index(data_dir: str, split: str) -> dict[str, np.ndarray]:
    path = index_path(data_dir, split)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: not a built pair directory (launch.rm_build --out writes one; "
                                "pair data built before the ArrayRecord format must be rebuilt)")
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def read_split(data_dir: str, split: str) -> list[dict]:
    """Every group record of a split, in build order (evaluation reads whole small splits)."""
    from array_record.python.array_record_module import ArrayRecordReader
    out = []
    for path in shard_paths(data_dir, split):
        reader = ArrayRecordReader(path)
        try:
            out.extend(decode(raw) for raw in reader.read_all())
        finally:
            reader.close()
    return out


class GroupShardWriter:
    """Writes one split's group records, rolling shards over at a size or count bound (no
    multi-GB file), and collects the split index."""

    def __init__(self, data_dir: str, split: str, max_bytes: int = 64 << 20, max_records: int = 2048):
        self.data_dir, self.split = data_dir, split
        self.max_bytes, self.max_records = max_bytes, max_records
        self.rows: list[dict] = []
        self.paths: list[str] = []
        self._writer = None
        self._bytes = self._count = 0

    def _roll(self) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter
        self._close_shard()
        path = os.path.join(self.data_dir, f"{self.split}-{len(self.paths):05d}.array_record")
        self._writer = ArrayRecordWriter(path, "group_size:1")   # every record seekable (Grain reads randomly)
        self.paths.append(path)
        self._bytes = self._count = 0

    def write(self, group: dict) -> None:
        raw = encode(group)
        if self._writer is None or self._count >= self.max_records or \
                (self._count and self._bytes + len(raw) > self.max_bytes):
            self._roll()
        self._writer.write(raw)
        self._bytes += len(raw)
        self._count += 1
        lengths = np.diff(group["offsets"])
        self.rows.append({"n_candidates": len(lengths), "n_pairs": len(group["pair_a"]),
                          "max_length": int(lengths.max(initial=0)), "n_patches": int(group["pixels"].shape[0]),
                          "n_images": int(group["grids"].shape[0])})

    def _close_shard(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def finish(self) -> dict:
        self._close_shard()
        if not self.paths:   # an empty split still gets one (empty) shard, so readers need no case
            self._roll()
            self._close_shard()
        np.savez(index_path(self.data_dir, self.split),
                 **{k: np.asarray([r[k] for r in self.rows], np.int64).reshape(-1) for k in INDEX_FIELDS})
        return {"groups": len(self.rows), "shards": [os.path.basename(p) for p in self.paths]}


def stale_outputs(data_dir: str, splits) -> list[str]:
    """Files an earlier build left in the folder (shards, indexes, old .npz splits)."""
    names = set(os.listdir(data_dir))
    out = []
    for s in splits:
        out += [os.path.join(data_dir, f) for f in names if judge_records.is_shard_file(f, s)]
        out += [os.path.join(data_dir, f) for f in (f"{s}_pairs_index.npz", f"{s}.npz", f"{s}.groups.jsonl")
                if f in names]
    return sorted(out)
