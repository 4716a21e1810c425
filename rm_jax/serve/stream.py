"""Continuous batching for scoring: device batches formed across requests from rendered items.

A request's samples are rendered into items (``Scorer.render``) when the worker admits them; the
items of every admitted request wait in one pool per ``ScoreMode`` (``full`` / ``p_pass``). Each device
step serves the oldest waiting unit -- a GRPO group (one ``prompt_id``, same images, a shared
prompt prefix) as a whole, or one item -- plus the units that pack best with it:

* a group goes with the groups nearest in shared-prefix length, up to ``batch_size`` prefixes in
  one prefill, their members in up to ``parts`` device batches right after
  (``Scorer.dispatch_shared``), so groups split over requests still share their prefix; the last
  batch's spare rows take lone items (``Scorer.one_group``) and members split off other groups,
  when they fit its prefix bucket, suffix width and image rung: an empty row costs a full one;
* an item goes with the window of length-sorted items around it whose padded batch (length
  bucket x rows, plus the image ladder rung's patches) costs least per item
  (``Scorer.dispatch_whole``).

Serving the oldest first bounds how long any item waits; choosing its neighbours from the whole
pool is what keeps device batches full and tightly padded whatever the requests' sizes (a call
per request mix padded each batch to its own mix). A step is taken once a full batch is waiting,
the oldest item has waited ``max_wait_s``, or the caller flushes (draining). Results of a request
are handed back when its last item is read; rows come from the same scorer calls as
``Scorer.score`` / ``p_pass``, so only the batch a sample lands in differs.

Shapes: every device batch pads to the scorer's buckets, image ladder rungs and suffix widths,
a bounded set; which of them traffic meets depends on its mix, so warm a server up with a replay
of it (``benchmarks/serve_load.py`` repeats load windows until one compiles nothing).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from rm_jax.data import loader as loader_lib
from rm_jax.score.scorer import Scorer, ScoreItem, ScoreMode


Done = tuple[Any, Any, "BaseException | None"]   # (token, answer, error): a request finished


class StepFailed(Exception):
    """A device step raised: ``tokens`` are the requests that had items in it."""

    def __init__(self, tokens: list, error: BaseException):
        super().__init__(str(error))
        self.tokens, self.error = tokens, error


@dataclasses.dataclass
class _Request:
    token: Any                 # the caller's handle (the batcher's Job)
    kind: ScoreMode
    samples: Sequence
    results: list              # per sample: scorer result, None until read
    left: int                  # items not read yet
    since: float               # arrival: what the wait bound counts from
    alive: bool = True


@dataclasses.dataclass
class _Entry:
    req: _Request
    item: ScoreItem            # item.index is the sample's place in its request


@dataclasses.dataclass
class _Step:
    kind: ScoreMode
    parts: list                # [(rows, device result)] -- rows: ScoreItems; entries below line up
    entries: list[list[_Entry]]


Rows = Callable[[ScoreMode, Sequence, list], Any]    # (mode, samples, scorer results) -> the request's answer


class ScoreStream:
    """A request's kind is its ``ScoreMode``; ``rows`` turns a finished request's scorer results
    into its answer; ``on_batch(kind, rows)`` sees every device batch."""

    def __init__(self, scorer: Scorer, rows: Rows, *, max_wait_s: float, depth: int = 2,
                 parts: int = 4, on_batch: Callable[[str, int], None] | None = None):
        self.scorer, self.rows = scorer, rows
        self.max_wait_s, self.depth, self.parts = float(max_wait_s), int(depth), int(parts)
        self.batch_size = scorer.batch_size
        self.on_batch = on_batch
        self._pools: dict[ScoreMode, list[_Entry]] = {mode: [] for mode in ScoreMode}
        self._inflight: collections.deque = collections.deque()   # (_Step, part index)
        self._requests: dict[int, _Request] = {}                    # id(token) -> its request, until done

    # -- bookkeeping ----------------------------------------------------------------------------

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    @property
    def pending(self) -> int:
        return sum(len(p) for p in self._pools.values())

    @property
    def kinds(self) -> tuple[ScoreMode, ...]:
        return tuple(ScoreMode)

    def admit(self, token, kind: ScoreMode, samples: Sequence, since: float) -> list[Done]:
        """Render a request's samples into the pool; returns its answer if it is already
        complete (no sample could be rendered)."""
        mode = kind = ScoreMode(kind)
        items, errors = self.scorer.render(samples)
        req = _Request(token, kind, samples, [None] * len(samples), len(items), since)
        for i, err in errors.items():
            req.results[i] = self.scorer.error_result(mode, samples[i].id, err)
        if req.left == 0:
            return [self._finish(req)]
        self._requests[id(token)] = req
        for it in items:
            self.scorer.prefix_key(it)      # hash the images now, once
            self._pools[kind].append(_Entry(req, it))
        return []

    def _finish(self, req: _Request) -> Done:
        try:
            return req.token, self.rows(req.kind, req.samples, req.results), None
        except Exception as e:   # noqa: BLE001 -- this request's answer fails alone
            return req.token, None, e

    def drop(self, token) -> None:
        """Forget a request (it is retried alone): its waiting items leave the pool, reads of its
        items still in flight are ignored."""
        req = self._requests.pop(id(token), None)
        if req is not None:
            req.alive = False
        for mode in self._pools:
            self._pools[mode] = [e for e in self._pools[mode] if e.req.token is not token]

    def due(self) -> float | None:
        """When the oldest waiting item's wait bound runs out (None: nothing waits)."""
        since = [e.req.since for pool in self._pools.values() for e in pool[:1]]
        return min(since) + self.max_wait_s if since else None

    def ready(self, now: float, flush: bool = False) -> bool:
        if not self.pending:
            return False
        if flush or any(len(p) >= self.batch_size for p in self._pools.values()):
            return True
        return now >= self.due()

    # -- scheduling -----------------------------------------------------------------------------

    def dispatch(self, now: float, flush: bool = False) -> bool:
        """Dispatch one device step if one is ready (the device runs it asynchronously)."""
        if not self.ready(now, flush):
            return False
        kind = min((k for k, p in self._pools.items() if p), key=lambda k: self._pools[k][0].req.since)
        mode, pool = kind, self._pools[kind]
        by_item = {id(e.item): e for e in pool}
        groups, alone = self.scorer.prefix_groups([e.item for e in pool])
        oldest = pool[0].item
        group = next((g for g in groups if any(it is oldest for it in g.items)), None)
        if group is not None:
            chosen = self._pick_groups(groups, group, alone)
            taken = [by_item[id(it)] for g in chosen for it in g.items]
        else:
            picked = self._pick_items(alone, oldest)
            taken = [by_item[id(it)] for it in picked]
        self._remove(kind, taken)
        try:
            parts = (self.scorer.dispatch_shared(mode, chosen) if group is not None
                     else [self.scorer.dispatch_whole(mode, picked)])
        except Exception as e:   # noqa: BLE001 -- the caller isolates the requests in it
            raise StepFailed(_tokens(taken), e) from e
        entries = [[by_item[id(it)] for it in rows] for rows, _ in parts]
        step = _Step(kind, parts, entries)
        for k in range(len(parts)):
            self._inflight.append((step, k))
            if self.on_batch is not None:
                self.on_batch(kind, len(parts[k][0]))
        return True

    def _remove(self, kind: ScoreMode, taken: list[_Entry]) -> None:
        gone = {id(e) for e in taken}
        self._pools[kind] = [e for e in self._pools[kind] if id(e) not in gone]

    def _pick_groups(self, groups: list, first, alone: list) -> list:
        """``first`` and the groups nearest it in shared length, up to batch_size prefixes and
        ``parts`` device batches of members (one step's length; a group whose members would
        overflow them is skipped), then the last batch's spare rows: lone items as one-member
        groups, then members split off the next nearest groups, when their prefix and suffix fit
        the step's shapes. An empty member row costs as much as a filled one; a split-off member
        costs a prefix row when its group is served."""
        B, cap = self.batch_size, self.parts * self.batch_size
        order = sorted((g for g in groups if g is not first),
                       key=lambda g: (abs(g.n_shared - first.n_shared), g.n_shared))
        chosen, rows, rest = [first], len(first.items), []
        for g in order:
            if len(chosen) < B and rows + len(g.items) <= cap:
                chosen.append(g)
                rows += len(g.items)
            else:
                rest.append(g)
        spare = -rows % B
        if not spare or len(chosen) >= B:
            return chosen
        prefix = loader_lib.pick_bucket(max(g.n_shared for g in chosen), self.scorer.buckets)
        width = self.scorer.suffix_width(max(len(g.suffix(it)) for g in chosen for it in g.items))
        images = _Images(self.scorer.ladder, chosen)
        fillers = [self.scorer.one_group(it, prefix) for it in alone]
        fillers += [dataclasses.replace(g, items=[it for it in g.items if len(g.suffix(it)) <= width])
                    for g in rest if g.n_shared <= prefix]
        for g in fillers:
            if spare == 0 or len(chosen) >= B:
                break
            if g is None or not g.items or any(len(g.suffix(it)) > width for it in g.items[:spare]):
                continue
            if not images.fits(g.items[0]):
                continue
            part = dataclasses.replace(g, items=g.items[:spare])
            images.add(part.items[0])
            chosen.append(part)
            spare -= len(part.items)
        return chosen

    def _pick_items(self, items: list, first) -> list:
        """The window of ``batch_size`` length-sorted items holding ``first`` whose padded batch
        costs least per item; all of them when fewer wait."""
        order = sorted(items, key=lambda it: len(it.ids))
        B = self.batch_size
        if len(order) <= B:
            return order
        at = next(k for k, it in enumerate(order) if it is first)
        patches = np.cumsum([0] + [_patches(it) for it in order])
        images = np.cumsum([0] + [len(it.rendered.image_grid_thw) for it in order])
        ladder = self.scorer.ladder
        best, best_cost = None, None
        for lo in range(max(0, at - B + 1), min(at, len(order) - B) + 1):
            hi = lo + B
            cost = B * loader_lib.pick_bucket(len(order[hi - 1].ids), self.scorer.buckets)
            p, g = int(patches[hi] - patches[lo]), int(images[hi] - images[lo])
            cost += ladder.pad(p, g)[0] if ladder is not None else p
            if best_cost is None or cost < best_cost:
                best, best_cost = lo, cost
        return order[best:best + B]

    # -- results --------------------------------------------------------------------------------

    def collect(self) -> list[Done]:
        """Fetch the oldest device batch in flight; returns the answers of the requests it
        completed."""
        step, k = self._inflight.popleft()
        rows, result = step.parts[k]
        entries = step.entries[k]
        try:
            got = jax.device_get(result)
            read = self.scorer.read(step.kind, rows, got)
        except Exception as e:   # noqa: BLE001
            raise StepFailed(_tokens(entries), e) from e
        done = []
        for e, r in zip(entries, read):
            if not e.req.alive:
                continue
            e.req.results[e.item.index] = r
            e.req.left -= 1
            if e.req.left == 0:
                self._requests.pop(id(e.req.token), None)
                done.append(self._finish(e.req))
        return done


class _Images:
    """The image shape of a prefix batch (its ladder rung; without a ladder, its exact counts) as
    prefixes join it: a filler that would raise it is refused (a larger vision batch, maybe a
    compile)."""

    def __init__(self, ladder, groups: list):
        self.ladder = ladder
        self.patches = sum(_patches(g.items[0]) for g in groups)
        self.images = sum(len(g.items[0].rendered.image_grid_thw) for g in groups)

    def _shape(self, patches: int, images: int):
        return self.ladder.pad(patches, images) if self.ladder is not None and images else (patches, images)

    def fits(self, it) -> bool:
        grown = self._shape(self.patches + _patches(it), self.images + len(it.rendered.image_grid_thw))
        return grown == self._shape(self.patches, self.images)

    def add(self, it) -> None:
        self.patches += _patches(it)
        self.images += len(it.rendered.image_grid_thw)


def _patches(it) -> int:
    return len(it.rendered.pixel_values) if it.rendered.has_image else 0


def _tokens(entries: list[_Entry]) -> list:
    seen, out = set(), []
    for e in entries:
        if e.req.alive and id(e.req) not in seen:
            seen.add(id(e.req))
            out.append(e.req.token)
    return out
