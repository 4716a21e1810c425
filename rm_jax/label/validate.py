"""Label validation: is the teacher's signal real, before anything trains on it?

The field report's v1 labels were noise on text-only answers, and no metric of the judge showed
it until a check that needs no human labels (§5): for a text-only answer, the reply that really
went out online is a natural reference, so the teacher's fail rate should *fall* as the answer's
character similarity to it rises. It was flat (46.5% at 0.0-0.2, 39.0% at 0.8-1.0), against
8.9% on tool calls; the cause was a tool-call contract making the teacher invent calls. Three
checks, each a named flag in report.json (other tools read these names):

``text_only_flat_vs_similarity``
    Text-only fail rate by similarity bin (0-0.2 ... 0.8-1.0; bins with fewer than `min_bin`
    rows are shown but not judged). Raised when the highest judged bin fails at least
    `flat_ratio` times as often as text-only answers overall, or at least as often as the lowest
    bin (near-copies of the online reply should almost all pass), or when no text-only answer
    failed at all (flat at zero: a teacher that passes everything).
``route_fail_rate_ratio``
    Raised when one route's fail rate is >= `route_ratio` times the other's, and the difference
    is beyond chance (two-proportion z >= `route_z`; both routes with >= `min_route` rows).
``tool_issue_on_text_only``
    Raised when at least max(1, `tool_issue_share` of text-only rows) carry a tool-call issue
    type (wrong_param, missing_param, ...): the invented-tool-call signature, because a text-only
    answer has no call to be wrong.

With an earlier labelling (``previous``) it adds the migration matrix (pass->fail, fail->pass,
unchanged) with one example per cell, the report's way to read what a relabel changed.
Similarity is difflib's ratio on characters (no autojunk: long replies must not lose their
common characters).
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import hashlib
import json
import math
import os

from configs import judge_contracts
from rm_jax.data.render import ROUTE_TEXT_ONLY, ROUTE_TOOL_CALL

ROUTES = (ROUTE_TOOL_CALL, ROUTE_TEXT_ONLY)
BIN_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
FLAG_FLAT = "text_only_flat_vs_similarity"
FLAG_ROUTE_RATIO = "route_fail_rate_ratio"
FLAG_TOOL_ISSUE = "tool_issue_on_text_only"
CELLS = ("pass->pass", "pass->fail", "fail->pass", "fail->fail")


@dataclasses.dataclass(frozen=True)
class Thresholds:
    min_bin: int = 10
    flat_ratio: float = 0.5
    min_route: int = 20
    route_ratio: float = 3.0
    route_z: float = 2.0
    tool_issue_share: float = 0.01
    examples_per_bin: int = 20


@dataclasses.dataclass(frozen=True)
class LabelRow:
    id: str
    line: int
    route: str
    response_text: str
    reference_reply: str | None
    l3: str
    reason: str
    issues: tuple[str, ...]

    @property
    def fail(self) -> bool:
        return self.l3 == "fail"


@dataclasses.dataclass(frozen=True)
class Unreadable:
    line: int
    detail: str


@dataclasses.dataclass(frozen=True)
class Flag:
    name: str
    detail: str


@dataclasses.dataclass(frozen=True)
class SimBin:
    lo: float
    hi: float
    n: int
    fail: int
    judged: bool           # n >= min_bin

    @property
    def name(self) -> str:
        return f"{self.lo:.1f}-{self.hi:.1f}"

    @property
    def fail_rate(self) -> float | None:
        return self.fail / self.n if self.n else None


@dataclasses.dataclass
class Report:
    labels: str
    previous: str | None
    n_rows: int
    unreadable: list[Unreadable]
    routes: dict[str, dict]
    route_comparison: dict     # ratio (higher / lower fail rate) and z of the two routes
    bins: list[SimBin]
    text_only_with_reference: int
    text_only_without_reference: int
    text_only_fail_rate: float | None
    issues_by_route: dict[str, dict[str, int]]
    tool_issue_rows: list[str]
    migration: dict | None
    flags: list[Flag]
    examples: dict[str, list[dict]]
    thresholds: Thresholds

    def to_json(self) -> dict:
        return {
            "labels": self.labels, "previous": self.previous, "n_rows": self.n_rows,
            "unreadable": [dataclasses.asdict(u) for u in self.unreadable],
            "routes": self.routes, "route_comparison": self.route_comparison,
            "similarity": {"bins": [{"bin": b.name, "n": b.n, "fail": b.fail,
                                     "fail_rate": _round(b.fail_rate), "judged": b.judged} for b in self.bins],
                           "text_only_with_reference": self.text_only_with_reference,
                           "text_only_without_reference": self.text_only_without_reference,
                           "text_only_fail_rate": _round(self.text_only_fail_rate)},
            "issues_by_route": self.issues_by_route,
            "tool_issues_on_text_only": {"count": len(self.tool_issue_rows), "ids": self.tool_issue_rows[:50]},
            "migration": self.migration,
            "flags": [dataclasses.asdict(f) for f in self.flags],
            "thresholds": dataclasses.asdict(self.thresholds),
        }


def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


# ---------------------------------------------------------------- reading


def _parse_row(obj, line: int) -> LabelRow:
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    sid = obj.get("id")
    if not isinstance(sid, (str, int)) or isinstance(sid, bool):
        raise ValueError("no id")
    resp = obj.get("response")
    if not isinstance(resp, dict):
        raise ValueError("no response object")
    label = obj.get("label")
    if not isinstance(label, dict) or label.get("l3") not in ("pass", "fail"):
        raise ValueError("no label with l3 pass/fail")
    issues = label.get("issues") or []
    if not isinstance(issues, list):
        raise ValueError("label.issues is not a list")
    ref = obj.get("reference_reply")
    route = ROUTE_TOOL_CALL if resp.get("tool_calls") else ROUTE_TEXT_ONLY
    return LabelRow(str(sid), line, route, resp.get("content") or "", ref if isinstance(ref, str) and ref else None,
                    label["l3"], str(label.get("reason") or ""), tuple(str(i) for i in issues))


def read_labels(path: str) -> tuple[list[LabelRow], list[Unreadable]]:
    """Every non-blank line as a LabelRow, or an Unreadable naming the line (never skipped
    silently). Lighter than the sample contract on purpose: images need not exist here."""
    rows, bad = [], []
    seen: set[str] = set()
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = _parse_row(json.loads(raw), i)
            except (ValueError, UnicodeDecodeError) as e:
                bad.append(Unreadable(i, f"{path}:{i}: {e}"))
                continue
            if row.id in seen:
                bad.append(Unreadable(i, f"{path}:{i}: duplicate id {row.id}"))
                continue
            seen.add(row.id)
            rows.append(row)
    return rows, bad


# ---------------------------------------------------------------- checks


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def bin_index(sim: float) -> int:
    return min(int(sim * (len(BIN_EDGES) - 1)), len(BIN_EDGES) - 2)


def similarity_bins(rows: list[LabelRow], th: Thresholds) -> tuple[list[SimBin], dict[int, list[tuple[float, LabelRow]]]]:
    members: dict[int, list[tuple[float, LabelRow]]] = {i: [] for i in range(len(BIN_EDGES) - 1)}
    for r in rows:
        if r.route == ROUTE_TEXT_ONLY and r.reference_reply is not None:
            s = similarity(r.response_text, r.reference_reply)
            members[bin_index(s)].append((s, r))
    bins = [SimBin(BIN_EDGES[i], BIN_EDGES[i + 1], len(m), sum(r.fail for _, r in m), len(m) >= th.min_bin)
            for i, m in members.items()]
    return bins, members


def flat_flag(bins: list[SimBin], overall: float | None, th: Thresholds) -> Flag | None:
    judged = [b for b in bins if b.judged]
    if len(judged) < 2 or overall is None:
        return None     # too few rows to judge
    if overall == 0:
        # Flat at zero: a teacher that passes every text answer tells pass from fail no better.
        return Flag(FLAG_FLAT, f"no text-only answer failed ({sum(b.n for b in bins)} with a reference_reply): "
                               "the fail rate cannot fall as similarity rises; a teacher that passes "
                               "everything carries no signal")
    top, bottom = judged[-1], judged[0]
    if top.fail_rate >= th.flat_ratio * overall or top.fail_rate >= bottom.fail_rate:
        return Flag(FLAG_FLAT,
                    f"text-only fail rate {100 * top.fail_rate:.1f}% at similarity {top.name} (n={top.n}) vs "
                    f"{100 * overall:.1f}% overall and {100 * bottom.fail_rate:.1f}% at {bottom.name} "
                    f"(n={bottom.n}): it does not fall as the answer approaches the reply that went out "
                    f"(threshold: top bin < {th.flat_ratio:g} x overall and < lowest bin)")
    return None


def route_summary(rows: list[LabelRow]) -> dict[str, dict]:
    out = {}
    for route in ROUTES:
        rr = [r for r in rows if r.route == route]
        n_fail = sum(r.fail for r in rr)
        out[route] = {"n": len(rr), "fail": n_fail, "fail_rate": _round(n_fail / len(rr)) if rr else None}
    return out


def route_flag(routes: dict[str, dict], th: Thresholds) -> tuple[Flag | None, dict]:
    a, b = routes[ROUTE_TEXT_ONLY], routes[ROUTE_TOOL_CALL]
    info: dict = {"ratio": None, "z": None}
    if a["n"] < th.min_route or b["n"] < th.min_route:
        return None, info
    pa, pb = a["fail"] / a["n"], b["fail"] / b["n"]
    hi, lo = max(pa, pb), min(pa, pb)
    pooled = (a["fail"] + b["fail"]) / (a["n"] + b["n"])
    se = math.sqrt(pooled * (1 - pooled) * (1 / a["n"] + 1 / b["n"]))
    z = abs(pa - pb) / se if se > 0 else 0.0
    ratio = hi / lo if lo > 0 else (math.inf if hi > 0 else 1.0)
    info = {"ratio": None if math.isinf(ratio) else round(ratio, 3), "z": round(z, 3)}
    if ratio >= th.route_ratio and z >= th.route_z:
        worse = ROUTE_TEXT_ONLY if pa > pb else ROUTE_TOOL_CALL
        shown = "inf" if math.isinf(ratio) else f"{ratio:.1f}"
        return Flag(FLAG_ROUTE_RATIO,
                    f"{worse} fails {shown}x as often: text-only {100 * pa:.1f}% (n={a['n']}) vs tool-call "
                    f"{100 * pb:.1f}% (n={b['n']}), z={z:.1f} (threshold: ratio >= {th.route_ratio:g}, "
                    f"z >= {th.route_z:g})"), info
    return None, info


def issues_by_route(rows: list[LabelRow]) -> dict[str, dict[str, int]]:
    out: dict[str, collections.Counter] = {r: collections.Counter() for r in ROUTES}
    for r in rows:
        out[r.route].update(r.issues)
    return {r: dict(c.most_common()) for r, c in out.items()}


def tool_issue_rows(rows: list[LabelRow]) -> list[str]:
    tool_issues = set(judge_contracts.TOOL_CALL_ISSUES)
    return [r.id for r in rows if r.route == ROUTE_TEXT_ONLY and tool_issues & set(r.issues)]


def tool_issue_flag(ids: list[str], n_text_only: int, th: Thresholds) -> Flag | None:
    need = max(1, math.ceil(th.tool_issue_share * n_text_only))
    if len(ids) >= need:
        return Flag(FLAG_TOOL_ISSUE,
                    f"{len(ids)} of {n_text_only} text-only labels carry a tool-call issue type "
                    f"({', '.join(judge_contracts.TOOL_CALL_ISSUES)}), e.g. {', '.join(ids[:3])}: the teacher "
                    f"judged a tool call the response does not make (threshold: {need})")
    return None


def _excerpt(text: str, n: int = 240) -> str:
    return text if len(text) <= n else text[:n] + "..."


def migration(rows: list[LabelRow], previous: list[LabelRow]) -> dict:
    prev = {r.id: r for r in previous}
    cells: dict[str, list[tuple[LabelRow, LabelRow]]] = {c: [] for c in CELLS}
    by_route = {route: collections.Counter() for route in ROUTES}
    for r in rows:
        p = prev.get(r.id)
        if p is None:
            continue
        cell = f"{p.l3}->{r.l3}"
        cells[cell].append((p, r))
        by_route[r.route][cell] += 1
    n = sum(len(v) for v in cells.values())
    example = {}
    for c, pairs in cells.items():
        if pairs:
            p, r = min(pairs, key=lambda pr: _stable(pr[1].id))
            example[c] = {"id": r.id, "route": r.route, "previous_reason": p.reason, "reason": r.reason,
                          "previous_issues": list(p.issues), "issues": list(r.issues),
                          "response": _excerpt(r.response_text)}
    ids_now = {r.id for r in rows}
    return {"compared": n, "matrix": {c: len(v) for c, v in cells.items()},
            "unchanged": len(cells["pass->pass"]) + len(cells["fail->fail"]),
            "pass_to_fail": len(cells["pass->fail"]), "fail_to_pass": len(cells["fail->pass"]),
            "by_route": {r: {c: by_route[r][c] for c in CELLS} for r in ROUTES},
            "only_in_previous": len(set(prev) - ids_now), "only_in_labels": len(ids_now - set(prev)),
            "examples": example}


def _stable(sid: str) -> str:
    return hashlib.sha256(sid.encode()).hexdigest()


def bin_examples(bins: list[SimBin], members: dict, k: int) -> dict[str, list[dict]]:
    """Up to k rows per bin for reading, half failures where there are any (stable order)."""
    out = {}
    for i, b in enumerate(bins):
        ms = sorted(members[i], key=lambda sr: _stable(sr[1].id))
        fails = [m for m in ms if m[1].fail][: k // 2]
        rest = [m for m in ms if not m[1].fail][: k - len(fails)]
        out[b.name] = [{"id": r.id, "similarity": round(s, 3), "l3": r.l3, "reason": r.reason,
                        "issues": list(r.issues), "response": r.response_text, "reference_reply": r.reference_reply}
                       for s, r in fails + rest]
    return out


def validate(labels_path: str, previous_path: str | None = None, th: Thresholds = Thresholds()) -> Report:
    rows, bad = read_labels(labels_path)
    bins, members = similarity_bins(rows, th)
    n_ref = sum(b.n for b in bins)
    n_fail_ref = sum(b.fail for b in bins)
    overall = n_fail_ref / n_ref if n_ref else None
    routes = route_summary(rows)
    r_flag, r_info = route_flag(routes, th)
    tool_ids = tool_issue_rows(rows)
    n_text = routes[ROUTE_TEXT_ONLY]["n"]
    flags = [f for f in (flat_flag(bins, overall, th), r_flag, tool_issue_flag(tool_ids, n_text, th)) if f]
    mig = None
    if previous_path:
        prev_rows, _ = read_labels(previous_path)
        mig = migration(rows, prev_rows)
    return Report(labels=os.path.abspath(labels_path), previous=os.path.abspath(previous_path) if previous_path else None,
                  n_rows=len(rows), unreadable=bad, routes=routes, route_comparison=r_info, bins=bins, text_only_with_reference=n_ref,
                  text_only_without_reference=n_text - n_ref, text_only_fail_rate=overall,
                  issues_by_route=issues_by_route(rows), tool_issue_rows=tool_ids, migration=mig, flags=flags,
                  examples=bin_examples(bins, members, th.examples_per_bin), thresholds=th)
