"""Scoring with trained RM workdirs: the built splits (for rm_eval) and arbitrary samples
(benchmark files), through the same renderer, packing and jitted forward as training."""

from __future__ import annotations

import json
import os

import numpy as np

from rm_jax import run_config
from rm_jax.data.render import Renderer
from rm_jax.rm import benchmarks as bench_lib
from rm_jax.rm import data as data_lib
from rm_jax.rm import evaluate, train
from rm_jax.rm.render import RMRenderer


class TrainedRM:
    def __init__(self, workdir: str, step: int | None = None):
        with open(os.path.join(workdir, "manifest.json")) as f:
            self.manifest = json.load(f)
        self.cfg = run_config.parse(self.manifest["config"])
        self.builder, state, self.step, self.mcfg = train.restore_latest(self.cfg, workdir, step)
        self.params = state.params
        self.data_dir = self.manifest["data_dir"]
        dm = self.manifest["data_manifest"]
        self.pad_id = int(dm.get("pad_token_id") or 0)
        self.tokenizer_dir = dm.get("tokenizer_dir")
        self.length = int(self.manifest["run_length"])
        self._renderer = None

    def shape(self, length: int | None = None) -> data_lib.BatchShape:
        return train.batch_shape(self.cfg, self.mcfg, length or self.length)

    def score_split(self, split: data_lib.PairSplit) -> np.ndarray:
        longest = max((split.length(c) for c in range(split.n_candidates)), default=1)
        return data_lib.score_candidates(self.builder, self.params, split, self.shape(max(self.length, longest)),
                                         self.mcfg, self.pad_id)

    def score_samples(self, samples) -> np.ndarray:
        """Rewards of samples (their ``response`` as the candidate turn); NaN for one that cannot be
        rendered or is longer than data.max_len (never truncated)."""
        if self._renderer is None:
            self._renderer = RMRenderer(Renderer.from_config(self.cfg.data, self.tokenizer_dir, storage_dtype="float16"))
        rendered, keep = [], []
        for i, s in enumerate(samples):
            try:
                c = self._renderer.render(s)
            except Exception:  # noqa: BLE001 - a bad row scores NaN and is counted as wrong
                continue
            if c.length <= int(self.cfg.data.max_len):
                rendered.append(c)
                keep.append(i)
        out = np.full(len(samples), np.nan)
        if rendered:
            split = data_lib.split_from_rendered(rendered)
            length = max(c.length for c in rendered)
            buckets = sorted(int(b) for b in self.cfg.data.buckets)
            length = next((b for b in buckets if b >= length), length)
            out[keep] = data_lib.score_candidates(self.builder, self.params, split, self.shape(length), self.mcfg,
                                                  self.pad_id)
        return out


def eval_workdirs(workdirs: list[str], data_dir: str, out_dir: str, *, step: int | None = None,
                  benchmarks: list[str] = ()) -> dict:
    members, first = [], None
    for w in workdirs:
        rm = TrainedRM(w, step)
        first = first or rm
        d = data_dir or rm.data_dir
        rewards = {s: rm.score_split(data_lib.load_split(d, s)) for s in evaluate.EVAL_SPLITS}
        members.append((f"{os.path.basename(os.path.normpath(w))}@{rm.step}", rewards))
    report = evaluate.evaluate(members, data_dir or first.data_dir, out_dir)
    for spec in benchmarks:
        fmt, _, path = spec.partition(":")
        items, failures = bench_lib.read(fmt, path)
        res = bench_lib.accuracy(fmt, items, failures, first.score_samples)
        with open(os.path.join(out_dir, f"benchmark_{fmt}.json"), "w") as f:
            json.dump(res, f, indent=1)
        report.setdefault("benchmarks", {})[fmt] = {k: v for k, v in res.items() if k != "failures"}
    if benchmarks:
        with open(os.path.join(out_dir, "rm_eval.json"), "w") as f:
            json.dump(report, f, indent=1, default=float)
    return report
