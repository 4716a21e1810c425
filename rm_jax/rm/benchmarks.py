"""Readers for public RM benchmark formats, and accuracy as each benchmark defines it.

* ``rewardbench`` (v1): rows ``{id, prompt, chosen, rejected, subset}``; correct when
  r(chosen) > r(rejected) (strictly); reported per subset and as the mean over subsets.
* ``rewardbench2``: rows ``{id, prompt, chosen: [..], rejected: [..], subset}`` (best-of-4: one
  chosen, three rejected; the Ties subset several of each); correct when every chosen answer
  scores above every rejected one. (RewardBench 2's Ties score adds a margin term on top of that
  all-correct-above-all-incorrect accuracy; only the accuracy part is computed here.)
* ``vl_rewardbench``: rows ``{id, query, image, response: [r0, r1], human_ranking: [k0, k1]}``
  (lower rank is better), image a path relative to the file; correct when the better-ranked
  response scores higher.
* ``mm_rewardbench`` (Multimodal RewardBench): rows ``{id, Text, Image, Output1, Output2,
  Better: "Output1"|"Output2", Category}``; correct when the better output scores higher.

A row that cannot be read (bad JSON, missing field, missing image) is a *parse failure*: counted,
listed, and scored as wrong in ``accuracy_counting_failures`` (``accuracy`` is over parsed rows).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Callable

import numpy as np

from rm_jax.data.schema import Sample, SampleError, parse_sample

FORMATS = ("rewardbench", "rewardbench2", "vl_rewardbench", "mm_rewardbench")


@dataclasses.dataclass
class BenchItem:
    id: str
    subset: str
    samples: list[Sample]
    chosen: list[int]        # indices into samples
    rejected: list[int]


def _sample(rid: str, k: int, messages: list, response: str, line: int, base_dir: str) -> Sample:
    return parse_sample({"id": f"{rid}#{k}", "prompt_id": rid, "messages": messages,
                         "response": {"content": response, "tool_calls": []}},
                        line=line, base_dir=base_dir, require_label=False)


def _need(row: dict, key: str, kind=str):
    v = row.get(key)
    if not isinstance(v, kind) or (kind is str and not v) or (kind is list and not v):
        raise SampleError("missing_field", key, f"required {kind.__name__} field {key!r} missing or empty")
    return v


def _image_messages(text: str, image: str, base_dir: str) -> list:
    if not os.path.isfile(os.path.join(base_dir, image)) and not os.path.isfile(image):
        raise SampleError("missing_image", "image", f"no such image file: {image}")
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


def _parse(fmt: str, row: dict, line: int, base_dir: str) -> BenchItem:
    rid = str(row.get("id", f"line{line}"))
    if fmt == "rewardbench":
        msgs = [{"role": "user", "content": _need(row, "prompt")}]
        s = [_sample(rid, 0, msgs, _need(row, "chosen"), line, base_dir),
             _sample(rid, 1, msgs, _need(row, "rejected"), line, base_dir)]
        return BenchItem(rid, str(row.get("subset", "all")), s, [0], [1])
    if fmt == "rewardbench2":
        msgs = [{"role": "user", "content": _need(row, "prompt")}]
        ch, rj = _need(row, "chosen", list), _need(row, "rejected", list)
        s = [_sample(rid, k, msgs, t, line, base_dir) for k, t in enumerate(ch + rj)]
        return BenchItem(rid, str(row.get("subset", "all")), s, list(range(len(ch))),
                         list(range(len(ch), len(ch) + len(rj))))
    if fmt == "vl_rewardbench":
        msgs = _image_messages(_need(row, "query"), _need(row, "image"), base_dir)
        resp, rank = _need(row, "response", list), _need(row, "human_ranking", list)
        if len(resp) != 2 or len(rank) != 2 or rank[0] == rank[1]:
            raise SampleError("bad_pair", "human_ranking", "need 2 responses with 2 different ranks")
        s = [_sample(rid, k, msgs, t, line, base_dir) for k, t in enumerate(resp)]
        best = int(np.argmin(rank))
        return BenchItem(rid, str(row.get("category", row.get("subset", "all"))), s, [best], [1 - best])
    if fmt == "mm_rewardbench":
        msgs = _image_messages(_need(row, "Text"), _need(row, "Image"), base_dir)
        s = [_sample(rid, 0, msgs, _need(row, "Output1"), line, base_dir),
             _sample(rid, 1, msgs, _need(row, "Output2"), line, base_dir)]
        better = row.get("Better")
        if better not in ("Output1", "Output2"):
            raise SampleError("bad_label", "Better", f"Better must be 'Output1' or 'Output2', got {better!r}")
        b = 0 if better == "Output1" else 1
        return BenchItem(rid, str(row.get("Category", "all")), s, [b], [1 - b])
    raise ValueError(f"unknown benchmark format {fmt!r}; expected one of {FORMATS}")


def read(fmt: str, path: str) -> tuple[list[BenchItem], list[dict]]:
    """(items, parse failures {line, id, reason, detail}). JSONL, or a JSON list of rows."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown benchmark format {fmt!r}; expected one of {FORMATS}")
    base_dir = os.path.dirname(os.path.abspath(path))
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        rows = [(k + 1, json.dumps(r)) for k, r in enumerate(json.loads(text))]
    else:
        rows = [(k + 1, line) for k, line in enumerate(text.splitlines()) if line.strip()]
    items, failures = [], []
    for line, raw in rows:
        rid = None
        try:
            row = json.loads(raw)
            if not isinstance(row, dict):
                raise SampleError("bad_type", "<row>", "a row must be a JSON object")
            rid = row.get("id")
            items.append(_parse(fmt, row, line, base_dir))
        except json.JSONDecodeError as e:
            failures.append({"line": line, "id": None, "reason": "bad_json", "detail": str(e)})
        except SampleError as e:
            failures.append({"line": line, "id": rid, "reason": e.reason, "detail": f"{e.field}: {e.detail}"})
    return items, failures


def accuracy(fmt: str, items: list[BenchItem], failures: list[dict],
             score: Callable[[list[Sample]], np.ndarray]) -> dict:
    """Scores every item's samples with ``score`` (one call) and applies the format's rule."""
    flat = [s for it in items for s in it.samples]
    rewards = np.asarray(score(flat), np.float64) if flat else np.zeros(0)
    correct, k = [], 0
    by_subset = collections.defaultdict(list)
    for it in items:
        r = rewards[k:k + len(it.samples)]
        k += len(it.samples)
        ok = float(np.min(r[it.chosen]) > np.max(r[it.rejected]))
        correct.append(ok)
        by_subset[it.subset].append(ok)
    n_all = len(items) + len(failures)
    subsets = {s: {"accuracy": float(np.mean(v)), "n": len(v)} for s, v in sorted(by_subset.items())}
    return {"benchmark": fmt, "n": len(items), "parse_failures": len(failures), "failures": failures,
            "accuracy": float(np.mean(correct)) if correct else float("nan"),
            "accuracy_counting_failures": float(np.sum(correct) / n_all) if n_all else float("nan"),
            "subset_mean": float(np.mean([v["accuracy"] for v in subsets.values()])) if subsets else float("nan"),
            "by_subset": subsets}
