"""Active selection: which scored samples the teacher labels next.

The iterative loop labels what the current judge is least sure of, and what two judges (two
checkpoints, two runs) disagree on, from the new policy's outputs:

1. **Middle zone first**: P(pass) in [0.2, 0.8] under the first score file, closest to 0.5 first.
2. **Then disagreement** (with a second score file): each file's verdict logit
   z = logit(P(pass)) is standardised on a shared anchor set (the ids both files scored), so a
   judge that is merely more confident overall does not look like one that disagrees; the
   largest |z1 - z2| first. With one file, the rest by closeness to 0.5.
3. **Stratified by route**: the budget is split between tool-call and text-only responses in
   proportion to their share of the candidates (largest remainders); a route that runs out
   passes its leftover to the other.
4. **Near-duplicates of one prompt dropped**: a response whose normalised text (content and
   calls, lowercased, whitespace collapsed) has a character-trigram Jaccard similarity >= 0.9 with
   one already selected for the same prompt is skipped, so the teacher's budget is not spent
   twice on one answer.

The output rows are the input rows (label removed, image paths rewritten for the output's
folder), i.e. a valid ``launch.label`` input; ``OUT.stats.json`` says why each id was picked.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Sequence

import numpy as np

from rm_jax.data.schema import Reject, Sample, read_rows

MIDDLE_ZONE = (0.2, 0.8)
NEAR_DUPLICATE = 0.9
ROUTES = ("tool_call", "text_only")
EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Candidate:
    id: str
    prompt_id: str
    route: str
    p_pass: float                     # first score file
    disagreement: float               # |z1 - z2| after anchor standardisation; nan with one file
    text: str                         # normalised response text (near-duplicate check)

    @property
    def in_middle_zone(self) -> bool:
        return MIDDLE_ZONE[0] <= self.p_pass <= MIDDLE_ZONE[1]


def read_scores(path: str) -> tuple[dict[str, float], int]:
    """{id: p_pass} of a ``launch.score`` file, and the count of its error rows."""
    scores, errors = {}, 0
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "error" in row or row["p_pass"] is None or not math.isfinite(row["p_pass"]):
                errors += 1
                continue
            if row["id"] in scores:
                raise ValueError(f"{path}:{n}: id {row['id']!r} is scored twice")
            scores[row["id"]] = float(row["p_pass"])
    return scores, errors


def scores_input(path: str) -> str:
    """The samples file a ``launch.score`` output scored (its ``.meta.json`` sidecar)."""
    meta = path + ".meta.json"
    if not os.path.isfile(meta):
        raise FileNotFoundError(f"{meta}: not found; pass --input=the samples JSONL that {path} scored")
    with open(meta) as f:
        return json.load(f)["input"]


def _logit(p: np.ndarray) -> np.ndarray:
    q = np.clip(p, EPS, 1 - EPS)
    return np.log(q) - np.log1p(-q)


def standardised_disagreement(first: dict[str, float], second: dict[str, float]) -> dict[str, float]:
    """|z1 - z2| per shared id, each file's logit standardised by its own mean and std over the
    shared (anchor) ids."""
    anchors = sorted(set(first) & set(second))
    if len(anchors) < 2:
        raise ValueError(f"the two score files share {len(anchors)} scored ids; standardising needs at least 2")
    z = []
    for scores in (first, second):
        x = _logit(np.asarray([scores[i] for i in anchors], np.float64))
        sd = x.std()
        z.append((x - x.mean()) / (sd if sd > 0 else 1.0))
    return dict(zip(anchors, np.abs(z[0] - z[1]).tolist()))


def response_text(sample: Sample) -> str:
    calls = [json.dumps({"name": c.name, "arguments": c.arguments}, sort_keys=True, ensure_ascii=False)
             for c in sample.response.tool_calls]
    return re.sub(r"\s+", " ", " ".join([sample.response.content or "", *calls]).lower()).strip()


def _trigrams(text: str) -> set[str]:
    return {text[i:i + 3] for i in range(max(1, len(text) - 2))}


def near_duplicate(a: str, b: str, threshold: float = NEAR_DUPLICATE) -> bool:
    ta, tb = _trigrams(a), _trigrams(b)
    return len(ta & tb) / max(1, len(ta | tb)) >= threshold


def allocate(budget: int, sizes: dict[str, int]) -> dict[str, int]:
    """Budget per route in proportion to its candidates (largest remainders), capped by them."""
    total = sum(sizes.values())
    if total == 0:
        return {r: 0 for r in sizes}
    budget = min(budget, total)
    exact = {r: budget * n / total for r, n in sizes.items()}
    out = {r: int(math.floor(v)) for r, v in exact.items()}
    for r in sorted(sizes, key=lambda r: exact[r] - out[r], reverse=True)[:budget - sum(out.values())]:
        out[r] += 1
    return out


def _ranked(cands: Sequence[Candidate], two_files: bool) -> list[tuple[Candidate, str]]:
    """(candidate, why) in selection order: middle zone, then disagreement (or uncertainty)."""
    mid = sorted((c for c in cands if c.in_middle_zone), key=lambda c: (abs(c.p_pass - 0.5), c.id))
    rest = [c for c in cands if not c.in_middle_zone]
    if two_files:
        rest = sorted(rest, key=lambda c: (-c.disagreement, c.id))
        return [(c, "middle_zone") for c in mid] + [(c, "disagreement") for c in rest]
    rest = sorted(rest, key=lambda c: (abs(c.p_pass - 0.5), c.id))
    return [(c, "middle_zone") for c in mid] + [(c, "uncertainty") for c in rest]


def select(candidates: Sequence[Candidate], budget: int, two_files: bool) -> tuple[list[tuple[Candidate, str]], int]:
    """The picked (candidate, why), route-stratified, near-duplicates of one prompt skipped; and
    how many near-duplicates were skipped on the way."""
    by_route = {r: _ranked([c for c in candidates if c.route == r], two_files) for r in ROUTES}
    quota = allocate(budget, {r: len(v) for r, v in by_route.items()})
    picked: list[tuple[Candidate, str]] = []
    kept_text: dict[str, list[str]] = {}
    skipped = 0
    cursor = {r: 0 for r in ROUTES}

    def take(route: str, n: int) -> int:
        nonlocal skipped
        got = 0
        ranked = by_route[route]
        while got < n and cursor[route] < len(ranked):
            c, why = ranked[cursor[route]]
            cursor[route] += 1
            if any(near_duplicate(c.text, t) for t in kept_text.get(c.prompt_id, [])):
                skipped += 1
                continue
            kept_text.setdefault(c.prompt_id, []).append(c.text)
            picked.append((c, why))
            got += 1
        return got

    short = sum(quota[r] - take(r, quota[r]) for r in ROUTES)
    for r in ROUTES:               # a route that ran out leaves its budget to the other
        if short:
            short -= take(r, short)
    return picked, skipped


def select_file(score_paths: Sequence[str], budget: int, out_path: str, *, input_path: str = "") -> dict:
    """``launch.select``: read the score file(s) and the samples they scored, write the picked
    samples' rows (a ``launch.label`` input) to ``out_path`` and ``out_path.stats.json``."""
    from rm_jax.label.rebase import ImageRebase
    if not 1 <= len(score_paths) <= 2:
        raise ValueError(f"--scores takes one or two files, got {len(score_paths)}")
    if budget < 1:
        raise ValueError(f"--budget={budget}: must be >= 1")
    input_path = input_path or scores_input(score_paths[0])
    loaded = [read_scores(p) for p in score_paths]
    first = loaded[0][0]
    gap = standardised_disagreement(first, loaded[1][0]) if len(loaded) == 2 else {}
    rows: dict[str, dict] = {}
    candidates, rejected, not_scored = [], 0, 0
    for item, raw in read_rows(input_path, require_label=False):
        if isinstance(item, Reject):
            rejected += 1
            continue
        if item.id not in first or (gap and item.id not in gap):
            not_scored += 1
            continue
        rows[item.id] = json.loads(raw)
        candidates.append(Candidate(item.id, item.prompt_id, "tool_call" if item.response.calls_tools else "text_only",
                                    first[item.id], gap[item.id] if gap else math.nan, response_text(item)))
    picked, skipped = select(candidates, budget, two_files=bool(gap))
    rebase = ImageRebase(os.path.dirname(os.path.abspath(input_path)), os.path.dirname(os.path.abspath(out_path)))
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        for c, _ in picked:
            row = {k: v for k, v in rebase.row(rows[c.id]).items() if k not in ("label", "label_meta")}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    why: dict[str, int] = {}
    routes: dict[str, int] = {r: 0 for r in ROUTES}
    for c, reason in picked:
        why[reason] = why.get(reason, 0) + 1
        routes[c.route] += 1
    stats = {"input": os.path.abspath(input_path), "scores": [os.path.abspath(p) for p in score_paths],
             "score_errors": [e for _, e in loaded], "budget": budget, "candidates": len(candidates),
             "input_rejected": rejected, "not_scored": not_scored, "selected": len(picked),
             "near_duplicates_skipped": skipped, "by_reason": why, "by_route": routes,
             "candidates_by_route": {r: sum(c.route == r for c in candidates) for r in ROUTES},
             "picked": [{"id": c.id, "route": c.route, "why": reason, "p_pass": c.p_pass,
                         "disagreement": None if math.isnan(c.disagreement) else c.disagreement}
                        for c, reason in picked]}
    with open(out_path + ".stats.json", "w") as f:
        json.dump(stats, f, indent=2)
    return stats
