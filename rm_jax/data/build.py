"""Build: samples.jsonl -> tokenized, loss-masked, split ArrayRecord shards + stats + rejects.

Every input row ends up kept or rejected with a reason (read = kept + rejected; the counts are
asserted before anything is written as final). Over-length samples are rejected as
``too_long`` — never truncated, because a truncated sample loses its verdict target.

Splits are by ``prompt_id`` (a stable hash, so adding rows never moves a prompt across the
split); the held-out split is never duplicated. Failures are oversampled in the training
*stream* by the loader, from the factor recorded here, so the shards hold each example once.
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

from rm_jax.data import records, value_swap
from rm_jax.data.render import ROUTE_TEXT_ONLY, ROUTE_TOOL_CALL, JudgeInput, Renderer
from rm_jax.data.schema import Reject, Sample, SampleError, read_samples
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


def split_of(prompt_id: str, heldout_fraction: float, seed: int) -> str:
    h = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()
    u = int.from_bytes(h[:8], "big") / 2.0 ** 64
    return "heldout" if u < heldout_fraction else "train"


def _pct(values: list[int], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


@dataclasses.dataclass
class BuildResult:
    stats: dict
    manifest: dict
    out_dir: str


def build(input_path: str, out_dir: str, renderer: Renderer, opts: BuildOptions, *,
          config_dict: dict | None = None, tokenizer_dir: str | None = None, progress: bool = True) -> BuildResult:
    from tqdm import tqdm

    t0 = time.time()
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--out={out_dir} is a file, not a directory")
    os.makedirs(out_dir, exist_ok=True)
    # A rebuild into the same folder must not leave the earlier build's shards behind: readers
    # take every `{split}-*.array_record` there (other files in the folder are left alone).
    stale = records.build_output_files(out_dir)
    for path in stale:
        os.remove(path)
    if stale:
        logging.warning("%s: removed %d files of an earlier build", out_dir, len(stale))
    pixel_dtype = np.dtype(opts.pixel_dtype)
    writers = {s: records.ShardWriter(out_dir, s, opts.shard_max_bytes, opts.shard_max_examples)
               for s in records.SPLITS}
    rejects: list[Reject] = []
    flagged = collections.Counter()
    read = 0
    too_long_lengths: list[int] = []
    text_lengths: list[int] = []
    total_lengths: list[int] = []
    image_tokens = n_images = 0
    balance = {r: {"pass": 0, "fail": 0} for r in (ROUTE_TOOL_CALL, ROUTE_TEXT_ONLY)}
    prompts_by_split: dict[str, set] = {s: set() for s in records.SPLITS}
    value_collector = value_swap.ClassCollector(renderer.tokenizer)   # train split only

    items = read_samples(input_path)
    for item in tqdm(items, desc="build", unit="sample", disable=not progress, mininterval=2.0):
        read += 1
        if isinstance(item, Reject):
            rejects.append(item)
            continue
        sample: Sample = item
        try:
            ex: JudgeInput = renderer.render(sample)
        except SampleError as e:
            rejects.append(Reject(sample.line, sample.id, e.reason,
                                  f"line {sample.line}, id {sample.id}, field {e.field}: {e.detail}"))
            continue
        except Exception as e:   # noqa: BLE001 -- one bad row is rejected with its reason, never fatal
            rejects.append(Reject(sample.line, sample.id, "render_error",
                                  f"line {sample.line}, id {sample.id}: {type(e).__name__}: {e}"))
            continue
        if ex.length > opts.max_len:
            too_long_lengths.append(ex.length)
            rejects.append(Reject(sample.line, sample.id, "too_long",
                                  f"line {sample.line}, id {sample.id}: {ex.length} tokens > max_len {opts.max_len}"))
            continue
        for f in ex.flags:
            flagged[f] += 1
        split = split_of(sample.prompt_id, opts.heldout_fraction, opts.split_seed)
        writers[split].write(ex, pixel_dtype)
        if split == "train":
            value_collector.add(sample, ex.input_ids, ex.response_span)
        prompts_by_split[split].add(sample.prompt_id)
        total_lengths.append(ex.length)
        text_lengths.append(ex.length - ex.n_image_tokens)
        image_tokens += ex.n_image_tokens
        n_images += int(ex.image_grid_thw.shape[0])
        balance[ex.route]["fail" if ex.label == 1 else "pass"] += 1

    kept = sum(len(w.rows) for w in writers.values())
    if read != kept + len(rejects):   # the invariant the stats promise
        raise AssertionError(f"row accounting broken: read {read} != kept {kept} + rejected {len(rejects)}")
    if kept == 0:
        _write_rejects(out_dir, rejects)
        raise ValueError(f"{input_path}: no valid rows out of {read}; see {out_dir}/rejects.jsonl")
    leaked = prompts_by_split["train"] & prompts_by_split["heldout"]
    if leaked:
        raise AssertionError(f"prompt_ids in both splits: {sorted(leaked)[:5]}")

    split_info = {s: w.finish() for s, w in writers.items()}
    train_labels = np.asarray([r["label"] for r in writers["train"].rows])
    n_fail, n_pass = int((train_labels == 1).sum()), int((train_labels == 0).sum())
    oversampling = {"factor": opts.oversample_fail, "split": "train", "train_fail": n_fail, "train_pass": n_pass,
                    "stream_fail": n_fail * opts.oversample_fail,
                    "stream_total": n_pass + n_fail * opts.oversample_fail}
    value_classes = value_collector.classes()
    rendered = kept + len(too_long_lengths)
    stats = {
        "read": read, "kept": kept, "rejected": len(rejects),
        "rejected_by_reason": dict(sorted(collections.Counter(r.reason for r in rejects).items())),
        "flagged_by_reason": dict(sorted(flagged.items())),
        "lengths": {"text_tokens_median": _pct(text_lengths, 50), "text_tokens_p99": _pct(text_lengths, 99),
                    "text_tokens_max": int(max(text_lengths)), "total_tokens_median": _pct(total_lengths, 50),
                    "total_tokens_max": int(max(total_lengths)), "max_len": opts.max_len},
        "images": {"count": n_images, "image_tokens_total": image_tokens},
        "over_max_len_share": len(too_long_lengths) / rendered if rendered else 0.0,
        "label_balance": balance,
        "splits": {s: {"examples": split_info[s]["examples"], "prompts": len(prompts_by_split[s])}
                   for s in records.SPLITS},
        "oversampling": oversampling,
        "value_classes": {"classes": len(value_classes.classes),
                          "tokens": sum(len(c) for c in value_classes.classes)},
        "seconds": round(time.time() - t0, 3),
    }
    manifest = {
        "input": os.path.abspath(input_path),
        "input_sha256": file_sha256(input_path),
        "tokenizer_dir": tokenizer_dir,
        "tokenizer_sha256": tree_sha256(tokenizer_dir) if tokenizer_dir else None,
        "chat_template_sha256": hashlib.sha256((renderer.tokenizer.chat_template or "").encode()).hexdigest(),
        "config": config_dict or {},
        "build_options": dataclasses.asdict(opts),
        "verdict_tokens": dataclasses.asdict(renderer.verdict),
        "scoring_prefix_ids": renderer.scoring_prefix_ids(),
        "field_order": list(renderer.cfg.field_order),
        "image_pad_id": int(renderer.image_pad_id),
        "patch_dim": int(renderer.image_pre.patch_dim),
        "pad_id": int(renderer.tokenizer.pad_token_id if renderer.tokenizer.pad_token_id is not None else 0),
        "eos_id": int(renderer.eos_id),
        "splits": split_info,
        "oversampling": oversampling,
        # interchangeable single-token argument values (rm_jax.data.value_swap; train.value_check_*)
        "value_classes": value_classes.to_json(),
        "packages": package_versions(),
    }
    _write_rejects(out_dir, rejects)
    with open(os.path.join(out_dir, "stats.json"), "w") as f:
        json.dump(stats, f, indent=2)
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2, default=str)
    return BuildResult(stats, manifest, out_dir)


def _write_rejects(out_dir: str, rejects: list[Reject]) -> None:
    with open(os.path.join(out_dir, "rejects.jsonl"), "w") as f:
        for r in rejects:
            f.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")


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
