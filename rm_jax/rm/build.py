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

Output, per split ``train`` / ``calibration`` / ``heldout``: ``{split}.npz`` (candidate tokens
concatenated with offsets, images likewise, pair arrays indexing candidates of that split) and
``{split}.groups.jsonl`` (per prompt: id, prompt_id, slice, candidate ids, utilities).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os

import numpy as np

from rm_jax.data.schema import Reject, SampleError
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
    def __init__(self):
        self.cands: list[RenderedCandidate] = []
        self.cand_group: list[int] = []
        self.utility: list[float] = []
        self.pairs: list[tuple] = []
        self.groups: list[dict] = []

    def add(self, rec: PreferenceRecord, rendered: list[RenderedCandidate], kept_pairs) -> None:
        used = sorted({i for q in kept_pairs for i in (q.a, q.b)})
        base = len(self.cands)
        local = {i: base + k for k, i in enumerate(used)}
        g = len(self.groups)
        for i in used:
            self.cands.append(rendered[i])
            self.cand_group.append(g)
            u = rec.utilities[i]
            self.utility.append(np.nan if u is None else u)
        for q in kept_pairs:
            self.pairs.append((local[q.a], local[q.b], q.p, q.weight, q.margin, g))
        self.groups.append({"id": rec.id, "prompt_id": rec.prompt_id, "slice": rec.slice,
                            "candidates": [rendered[i].id for i in used],
                            "utilities": [None if rec.utilities[i] is None else rec.utilities[i] for i in used],
                            "sources": [rec.sources[i] if rec.sources else None for i in used]})

    def write(self, out_dir: str, split: str) -> None:
        c = self.cands
        lens = lambda xs: np.cumsum([0] + [len(x) for x in xs]).astype(np.int64)
        tokens = [np.concatenate([x.prompt_ids, x.response_ids]) for x in c]
        pix = [x.pixel_values for x in c]
        pdim = next((p.shape[1] for p in pix if p.size), 1)
        pairs = np.asarray(self.pairs, np.float64).reshape(-1, 6)
        np.savez(os.path.join(out_dir, f"{split}.npz"),
                 tokens=np.concatenate(tokens).astype(np.int32) if tokens else np.zeros(0, np.int32),
                 offsets=lens(tokens), prompt_len=np.asarray([len(x.prompt_ids) for x in c], np.int32),
                 response_len=np.asarray([len(x.response_ids) for x in c], np.int32),
                 pixels=np.concatenate([p.reshape(-1, pdim) for p in pix]).astype(np.float16) if pix
                 else np.zeros((0, pdim), np.float16),
                 pix_offsets=lens(pix),
                 grids=np.concatenate([x.image_grid_thw for x in c]).astype(np.int32) if c else np.zeros((0, 3), np.int32),
                 grid_offsets=lens([x.image_grid_thw for x in c]),
                 group=np.asarray(self.cand_group, np.int32), utility=np.asarray(self.utility, np.float64),
                 pair_a=pairs[:, 0].astype(np.int32), pair_b=pairs[:, 1].astype(np.int32),
                 pair_p=pairs[:, 2].astype(np.float32), pair_w=pairs[:, 3].astype(np.float32),
                 pair_m=pairs[:, 4].astype(np.float32), pair_group=pairs[:, 5].astype(np.int32))
        with open(os.path.join(out_dir, f"{split}.groups.jsonl"), "w", encoding="utf-8") as f:
            for g in self.groups:
                f.write(json.dumps(g, ensure_ascii=False) + "\n")


def build(input_path: str, out_dir: str, renderer: RMRenderer, opts: PairBuildOptions, *,
          tokenizer_dir: str | None = None) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    writers = {s: _SplitWriter() for s in SPLITS}
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
    for s, w in writers.items():
        w.write(out_dir, s)
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
        "splits": {s: {"prompts": len(w.groups), "candidates": len(w.cands), "pairs": len(w.pairs),
                       "ties": sum(p[2] == 0.5 for p in w.pairs),
                       "soft": sum(0 < p[2] < 1 and p[2] != 0.5 for p in w.pairs)} for s, w in writers.items()},
        "max_length": max((c.length for w in writers.values() for c in w.cands), default=0),
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
                "system_prompt": renderer.system, "eos_token_id": renderer.eos_id,
                "pad_token_id": renderer.tokenizer.pad_token_id, "padding_side": "right",
                "chat_template_sha256": hashlib.sha256(renderer.template_probe().encode()).hexdigest(),
                "tokenizer_dir": os.path.abspath(tokenizer_dir) if tokenizer_dir else None,
                "tokenizer_sha256": tree_sha256(tokenizer_dir) if tokenizer_dir else None}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return stats
