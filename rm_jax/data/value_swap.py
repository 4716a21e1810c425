"""Swapped-value detection: a per-position training signal for the comparisons a verdict needs.

A judge decides a tool call by comparing each of its argument values with the request, a tool
result or an image. From the verdict alone that is one bit per sample for several values at once,
and a small judge does not learn *which* value to check (docs/experiments/, issue 16: the readout over
several repeated values). Given a label at each value's own position, the same model learns every
comparison, and then reads them out at the verdict slot, within a few hundred steps.

The labels come for free from passing responses (ELECTRA's replaced-token detection, on values):

* **Value classes** (build time, `collect`): for every argument of every call in the train split,
  the single tokens its values render as, e.g. ``{2K, 4K, 1K}`` for ``generate_image.resolution``.
  Classes that share a token are merged; a class needs two members. Multi-token values (free text,
  long numbers) form no class and are never swapped.
* **Swaps** (every step, `swap_batch`): in a passing example, one class token of the judged
  response (a call argument, or the same token in its text) is replaced by another member of its
  class. Each class token of a passing response is then a labelled position: 1 where swapped, 0
  elsewhere. A swapped example's target is dropped (its verdict is unknown); failing examples give
  no positions (which value is wrong is not recorded).

The term reads the verdict tokens' logits (``fail`` against ``pass``) at the value's own position,
so it needs no new parameters and the checkpoint exports unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Iterable, Sequence

import numpy as np

VALUE_OFF = -1        # value_target: not a labelled position
VALUE_KEPT = 0        # a class token left as the response wrote it
VALUE_SWAPPED = 1     # a class token replaced by another member of its class


@dataclasses.dataclass(frozen=True)
class ValueClasses:
    """Sets of interchangeable single-token values (token ids, each set sorted)."""
    classes: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        seen: set[int] = set()
        for c in self.classes:
            if len(c) < 2 or len(set(c)) != len(c):
                raise ValueError(f"a value class needs two or more distinct tokens, got {c}")
            if seen & set(c):
                raise ValueError("value classes must not share tokens")
            seen |= set(c)

    def to_json(self) -> list[list[int]]:
        return [list(c) for c in self.classes]

    @classmethod
    def from_json(cls, rows: Sequence[Sequence[int]]) -> "ValueClasses":
        return cls(tuple(tuple(int(t) for t in c) for c in rows))

    def lookup(self, vocab_size: int) -> np.ndarray:
        """[V] class index of each token id, -1 for tokens in no class."""
        table = np.full((vocab_size,), -1, np.int32)
        for k, c in enumerate(self.classes):
            table[np.asarray(c)] = k
        return table


def _scalar_text(value) -> str | None:
    if isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, (int, float, str)):
        return str(value)
    return None


class ClassCollector:
    """Accumulates, over the train split, the single tokens each (tool, argument) value renders as."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._by_arg: dict[tuple[str, str], set[int]] = {}
        self._decoded: dict[int, str] = {}

    def _text(self, token: int) -> str:
        if token not in self._decoded:
            self._decoded[token] = self.tokenizer.decode([token]).strip(' "')
        return self._decoded[token]

    def add(self, sample, input_ids: np.ndarray, response_span: tuple[int, int]) -> None:
        self.update(self.hits(sample, input_ids, response_span))

    def hits(self, sample, input_ids: np.ndarray, response_span: tuple[int, int]) -> list[tuple[str, str, int]]:
        """One sample's contribution: (tool, argument, the single token its value renders as)
        rows (a parallel build computes these in its workers and merges them with `update`)."""
        start, end = response_span
        if start < 0 or sample.response is None:
            return []
        tokens = [int(t) for t in input_ids[start:end]]
        found: list[tuple[str, str, int]] = []
        for call in sample.response.tool_calls:
            if not isinstance(call.arguments, dict):
                continue
            for arg, value in call.arguments.items():
                text = _scalar_text(value)
                if not text:
                    continue
                hits = {t for t in tokens if self._text(t) == text}
                if len(hits) == 1:
                    found.append((call.name, arg, hits.pop()))
        return found

    def update(self, hits: Iterable[Sequence]) -> None:
        for tool, arg, token in hits:
            self._by_arg.setdefault((tool, arg), set()).add(int(token))

    def classes(self) -> ValueClasses:
        # Union of the per-argument sets that share a token (the same value under two tools).
        merged: list[set[int]] = []
        for tokens in self._by_arg.values():
            overlapping = [m for m in merged if m & tokens]
            union = set(tokens).union(*overlapping)
            merged = [m for m in merged if not (m & tokens)] + [union]
        return ValueClasses(tuple(sorted(tuple(sorted(m)) for m in merged if len(m) >= 2)))


def collect(pairs: Iterable[tuple[object, np.ndarray, tuple[int, int]]], tokenizer) -> ValueClasses:
    """Value classes from (sample, input_ids, response_span) triples."""
    c = ClassCollector(tokenizer)
    for sample, ids, span in pairs:
        c.add(sample, ids, span)
    return c.classes()


@dataclasses.dataclass(frozen=True)
class SwapResult:
    input_ids: np.ndarray       # [B, T] with the swaps applied
    value_target: np.ndarray    # [B, T] int8: VALUE_OFF / VALUE_KEPT / VALUE_SWAPPED
    swapped: np.ndarray         # [B] bool: rows whose response was changed (their target is dropped)


def swap_batch(batch: dict, classes: ValueClasses, rate: float, key: Sequence[int], *, row_offset: int = 0,
               max_positions: int = 32, lookup: np.ndarray | None = None) -> SwapResult:
    """Swap one class token in a ``rate`` share of the batch's passing rows and label the class
    tokens of every passing row's response (at most ``max_positions`` a row: the swapped one and
    the first others). ``batch``: loader arrays (input_ids, example_valid, label, response_start,
    response_end). Row i draws from ``default_rng((*key, row_offset + i))``, so a row's swap
    depends on its place in the global batch, not on how many processes load it."""
    ids = np.array(batch["input_ids"], copy=True)
    b, t = ids.shape
    table = classes.lookup(max((max(c) for c in classes.classes), default=0) + 1) if lookup is None else lookup
    target = np.full((b, t), VALUE_OFF, np.int8)
    swapped = np.zeros((b,), bool)
    starts, ends = batch["response_start"], batch["response_end"]
    for i in range(b):
        if not batch["example_valid"][i] or batch["label"][i] != 0 or starts[i] < 0:
            continue
        lo, hi = int(starts[i]), int(ends[i])
        span = ids[i, lo:hi]
        cls_of = np.where(span < len(table), table[np.minimum(span, len(table) - 1)], -1)
        where = np.flatnonzero(cls_of >= 0)
        if not len(where):
            continue
        rng = np.random.default_rng((*key, row_offset + i))
        if rng.random() < rate:
            j = int(rng.choice(where))
            members = classes.classes[int(cls_of[j])]
            ids[i, lo + j] = int(rng.choice([m for m in members if m != span[j]]))
            labelled = [j] + [w for w in where if w != j][:max_positions - 1]
            target[i, lo + np.asarray(labelled)] = VALUE_KEPT
            target[i, lo + j] = VALUE_SWAPPED
            swapped[i] = True
        else:
            target[i, lo + where[:max_positions]] = VALUE_KEPT
    return SwapResult(ids, target, swapped)
