"""Build: preference JSONL -> rendered candidates and pairs per split, stats, rejects, manifest.

* Every line is kept or rejected with a reason; every pair is kept or filtered with a reason.
  Over-length pairs are *filtered, never truncated* (a truncated answer's last hidden state no
  longer represents it, and the label may not hold for what is left). The counts are the
  reference text's list: prompt / chosen / rejected truncation rates (the share of pairs in which
  that part would have had to be cut), the overlength filter rate, the missing-EOS rate, the
  different-side truncation rate.
* The shared prompt prefix is asserted token-identical across a prompt's candidates
  (``prefix_mismatch`` rejects the whole group otherwise).
* Splits are by ``prompt_id`` (a stable hash): all candidates and pairs of a prompt are in one
  split, and a calibration split is kept apart from held-out (the temperature is fitted there
  and frozen, never on held-out).

Output, per split ``train`` / ``calibration`` / ``heldout``: ArrayRecord shards of one record per
prompt group (rm_jax.rm.pair_records: candidate tokens, images, the group's pairs) written as the
input is read, and ``{split}_pairs_index.npz`` (per-group counts).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os

import numpy as np

from rm_jax.data.schema import Reject, SampleError
from rm_jax.rm import pair_records
from rm_jax.rm.prefs import PreferenceRecord, read_records
from rm_jax.rm.render import REWARD_POSITION_RULE, RenderedCandidate, RMRenderer
from rm_jax.utils import file_sha256, tree_sha256

SPLITS = ("train", "calibration", "heldout")


@dataclasses.dataclass(frozen=True)
class PairBuildOptions:
    max_len: int
    heldout_fraction: float = 0.15
    calibration_fraction: float = 0.15
    split_seed: int = 0

    @classmethod
    def from_config(cls, data_cfg) -> "PairBuildOptions":
        return cls(max_len=int(data_cfg.max_len), heldout_fraction=float(data_cfg.heldout_fraction),
                   calibration_fraction=float(data_cfg.calibration_fraction), split_seed=int(data_cfg.split_seed))


def split_of(prompt_id: str, opts: PairBuildOptions) -> str:
    u = int.from_bytes(hashlib.sha256(f"{opts.split_seed}:{prompt_id}".encode()).digest()[:8], "big") / 2.0 ** 64
    if u < opts.heldout_fraction:
        return "heldout"
    return "calibration" if u < opts.heldout_fraction + opts.calibration_fraction else "train"


class _SplitWriter:
    """One split's group records (rm_jax.rm.pair_records), written as they come."""

    def __init__(self, out_dir: str, split: str):
        self.shards = pair_records.GroupShardWriter(out_dir, split)
        self.n_groups = self.n_candidates = 0
        self.n_ties = self.n_soft = self.n_pairs = 0
        self.max_length = 0

    def add(self, rec: PreferenceRecord, rendered: list[RenderedCandidate], kept_pairs) -> None:
        used = sorted({i for q in kept_pairs for i in (q.a, q.b)})
        local = {i: k for k, i in enumerate(used)}
        c = [rendered[i] for i in used]
        lens = lambda xs: np.cumsum([0] + [len(x) for x in xs]).astype(np.int64)
        tokens = [np.concatenate([x.prompt_ids, x.response_ids]) for x in c]
        pix = [x.pixel_values for x in c]
        pdim = next((p.shape[1] for p in pix if p.size), 1)
        self.shards.write({
            "id": rec.id, "prompt_id": rec.prompt_id, "slice": rec.slice,
            "candidates": [x.id for x in c],
            "utility": np.asarray([np.nan if rec.utilities[i] is None else rec.utilities[i] for i in used], np.float64),
            "sources": [rec.sources[i] if rec.sources else None for i in used],
            "tokens": np.concatenate(tokens).astype(np.int32), "offsets": lens(tokens),
            "prompt_len": np.asarray([len(x.prompt_ids) for x in c], np.int32),
            "response_len": np.asarray([len(x.response_ids) for x in c], np.int32),
            "pixels": np.concatenate([p.reshape(-1, pdim) for p in pix]).astype(np.float16),
            "pix_offsets": lens(pix),
            "grids": np.concatenate([x.image_grid_thw for x in c]).astype(np.int32).reshape(-1, 3),
            "grid_offsets": lens([x.image_grid_thw for x in c]),
            "pair_a": np.asarray([local[q.a] for q in kept_pairs], np.int32),
            "pair_b": np.asarray([local[q.b] for q in kept_pairs], np.int32),
            "pair_p": np.asarray([q.p for q in kept_pairs], np.float32),
            "pair_w": np.asarray([q.weight for q in kept_pairs], np.float32),
            "pair_m": np.asarray([q.margin for q in kept_pairs], np.float32)})
        self.n_groups += 1
        self.n_candidates += len(c)
        self.n_pairs += len(kept_pairs)
        self.n_ties += sum(q.p == 0.5 for q in kept_pairs)
        self.n_soft += sum(0 < q.p < 1 and q.p != 0.5 for q in kept_pairs)
        self.max_length = max([self.max_length] + [x.length for x in c])

    def finish(self) -> dict:
        shards = self.shards.finish()
        return {"prompts": self.n_groups, "candidates": self.n_candidates, "pairs": self.n_pairs,
                "ties": self.n_ties, "soft": self.n_soft, "shards": shards["shards"]}


def build(input_path: str, out_dir: str, renderer: RMRenderer, opts: PairBuildOptions, *,
          tokenizer_dir: str | None = None) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    for path in pair_records.stale_outputs(out_dir, SPLITS):   # a rebuild leaves no earlier shard behind
        os.remove(path)
    writers = {s: _SplitWriter(out_dir, s) for s in SPLITS}
    rejects: list[Reject] = []
    n = collections.Counter()
    pair_filtered = collections.Counter()
    for rec in read_records(input_path):
        n["lines"] += 1
        if isinstance(rec, Reject):
            rejects.append(rec)
            continue
        try:
            rendered = [renderer.render(c) for c in rec.candidates]
        except SampleError as e:
            rejects.append(Reject(rec.line, rec.id, e.reason, f"{e.field}: {e.detail}"))
            continue
        if any(not np.array_equal(r.prompt_ids, rendered[0].prompt_ids) for r in rendered):
            rejects.append(Reject(rec.line, rec.id, "prefix_mismatch",
                                  "candidates' prompt tokens differ (template or normalisation differs per candidate)"))
            continue
        n["candidates"] += len(rendered)
        n["missing_eos"] += sum(not r.has_eos for r in rendered)
        prompt_len = len(rendered[0].prompt_ids)
        kept = []
        for q in rec.pairs:
            n["pairs"] += 1
            ch, rj = (q.a, q.b) if q.p >= 0.5 else (q.b, q.a)
            over_c, over_r = rendered[ch].length > opts.max_len, rendered[rj].length > opts.max_len
            n["prompt_truncation"] += prompt_len >= opts.max_len
            n["chosen_truncation"] += over_c
            n["rejected_truncation"] += over_r
            n["different_side_truncation"] += over_c != over_r
            if not (rendered[q.a].has_eos and rendered[q.b].has_eos):
                pair_filtered["missing_eos"] += 1
            elif over_c or over_r:
                pair_filtered["overlength"] += 1
            else:
                kept.append(q)
        if not kept:
            rejects.append(Reject(rec.line, rec.id, "no_pairs_kept", "every pair was filtered (overlength / missing_eos)"))
            continue
        split = split_of(rec.prompt_id, opts)
        writers[split].add(rec, rendered, kept)
        n["kept_lines"] += 1
    splits = {s: w.finish() for s, w in writers.items()}
    total_pairs = max(n["pairs"], 1)
    rej_reasons = collections.Counter(r.reason for r in rejects)
    stats = {
        "read": n["lines"], "kept": n["kept_lines"], "rejected": len(rejects),
        "rejected_by_reason": dict(rej_reasons),
        "pairs_read": n["pairs"], "pairs_kept": n["pairs"] - sum(pair_filtered.values()),
        "pairs_filtered_by_reason": dict(pair_filtered),
        "prompt_truncation_rate": n["prompt_truncation"] / total_pairs,
        "chosen_truncation_rate": n["chosen_truncation"] / total_pairs,
        "rejected_truncation_rate": n["rejected_truncation"] / total_pairs,
        "different_side_truncation_rate": n["different_side_truncation"] / total_pairs,
        "overlength_filter_rate": pair_filtered["overlength"] / total_pairs,
        "missing_eos_rate": n["missing_eos"] / max(n["candidates"], 1),
        "splits": {s: {k: v for k, v in info.items() if k != "shards"} for s, info in splits.items()},
        "max_length": max(w.max_length for w in writers.values()),
        "max_len": opts.max_len,
    }
    assert stats["read"] == stats["kept"] + stats["rejected"]
    with open(os.path.join(out_dir, "stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    with open(os.path.join(out_dir, "rejects.jsonl"), "w") as f:
        for r in rejects:
            f.write(json.dumps(r.to_json()) + "\n")
    manifest = {"input": os.path.abspath(input_path), "data_sha256": file_sha256(input_path),
                "options": dataclasses.asdict(opts), "reward_position_rule": REWARD_POSITION_RULE,
                "format": "pair_groups_array_record", "shards": {s: info["shards"] for s, info in splits.items()},
                "system_prompt": renderer.system, "eos_token_id": renderer.eos_id,
                "pad_token_id": renderer.tokenizer.pad_token_id, "padding_side": "right",
                "chat_template_sha256": hashlib.sha256(renderer.template_probe().encode()).hexdigest(),
                "tokenizer_dir": os.path.abspath(tokenizer_dir) if tokenizer_dir else None,
                "tokenizer_sha256": tree_sha256(tokenizer_dir) if tokenizer_dir else None}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return stats
