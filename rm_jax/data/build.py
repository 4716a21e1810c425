"""Build: samples.jsonl -> tokenized, loss-masked, split ArrayRecord shards + stats + rejects.

Every input row ends up kept or rejected with a reason (read = kept + rejected; the counts are
asserted before anything is written as final). Over-length samples are rejected as
``too_long`` — never truncated, because a truncated sample loses its verdict target.

Splits are by ``prompt_id`` (a stable hash, so adding rows never moves a prompt across the
split); the held-out split is never duplicated. Failures are oversampled in the training
*stream* by the loader, from the factor recorded here, so the shards hold each example once.

Scale: the input is cut into chunks of ``shard_max_examples`` lines (`build_chunks`), built side
by side by ``num_workers`` processes; with ``num_shards=k`` host ``i`` builds chunks
``c % k == i`` into the same (shared) folder, and one merge writes the indexes, stats, rejects and
manifest over all chunks. The output bytes depend on the input and options only, never on N or k.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import time

import numpy as np
from absl import logging
from array_record.python.array_record_module import ArrayRecordWriter

from rm_jax.data import build_chunks, build_rows, records
from rm_jax.data.build_rows import split_of  # noqa: F401 -- part of this module's API
from rm_jax.data.render import ROUTE_TEXT_ONLY, ROUTE_TOOL_CALL, Renderer
from rm_jax.utils import file_sha256, package_versions, tree_sha256


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    max_len: int
    heldout_fraction: float = 0.15
    split_seed: int = 0
    oversample_fail: int = 3
    shard_max_bytes: int = 64 << 20
    shard_max_examples: int = 2048
    pixel_dtype: str = "float16"

    @classmethod
    def from_config(cls, data_cfg) -> "BuildOptions":
        return cls(max_len=int(data_cfg.max_len), heldout_fraction=float(data_cfg.heldout_fraction),
                   split_seed=int(data_cfg.split_seed), oversample_fail=int(data_cfg.oversample_fail),
                   shard_max_bytes=int(data_cfg.shard_max_bytes),
                   shard_max_examples=int(data_cfg.shard_max_examples),
                   pixel_dtype=str(data_cfg.pixel_dtype))

    @property
    def chunk_lines(self) -> int:
        """Input lines per chunk, the unit one host builds (so a chunk's split fits one shard
        unless the byte bound rolls it over)."""
        return self.shard_max_examples


def _pct(values: list[int], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


@dataclasses.dataclass
class BuildResult:
    stats: dict
    manifest: dict
    out_dir: str


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """Where a build reads and writes, and the fingerprint every chunk part carries (a part from
    another input, options or renderer is never merged)."""
    input_path: str
    out_dir: str
    renderer: Renderer
    opts: BuildOptions
    config_dict: dict
    tokenizer_dir: str | None
    input_sha256: str
    fingerprint: str

    @classmethod
    def make(cls, input_path: str, out_dir: str, renderer: Renderer, opts: BuildOptions,
             config_dict: dict | None, tokenizer_dir: str | None) -> "BuildPlan":
        input_sha = file_sha256(input_path)
        ident = {"input_sha256": input_sha, "build_options": dataclasses.asdict(opts),
                 "chat_template_sha256": _template_sha(renderer), "verdict": dataclasses.asdict(renderer.verdict),
                 "tokenizer_sha256": tree_sha256(tokenizer_dir) if tokenizer_dir else None,
                 "config": config_dict or {}}
        fingerprint = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()
        return cls(input_path, out_dir, renderer, opts, config_dict or {}, tokenizer_dir, input_sha, fingerprint)

    def row_options(self) -> build_rows.RowOptions:
        o = self.opts
        return build_rows.RowOptions(o.max_len, o.heldout_fraction, o.split_seed, o.pixel_dtype)

    def run_chunks(self, wanted, num_workers: int, progress: bool, prior_ids=None) -> tuple[list[int], int]:
        return build_chunks.build_chunks(
            self.input_path, self.out_dir, self.renderer, self.row_options(), chunk_lines=self.opts.chunk_lines,
            shard_max_bytes=self.opts.shard_max_bytes, fingerprint=self.fingerprint, wanted=wanted,
            num_workers=num_workers, prior_ids=prior_ids, progress=progress)


def _template_sha(renderer: Renderer) -> str:
    return hashlib.sha256((renderer.tokenizer.chat_template or "").encode()).hexdigest()


def _prepare_out_dir(out_dir: str, *, clean: bool) -> None:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--out={out_dir} is a file, not a directory")
    os.makedirs(os.path.join(out_dir, build_chunks.PARTS_DIR), exist_ok=True)
    if not clean:
        return
    # A rebuild into the same folder must not leave the earlier build's shards behind: readers
    # take every `{split}-*.array_record` there (other files in the folder are left alone).
    stale = records.build_output_files(out_dir) + _part_files(out_dir)
    for path in stale:
        os.remove(path)
    if stale:
        logging.warning("%s: removed %d files of an earlier build", out_dir, len(stale))


def _part_files(out_dir: str) -> list[str]:
    parts = os.path.join(out_dir, build_chunks.PARTS_DIR)
    return sorted(os.path.join(parts, f) for f in os.listdir(parts)) if os.path.isdir(parts) else []


def build(input_path: str, out_dir: str, renderer: Renderer, opts: BuildOptions, *,
          config_dict: dict | None = None, tokenizer_dir: str | None = None, progress: bool = True,
          num_workers: int = 1, shard_index: int = 0, num_shards: int = 1) -> BuildResult | None:
    """Builds this host's slice (chunks ``c % num_shards == shard_index``) with `num_workers`
    processes, then merges if every chunk is done: always with one shard; with several, in the
    slice that finishes last. Returns None when other slices are still missing (`merge` then
    runs in the last one, or explicitly)."""
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"--shard_index={shard_index} must be in [0, --num_shards={num_shards})")
    if num_workers < 1:
        raise ValueError(f"--num_workers={num_workers} must be >= 1")
    # One host owns the folder: clear any earlier build. Several hosts share it: each clears only
    # its own chunks, and the merge removes what no chunk of this build wrote.
    _prepare_out_dir(out_dir, clean=num_shards == 1)
    plan = BuildPlan.make(input_path, out_dir, renderer, opts, config_dict, tokenizer_dir)
    t0 = time.time()
    built, n_lines = plan.run_chunks(lambda c: c % num_shards == shard_index, num_workers, progress)
    logging.info("slice %d/%d: %d chunks in %.1fs with %d workers", shard_index, num_shards, len(built),
                 time.time() - t0, num_workers)
    return _merge(plan, n_lines, num_workers=num_workers, explicit=num_shards == 1, progress=progress)


def merge(input_path: str, out_dir: str, renderer: Renderer, opts: BuildOptions, *,
          config_dict: dict | None = None, tokenizer_dir: str | None = None, num_workers: int = 1,
          progress: bool = False) -> BuildResult:
    """Writes the indexes, stats, rejects and manifest over every slice's chunks (raises if a
    chunk is missing or was built from another input, options or renderer)."""
    _prepare_out_dir(out_dir, clean=False)
    plan = BuildPlan.make(input_path, out_dir, renderer, opts, config_dict, tokenizer_dir)
    with open(input_path, "rb") as f:
        n_lines = sum(1 for _ in f)
    return _merge(plan, n_lines, num_workers=num_workers, explicit=True, progress=progress)


def _merge(plan: BuildPlan, n_lines: int, *, num_workers: int, explicit: bool, progress: bool) -> BuildResult | None:
    out_dir, opts = plan.out_dir, plan.opts
    n_chunks = -(-n_lines // opts.chunk_lines)
    parts = {c: build_chunks.ChunkPart.read_if_current(out_dir, c, plan.fingerprint) for c in range(n_chunks)}
    missing = [c for c, p in parts.items() if p is None]
    if missing:
        msg = (f"{out_dir}: chunks {missing[:10]}{' ...' if len(missing) > 10 else ''} of {n_chunks} are not built "
               f"(by this input and config) yet")
        if explicit:
            raise ValueError(msg)
        logging.info("%s; the slice that completes them merges (or run with --merge)", msg)
        return None
    lock = os.path.join(out_dir, build_chunks.PARTS_DIR, "merge.lock")
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        if explicit:
            raise ValueError(f"{lock} exists: another merge is running (remove the file if none is)") from None
        logging.info("another slice is merging %s", out_dir)
        return None
    try:
        parts = _drop_cross_chunk_duplicates(plan, parts, num_workers, progress)
        return _write_reports(plan, [parts[c] for c in range(n_chunks)])
    finally:
        os.remove(lock)


def _drop_cross_chunk_duplicates(plan: BuildPlan, parts: dict, num_workers: int, progress: bool) -> dict:
    """A chunk whose ids an earlier chunk already parsed is rebuilt with them rejected as
    ``duplicate_id``, so the first occurrence wins across chunks as it does within one."""
    seen: set[str] = set()
    for c in sorted(parts):
        dups = frozenset(seen.intersection(parts[c].parsed_ids))
        if dups:
            logging.info("chunk %d repeats %d ids of earlier chunks; rebuilding it", c, len(dups))
            plan.run_chunks(lambda k, c=c: k == c, num_workers, progress, prior_ids={c: dups})
            parts[c] = build_chunks.ChunkPart.read_if_current(plan.out_dir, c, plan.fingerprint)
        seen.update(parts[c].parsed_ids)
    return parts


def _write_reports(plan: BuildPlan, parts: list[build_chunks.ChunkPart]) -> BuildResult:
    out_dir, opts, renderer = plan.out_dir, plan.opts, plan.renderer
    input_path = plan.input_path
    read = sum(p.read for p in parts)
    rejects = [r for p in parts for r in p.rejects]
    kept = sum(len(p.splits[s]["ids"]) for p in parts for s in records.SPLITS)
    _remove_stale(out_dir, parts)
    if read != kept + len(rejects):   # the invariant the stats promise
        raise AssertionError(f"row accounting broken: read {read} != kept {kept} + rejected {len(rejects)}")
    if kept == 0:
        _write_rejects(out_dir, rejects)
        raise ValueError(f"{input_path}: no valid rows out of {read}; see {out_dir}/rejects.jsonl")
    prompts_by_split = {s: {pid for p in parts for pid in p.splits[s]["prompt_ids"]} for s in records.SPLITS}
    leaked = prompts_by_split["train"] & prompts_by_split["heldout"]
    if leaked:
        raise AssertionError(f"prompt_ids in both splits: {sorted(leaked)[:5]}")

    split_info = {s: _write_index(out_dir, s, parts) for s in records.SPLITS}
    train_labels = np.asarray([lab for p in parts for lab in p.splits["train"]["index"]["label"]])
    n_fail, n_pass = int((train_labels == 1).sum()), int((train_labels == 0).sum())
    oversampling = {"factor": opts.oversample_fail, "split": "train", "train_fail": n_fail, "train_pass": n_pass,
                    "stream_fail": n_fail * opts.oversample_fail,
                    "stream_total": n_pass + n_fail * opts.oversample_fail}
    text_lengths = [n for p in parts for n in p.text_lengths]
    total_lengths = [n for p in parts for n in p.total_lengths]
    too_long = sum(len(p.too_long_lengths) for p in parts)
    flagged = collections.Counter()
    balance = {r: {"pass": 0, "fail": 0} for r in (ROUTE_TOOL_CALL, ROUTE_TEXT_ONLY)}
    for p in parts:
        flagged.update(p.flagged)
        for route, b in p.balance.items():
            for verdict, n in b.items():
                balance[route][verdict] += n
    rendered = kept + too_long
    stats = {
        "read": read, "kept": kept, "rejected": len(rejects),
        "rejected_by_reason": dict(sorted(collections.Counter(r["reason"] for r in rejects).items())),
        "flagged_by_reason": dict(sorted(flagged.items())),
        "lengths": {"text_tokens_median": _pct(text_lengths, 50), "text_tokens_p99": _pct(text_lengths, 99),
                    "text_tokens_max": int(max(text_lengths)), "total_tokens_median": _pct(total_lengths, 50),
                    "total_tokens_max": int(max(total_lengths)), "max_len": opts.max_len},
        "images": {"count": sum(p.n_images for p in parts),
                   "image_tokens_total": sum(p.image_tokens for p in parts)},
        "over_max_len_share": too_long / rendered if rendered else 0.0,
        "label_balance": balance,
        "splits": {s: {"examples": split_info[s]["examples"], "prompts": len(prompts_by_split[s])}
                   for s in records.SPLITS},
        "oversampling": oversampling,
        "chunks": len(parts),
    }
    manifest = {
        "input": os.path.abspath(input_path),
        "input_sha256": plan.input_sha256,
        "tokenizer_dir": plan.tokenizer_dir,
        "tokenizer_sha256": tree_sha256(plan.tokenizer_dir) if plan.tokenizer_dir else None,
        "chat_template_sha256": _template_sha(renderer),
        "config": plan.config_dict,
        "build_options": dataclasses.asdict(opts),
        "build_fingerprint": plan.fingerprint,
        "verdict_tokens": dataclasses.asdict(renderer.verdict),
        "scoring_prefix_ids": renderer.scoring_prefix_ids(),
        "field_order": list(renderer.cfg.field_order),
        "image_pad_id": int(renderer.image_pad_id),
        "patch_dim": int(renderer.image_pre.patch_dim),
        "pad_id": int(renderer.tokenizer.pad_token_id if renderer.tokenizer.pad_token_id is not None else 0),
        "eos_id": int(renderer.eos_id),
        "splits": split_info,
        "oversampling": oversampling,
        "packages": package_versions(),
    }
    _write_rejects(out_dir, rejects)
    _write_json(os.path.join(out_dir, "stats.json"), stats)
    _write_json(os.path.join(out_dir, "manifest.json"), manifest)   # last: its presence means "complete"
    return BuildResult(stats, manifest, out_dir)


def _write_index(out_dir: str, split: str, parts: list[build_chunks.ChunkPart]) -> dict:
    """The split's index over all chunks; `prompt` numbers its prompt_ids in first-seen order."""
    shards = [name for p in parts for name in p.splits[split]["shards"]]
    if not shards:   # an empty split still gets one (empty) shard so readers need no case
        name = f"{build_chunks.chunk_shard_prefix(split, 0)}000.array_record"
        ArrayRecordWriter(os.path.join(out_dir, name), "group_size:1").close()
        shards = [name]
    numbers: dict[str, int] = {}
    prompt = [numbers.setdefault(pid, len(numbers)) for p in parts for pid in p.splits[split]["prompt_ids"]]
    cols = {k: np.asarray([v for p in parts for v in p.splits[split]["index"][k]], np.int32).reshape(-1)
            for k in build_chunks.INDEX_ROW_FIELDS}
    cols["prompt"] = np.asarray(prompt, np.int32).reshape(-1)
    np.savez(records.index_path(out_dir, split), **{k: cols[k] for k in records.INDEX_FIELDS})
    return {"examples": len(prompt), "shards": shards}


def _remove_stale(out_dir: str, parts: list[build_chunks.ChunkPart]) -> None:
    """Shards no chunk of this build wrote (an earlier build's, e.g. with more lines), and parts
    beyond this input's last chunk."""
    ours = {name for p in parts for s in records.SPLITS for name in p.splits[s]["shards"]}
    part_names = {os.path.basename(build_chunks.part_path(out_dir, p.chunk)) for p in parts}
    stale = [f for f in os.listdir(out_dir)
             if f not in ours and any(records.is_shard_file(f, s) for s in records.SPLITS)]
    stale_parts = [f for f in os.listdir(os.path.join(out_dir, build_chunks.PARTS_DIR))
                   if f.startswith("chunk-") and f not in part_names]
    for f in stale:
        os.remove(os.path.join(out_dir, f))
    for f in stale_parts:
        os.remove(os.path.join(out_dir, build_chunks.PARTS_DIR, f))
    if stale or stale_parts:
        logging.warning("%s: removed %d shards and %d parts of an earlier build", out_dir, len(stale),
                        len(stale_parts))


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(tmp, path)


def _write_rejects(out_dir: str, rejects: list[dict]) -> None:
    with open(os.path.join(out_dir, "rejects.jsonl"), "w") as f:
        for r in rejects:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def format_stats(stats: dict) -> str:
    lines = [f"read {stats['read']}  kept {stats['kept']}  rejected {stats['rejected']}"]
    for reason, n in stats["rejected_by_reason"].items():
        lines.append(f"  rejected {reason:<20} {n}")
    for reason, n in stats["flagged_by_reason"].items():
        lines.append(f"  flagged  {reason:<20} {n}")
    L = stats["lengths"]
    lines.append(f"text tokens: median {L['text_tokens_median']:.0f}  p99 {L['text_tokens_p99']:.0f}  "
                 f"max {L['text_tokens_max']}  (max_len {L['max_len']}, over: {stats['over_max_len_share']:.1%})")
    lines.append(f"images {stats['images']['count']}  image tokens {stats['images']['image_tokens_total']}")
    for route, b in stats["label_balance"].items():
        n = b["pass"] + b["fail"]
        lines.append(f"  {route:<10} pass {b['pass']:>6}  fail {b['fail']:>5}  ({b['fail'] / n if n else 0:.1%} fail)")
    for s, v in stats["splits"].items():
        lines.append(f"split {s:<8} {v['examples']} examples, {v['prompts']} prompts")
    o = stats["oversampling"]
    lines.append(f"oversampling x{o['factor']} (train only): {o['train_fail']} fail -> {o['stream_fail']} "
                 f"in a stream of {o['stream_total']}")
    return "\n".join(lines)
