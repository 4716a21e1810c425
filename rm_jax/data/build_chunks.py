"""Build's unit of work: a chunk of input lines, read, rendered and written in order by one process.

The input is cut by physical line number into chunks of ``chunk_lines`` lines (chunk ``c`` holds
lines ``c * chunk_lines + 1 ...``). Everything a chunk writes depends on its own lines only:

* its shards, ``{split}-{chunk:05d}-{part:03d}.array_record``, in input order;
* its part, ``parts/chunk-{chunk:05d}.json``: what the merge needs (rejects, index rows, lengths,
  label balance, value-class hits, the ids it parsed) and the build's fingerprint.

So the output cannot depend on how many worker processes built chunks side by side, or which
host built which. The main process only finds each chunk's byte offset (one sequential read) and
hands chunks to N workers: nothing per row crosses a process boundary, so N workers run N times
as fast while there are at least N chunks (an input shorter than N chunks leaves workers idle:
lower ``data.shard_max_examples`` for it).

Duplicate ids are rejected in input order, as one reader would: within a chunk here, across chunks
by the merge, which rebuilds a chunk with the ids that earlier chunks already took.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
from typing import Callable, Iterator

from absl import logging
from array_record.python.array_record_module import ArrayRecordWriter
from tqdm import tqdm

from rm_jax.data import records
from rm_jax.data.build_rows import RowOptions, RowOutcome, RowRenderer
from rm_jax.data.render import ROUTE_TEXT_ONLY, ROUTE_TOOL_CALL, Renderer
from rm_jax.data.schema import Reject

PARTS_DIR = "parts"


def part_path(out_dir: str, chunk: int) -> str:
    return os.path.join(out_dir, PARTS_DIR, f"chunk-{chunk:05d}.json")


def chunk_shard_prefix(split: str, chunk: int) -> str:
    return f"{split}-{chunk:05d}-"


class ChunkBuilder:
    """Consumes one chunk's outcomes in order; writes its shards and, at `finish`, its part."""

    def __init__(self, out_dir: str, chunk: int, shard_max_bytes: int, shard_max_examples: int,
                 fingerprint: str, prior_ids: frozenset[str] = frozenset()):
        self.out_dir, self.chunk, self.fingerprint = out_dir, chunk, fingerprint
        self.max_bytes, self.max_examples = shard_max_bytes, shard_max_examples
        self.prior_ids = prior_ids
        for name in os.listdir(out_dir):   # this chunk's shards from an earlier build
            if any(name.startswith(chunk_shard_prefix(s, chunk)) and records.is_shard_file(name, s)
                   for s in records.SPLITS):
                os.remove(os.path.join(out_dir, name))
        self.read = 0
        self.parsed_ids: list[str] = []
        self._seen: set[str] = set()
        self.rejects: list[dict] = []
        self.too_long: list[int] = []
        self.flagged: collections.Counter = collections.Counter()
        self.splits = {s: {"shards": [], "ids": [], "prompt_ids": [], "index": {k: [] for k in INDEX_ROW_FIELDS}}
                       for s in records.SPLITS}
        self.text_lengths: list[int] = []
        self.total_lengths: list[int] = []
        self.image_tokens = self.n_images = 0
        self.balance = {r: {"pass": 0, "fail": 0} for r in (ROUTE_TOOL_CALL, ROUTE_TEXT_ONLY)}
        self._writers: dict[str, object] = {}
        self._bytes = {s: 0 for s in records.SPLITS}
        self._count = {s: 0 for s in records.SPLITS}

    def add(self, outcome: RowOutcome | None) -> None:
        if outcome is None:   # a blank line is not a row
            return
        self.read += 1
        if outcome.parsed_id is not None:
            if outcome.parsed_id in self._seen or outcome.parsed_id in self.prior_ids:
                self.rejects.append(Reject(outcome.line, outcome.parsed_id, "duplicate_id",
                                           f"line {outcome.line}, id {outcome.parsed_id}, field id: duplicate id")
                                    .to_json())
                return
            self._seen.add(outcome.parsed_id)
            self.parsed_ids.append(outcome.parsed_id)
        if outcome.reject is not None:
            self.rejects.append(outcome.reject.to_json())
            if outcome.too_long_length is not None:
                self.too_long.append(outcome.too_long_length)
            return
        k = outcome.kept
        self._write(k.split, k.record)
        split = self.splits[k.split]
        split["ids"].append(k.id)
        split["prompt_ids"].append(k.prompt_id)
        for field in INDEX_ROW_FIELDS:
            split["index"][field].append(int(k.index[field]))
        self.flagged.update(k.flags)
        self.total_lengths.append(k.length)
        self.text_lengths.append(k.length - k.n_image_tokens)
        self.image_tokens += k.n_image_tokens
        self.n_images += k.n_images
        self.balance[k.route]["fail" if k.label == 1 else "pass"] += 1

    def _write(self, split: str, raw: bytes) -> None:
        w = self._writers.get(split)
        if w is None or self._count[split] >= self.max_examples or \
                (self._count[split] and self._bytes[split] + len(raw) > self.max_bytes):
            if w is not None:
                w.close()
            name = f"{chunk_shard_prefix(split, self.chunk)}{len(self.splits[split]['shards']):03d}.array_record"
            # group_size:1 keeps every record individually seekable (Grain reads randomly).
            w = self._writers[split] = ArrayRecordWriter(os.path.join(self.out_dir, name), "group_size:1")
            self.splits[split]["shards"].append(name)
            self._bytes[split] = self._count[split] = 0
        w.write(raw)
        self._bytes[split] += len(raw)
        self._count[split] += 1

    def finish(self) -> "ChunkPart":
        for w in self._writers.values():
            w.close()
        part = ChunkPart(
            fingerprint=self.fingerprint, chunk=self.chunk, read=self.read, parsed_ids=self.parsed_ids,
            rejects=self.rejects, too_long_lengths=self.too_long, flagged=dict(sorted(self.flagged.items())),
            splits=self.splits, text_lengths=self.text_lengths, total_lengths=self.total_lengths,
            image_tokens=self.image_tokens, n_images=self.n_images, balance=self.balance)
        part.write(self.out_dir)
        return part


INDEX_ROW_FIELDS = tuple(f for f in records.INDEX_FIELDS if f != "prompt")   # "prompt" is numbered by the merge


@dataclasses.dataclass
class ChunkPart:
    """A chunk's summary, as the merge reads it from `parts/chunk-NNNNN.json`."""
    fingerprint: str
    chunk: int
    read: int
    parsed_ids: list[str]
    rejects: list[dict]
    too_long_lengths: list[int]
    flagged: dict[str, int]
    splits: dict[str, dict]
    text_lengths: list[int]
    total_lengths: list[int]
    image_tokens: int
    n_images: int
    balance: dict[str, dict[str, int]]

    def write(self, out_dir: str) -> None:
        path = part_path(out_dir, self.chunk)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        # Shallow (the fields are JSON-ready already) and one C-encoder call: dataclasses.asdict
        # and json.dump's chunked encoder cost the main process more than writing the shards.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        with open(tmp, "w") as f:
            f.write(json.dumps(fields, ensure_ascii=False, separators=(",", ":")))
        os.replace(tmp, path)   # a part is either whole or absent (the merge tests presence)

    @classmethod
    def read_if_current(cls, out_dir: str, chunk: int, fingerprint: str) -> "ChunkPart | None":
        """The chunk's part if it exists and was built by this build (same input, options, renderer)."""
        try:
            with open(part_path(out_dir, chunk)) as f:
                part = cls(**json.load(f))
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return None
        return part if part.fingerprint == fingerprint else None


def chunk_offsets(input_path: str, chunk_lines: int) -> tuple[list[int], int]:
    """Byte offset of each chunk's first line, and the input's line count (one sequential read)."""
    offsets, pos, n_lines = [], 0, 0
    with open(input_path, "rb") as f:
        for raw in f:
            if n_lines % chunk_lines == 0:
                offsets.append(pos)
            pos += len(raw)
            n_lines += 1
    return offsets, n_lines


def read_chunk(input_path: str, offset: int, first_line: int, count: int) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of ``count`` lines from ``offset``, as ``schema.iter_jsonl`` gives them."""
    with open(input_path, "rb") as f:
        f.seek(offset)
        for line, raw in enumerate(f, start=first_line):
            if line >= first_line + count:
                return
            yield line, (raw[3:] if line == 1 and raw.startswith(UTF8_BOM) else raw)


UTF8_BOM = b"\xef\xbb\xbf"


@dataclasses.dataclass(frozen=True)
class ChunkJob:
    """Everything a worker needs to build one chunk (picklable)."""
    input_path: str
    out_dir: str
    chunk: int
    offset: int
    chunk_lines: int
    shard_max_bytes: int
    fingerprint: str
    prior_ids: frozenset[str]


def build_chunk(rows: RowRenderer, job: ChunkJob) -> int:
    """Renders and writes one chunk; returns its line count read."""
    builder = ChunkBuilder(job.out_dir, job.chunk, job.shard_max_bytes, job.chunk_lines, job.fingerprint,
                           job.prior_ids)
    n = 0
    for line, raw in read_chunk(job.input_path, job.offset, job.chunk * job.chunk_lines + 1, job.chunk_lines):
        builder.add(rows(line, raw))
        n += 1
    builder.finish()
    return n


_WORKER: RowRenderer | None = None


def _init_worker(renderer: Renderer, opts: RowOptions, base_dir: str) -> None:
    global _WORKER
    _WORKER = RowRenderer(renderer, opts, base_dir)


def _build_in_worker(job: ChunkJob) -> int:
    return build_chunk(_WORKER, job)


def build_chunks(input_path: str, out_dir: str, renderer: Renderer, row_opts: RowOptions, *, chunk_lines: int,
                 shard_max_bytes: int, fingerprint: str, wanted: Callable[[int], bool], num_workers: int,
                 prior_ids: dict[int, frozenset[str]] | None = None, progress: bool = False) -> tuple[list[int], int]:
    """Builds every chunk `wanted(c)` selects, `num_workers` chunks at a time (1: in this
    process). Returns (chunks built, the input's line count)."""
    prior_ids = prior_ids or {}
    offsets, n_lines = chunk_offsets(input_path, chunk_lines)
    jobs = [ChunkJob(input_path, out_dir, c, off, chunk_lines, shard_max_bytes, fingerprint,
                     prior_ids.get(c, frozenset())) for c, off in enumerate(offsets) if wanted(c)]
    base_dir = os.path.dirname(os.path.abspath(input_path))
    bar = tqdm(total=len(jobs) * chunk_lines, desc="build", unit="line", disable=not progress, mininterval=2.0)
    if num_workers <= 1 or len(jobs) <= 1:
        rows = RowRenderer(renderer, row_opts, base_dir)
        for job in jobs:
            bar.update(build_chunk(rows, job))
    else:
        # Forked where the OS can: workers inherit the loaded renderer and modules and start in
        # milliseconds (a spawned one re-imports transformers' image stack, torch included). They
        # run the tokenizer, PIL, numpy and msgpack, never a JAX computation, so the JAX runtime's
        # threads in this process do not matter to them.
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        with concurrent.futures.ProcessPoolExecutor(min(num_workers, len(jobs)),
                                                    mp_context=multiprocessing.get_context(method),
                                                    initializer=_init_worker,
                                                    initargs=(renderer, row_opts, base_dir)) as pool:
            for n in pool.map(_build_in_worker, jobs):
                bar.update(n)
    bar.close()
    built = [job.chunk for job in jobs]
    logging.info("built chunks %s%s of %s (%d lines)", built[:8], " ..." if len(built) > 8 else "", input_path,
                 n_lines)
    return built, n_lines
