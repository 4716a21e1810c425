"""The preference contract: one JSONL line per prompt, its candidates, and the pairs they form.

    {"id", "prompt_id", "messages", "tools", "slice"?,
     "candidates": [{"response": {...}, "rank"?: int, "score"?: float, "source"?: str}],
     "pairs"?: [{"a": i, "b": j, "p": 0..1, "weight"?: w, "margin"?: m}],
     "annotators"?: [...]}

* ``p`` is P(candidate a is preferred to b): 1 or 0 hard, 0.5 a tie, anything between soft.
* Without ``pairs``, a (full or partial) ranking is expanded *within the prompt group*: every two
  candidates that both carry a ``rank`` (lower is better) give one pair, hard when the ranks differ
  and a tie (p = 0.5) when they are equal. Candidates without a rank take part in no pair.
* A candidate's *utility* (what ranking metrics and Best-of-N compare against) is its ``score``
  when given, else ``-rank``.
* Bad lines are recorded with a reason (``rm_jax.data.schema.Reject``), never dropped silently.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any, Iterator

import numpy as np

from rm_jax.data.schema import Reject, Sample, SampleError, parse_sample


@dataclasses.dataclass(frozen=True)
class PairLabel:
    a: int
    b: int
    p: float            # P(a preferred to b)
    weight: float = 1.0
    margin: float = 0.0

    @property
    def is_hard(self) -> bool:
        return self.p in (0.0, 1.0)

    @property
    def is_tie(self) -> bool:
        return self.p == 0.5


@dataclasses.dataclass(frozen=True)
class PreferenceRecord:
    id: str
    prompt_id: str
    line: int
    candidates: tuple[Sample, ...]      # each candidate as a sample (the shared prompt + its response)
    utilities: tuple[float | None, ...]
    pairs: tuple[PairLabel, ...]
    slice: str = "all"
    sources: tuple[str | None, ...] = ()


def expand_ranking(ranks: list[int | None]) -> list[PairLabel]:
    """All pairs among ranked candidates: hard for different ranks, ties for equal ones."""
    out = []
    for i, j in itertools.combinations(range(len(ranks)), 2):
        if ranks[i] is None or ranks[j] is None:
            continue
        p = 0.5 if ranks[i] == ranks[j] else float(ranks[i] < ranks[j])
        out.append(PairLabel(i, j, p))
    return out


def _number(obj: dict, key: str, field: str, default=None):
    v = obj.get(key, default)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v)):
        raise SampleError("bad_type", field, f"{key} must be a finite number, got {v!r}")
    return v


def _parse_pairs(raw: Any, n: int) -> list[PairLabel]:
    if not isinstance(raw, list):
        raise SampleError("bad_type", "pairs", "pairs must be a list")
    out = []
    for k, q in enumerate(raw):
        f = f"pairs[{k}]"
        if not isinstance(q, dict):
            raise SampleError("bad_type", f, "a pair must be an object")
        a, b = q.get("a"), q.get("b")
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a < n and 0 <= b < n and a != b):
            raise SampleError("bad_pair", f, f"a={a!r}, b={b!r} must be two different candidate indices < {n}")
        p = _number(q, "p", f)
        if p is None or not 0.0 <= p <= 1.0:
            raise SampleError("bad_pair", f, f"p must be in [0, 1], got {p!r}")
        w = _number(q, "weight", f, 1.0)
        if w <= 0:
            raise SampleError("bad_pair", f, f"weight must be > 0, got {w!r}")
        m = _number(q, "margin", f, 0.0)
        out.append(PairLabel(a, b, float(p), float(w), float(m)))
    return out


def parse_record(obj: Any, *, line: int, base_dir: str) -> PreferenceRecord:
    """Raises SampleError (reason, field, detail) for a bad line."""
    if not isinstance(obj, dict):
        raise SampleError("bad_type", "<line>", "a preference line must be a JSON object")
    cands = obj.get("candidates")
    if not isinstance(cands, list) or len(cands) < 2:
        raise SampleError("too_few_candidates", "candidates", "need a list of at least 2 candidates")
    rid = obj.get("id")
    if not isinstance(rid, str) or not rid:
        raise SampleError("missing_field", "id", "id must be a non-empty string")
    samples, utilities, ranks, sources = [], [], [], []
    for i, c in enumerate(cands):
        f = f"candidates[{i}]"
        if not isinstance(c, dict) or "response" not in c:
            raise SampleError("missing_field", f, "a candidate needs a response")
        rank = c.get("rank")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise SampleError("bad_type", f + ".rank", f"rank must be an integer, got {rank!r}")
        score = _number(c, "score", f)
        sample = parse_sample({"id": f"{rid}#c{i}", "prompt_id": obj.get("prompt_id", rid),
                               "messages": obj.get("messages"), "tools": obj.get("tools", []),
                               "response": c["response"]}, line=line, base_dir=base_dir, require_label=False)
        samples.append(sample)
        ranks.append(rank)
        utilities.append(float(score) if score is not None else (-float(rank) if rank is not None else None))
        sources.append(c.get("source"))
    pairs = _parse_pairs(obj["pairs"], len(cands)) if obj.get("pairs") is not None else expand_ranking(ranks)
    if not pairs:
        raise SampleError("no_pairs", "pairs", "no pairs given and fewer than 2 ranked candidates")
    sl = obj.get("slice", "all")
    return PreferenceRecord(id=rid, prompt_id=samples[0].prompt_id, line=line, candidates=tuple(samples),
                            utilities=tuple(utilities), pairs=tuple(pairs), slice=str(sl), sources=tuple(sources))


def read_records(path: str) -> Iterator[PreferenceRecord | Reject]:
    import os
    base_dir = os.path.dirname(os.path.abspath(path))
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            rid = None
            try:
                obj = json.loads(raw)
                rid = obj.get("id") if isinstance(obj, dict) else None
                yield parse_record(obj, line=line_no, base_dir=base_dir)
            except json.JSONDecodeError as e:
                yield Reject(line=line_no, id=None, reason="bad_json", detail=str(e))
            except SampleError as e:
                yield Reject(line=line_no, id=rid if isinstance(rid, str) else None, reason=e.reason,
                             detail=f"{e.field}: {e.detail}")
