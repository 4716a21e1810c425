"""The labelling job: input JSONL -> teacher labels, appended to OUT, exactly once per id.

Every input row ends as one of: labelled (its line is in OUT, from this or an earlier run),
failed (OUT.errors.jsonl: the teacher still failed after the retries; a rerun retries it), or
rejected (OUT.rejects.jsonl: bad input, with the reason the build would give). The stats file
asserts read = labelled + failed + rejected (+ pending, only for an interrupted run).

The job streams: rows are read as workers free up (a queue as deep as the workers are many sits
between the reader and them), each result is appended as it arrives, and a resume keeps only
OUT's ids and outcomes. Memory is set by the concurrency, not by the input's size (33k rows with
inline images: benchmarks/label_load.py).

Image paths in samples are relative to their JSONL's folder; rows are written to OUT with their
relative image paths rewritten against OUT's folder (rm_jax.label.rebase), so OUT may be written
anywhere. The teacher is asked about the row as OUT holds it.
"""

from __future__ import annotations

import array
import asyncio
import collections
import dataclasses
import itertools
import json
import os
import time
from typing import Iterator

import numpy as np

from rm_jax.data.render import ROUTE_TEXT_ONLY, ROUTE_TOOL_CALL, route_of
from rm_jax.data.schema import Reject, Sample, SampleError, parse_sample, read_rows, render_error
from rm_jax.label import store
from rm_jax.label.client import Completion, GenerationSettings, RetryPolicy, TeacherError, TeacherPool
from rm_jax.label.rebase import ImageRebase
from rm_jax.label.replies import VerdictReply, parse_image_score, parse_verdict
from rm_jax.label.request import HEAD_IMAGE, HEAD_VERDICT, SampleRequests, TeacherRequest, build_requests

ROUTES = (ROUTE_TOOL_CALL, ROUTE_TEXT_ONLY)


@dataclasses.dataclass(frozen=True)
class LabelSettings:
    endpoints: tuple[str, ...]
    model: str
    image_endpoint: str | None = None
    image_model: str | None = None     # default: `model`
    concurrency: int = 2               # per endpoint
    thumbnail_edge: int = 512
    limit: int | None = None           # read at most this many input rows
    policy: RetryPolicy = RetryPolicy()
    generation: GenerationSettings = GenerationSettings()
    api_key: str = "EMPTY"
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class Task:
    sample: Sample
    row: dict      # the input row, image paths rebased to OUT's folder: written back with its label


@dataclasses.dataclass(frozen=True)
class Labelled:
    id: str
    route: str
    l3: str
    attempts: int
    latency_s: float
    row: dict
    image_declined: bool = False   # the image head answered "img": null


@dataclasses.dataclass(frozen=True)
class Failed:
    id: str
    line: int
    route: str
    head: str
    code: str
    detail: str
    attempts: int

    def to_json(self) -> dict:
        return {"id": self.id, "line": self.line, "route": self.route, "head": self.head,
                "reason": self.code, "detail": self.detail, "attempts": self.attempts}


@dataclasses.dataclass
class RouteTally:
    labelled: int = 0
    fail: int = 0
    failed: int = 0        # teacher failures (errors), not fail verdicts

    def fail_rate(self) -> float | None:
        return self.fail / self.labelled if self.labelled else None


@dataclasses.dataclass
class Tally:
    """Running counts of one run (the progress bar) and of the final state (the stats)."""
    read: int = 0
    rejected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    already_labelled: int = 0
    labelled_this_run: int = 0
    routes: dict[str, RouteTally] = dataclasses.field(default_factory=lambda: {r: RouteTally() for r in ROUTES})
    run_routes: dict[str, RouteTally] = dataclasses.field(default_factory=lambda: {r: RouteTally() for r in ROUTES})
    attempts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    retried_samples: int = 0
    image_declined: int = 0
    latencies: array.array = dataclasses.field(default_factory=lambda: array.array("d"))   # 8 bytes a sample

    def add_labelled(self, route: str, l3: str, this_run: bool) -> None:
        for t in (self.routes, self.run_routes) if this_run else (self.routes,):
            t[route].labelled += 1
            t[route].fail += l3 == "fail"

    def progress_text(self) -> str:
        """The running teacher fail rate by route: a teacher that fails text-only answers far
        more often than tool calls (the report's 42.8% vs 8.9%) shows up here, mid-run."""
        bits = []
        for r in ROUTES:
            t = self.run_routes[r]
            rate = t.fail_rate()
            bits.append(f"{r} fail {'-' if rate is None else f'{100 * rate:.1f}%'} of {t.labelled}")
        bits.append(f"errors {sum(self.failed.values())}")
        bits.append(f"rejected {sum(self.rejected.values())}")
        return " | ".join(bits)


# ---------------------------------------------------------------- one sample


def _compose(task: Task, reqs: SampleRequests, verdict: Completion[VerdictReply],
             image: Completion[int | None] | None) -> Labelled:
    v = verdict.value
    img = None
    if reqs.has_image:   # null without images, whatever a teacher wrote (the schema nulls it too)
        # The image head's score when there is one (null if it declined: recorded below),
        # else what the verdict teacher wrote.
        img = image.value if image is not None else v.img
    label = {"l3": v.l3, "reason": v.reason, "issues": list(v.issues), "img": img}
    meta = {"teacher_model": verdict.model, "endpoint": verdict.endpoint,
            "contract_id": reqs.verdict.contract.id, "contract_sha256": reqs.verdict.contract.sha256,
            "attempts": verdict.attempts, "latency_s": round(verdict.latency_s, 4),
            "elapsed_s": round(verdict.elapsed_s, 4), "parse_status": v.status, "n_images": reqs.verdict.n_images,
            "image": None}
    if image is not None:
        meta["image"] = {"teacher_model": image.model, "endpoint": image.endpoint,
                         "contract_id": reqs.image.contract.id, "contract_sha256": reqs.image.contract.sha256,
                         "attempts": image.attempts, "latency_s": round(image.latency_s, 4),
                         "elapsed_s": round(image.elapsed_s, 4), "n_images": reqs.image.n_images,
                         "declined": image.value is None}
    row = {k: v_ for k, v_ in task.row.items() if k not in ("label", "label_meta")}
    row["label"] = label
    row["label_meta"] = meta
    attempts = verdict.attempts + (image.attempts if image is not None else 0)
    latency = verdict.latency_s + (image.latency_s if image is not None else 0.0)
    return Labelled(task.sample.id, reqs.route, v.l3, attempts, latency, row,
                    image_declined=image is not None and image.value is None)


async def label_one(task: Task, settings: LabelSettings, verdict_pool: TeacherPool,
                    image_pool: TeacherPool | None) -> Labelled | Failed | Reject:
    s = task.sample
    try:
        reqs = await asyncio.to_thread(build_requests, s, settings.thumbnail_edge, image_pool is not None)
    except Exception as e:  # noqa: BLE001 -- a sample the renderer refuses is rejected, with its reason
        code = getattr(e, "reason", "render_error")
        return Reject(s.line, s.id, code, f"line {s.line}, id {s.id}: {render_error(e)}")

    async def head(pool: TeacherPool, req: TeacherRequest, parse):
        try:
            return await pool.complete(req.messages, parse)
        except TeacherError as e:
            return e

    jobs = [head(verdict_pool, reqs.verdict, parse_verdict)]
    if reqs.image is not None:
        jobs.append(head(image_pool, reqs.image, parse_image_score))
    results = await asyncio.gather(*jobs)
    for name, res in zip((HEAD_VERDICT, HEAD_IMAGE), results):
        if isinstance(res, TeacherError):
            return Failed(s.id, s.line, reqs.route, name, res.code, res.detail, res.attempts)
    return _compose(task, reqs, results[0], results[1] if len(results) > 1 else None)


# ---------------------------------------------------------------- the job


def read_tasks(input_path: str, rebase: ImageRebase) -> Iterator[Task | Reject]:
    """The input's rows, one at a time, as tasks (rebased to OUT's folder) or rejects."""
    for item, raw in read_rows(input_path, require_label=False):
        if isinstance(item, Reject):
            yield item
            continue
        row = json.loads(raw)
        if rebase.identity:
            yield Task(item, row)
            continue
        moved = rebase.row(row)
        try:
            sample = parse_sample(moved, line=item.line, base_dir=rebase.dst_dir, require_label=False)
        except SampleError as e:   # the same files by other names: only a rebase bug lands here
            yield Reject(item.line, item.id, e.reason, f"line {item.line}, id {item.id}, field {e.field} "
                         f"(image paths rewritten for OUT's folder): {e.detail}")
            continue
        yield Task(sample, moved)


def count_rows(path: str, limit: int | None) -> int:
    """Non-blank lines (the rows the reader will yield), for the progress bar; one streamed pass."""
    n = 0
    with open(path, "rb") as f:
        for raw in f:
            n += bool(raw.strip())
            if limit is not None and n >= limit:
                break
    return n


def _pct(values, q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if len(values) else None


def label_file(input_path: str, out_path: str, settings: LabelSettings) -> dict:
    """Label `input_path` into `out_path` (resuming it); returns the stats (also written)."""
    t0 = time.monotonic()
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"--input={input_path}: no such file")
    if os.path.isdir(out_path):
        raise ValueError(f"--out={out_path} is a directory; OUT is a JSONL file")
    if os.path.abspath(out_path) == os.path.abspath(input_path):
        raise ValueError("--out must differ from --input (OUT is appended to)")
    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)
    lock = store.RunLock(out_path)
    try:
        return _label_file_locked(input_path, out_path, settings, t0)
    finally:
        lock.release()


def _label_file_locked(input_path: str, out_path: str, settings: LabelSettings, t0: float) -> dict:
    tally = Tally()
    rebase = ImageRebase(os.path.dirname(os.path.abspath(input_path)), os.path.dirname(os.path.abspath(out_path)))
    existing = store.scan_and_repair(out_path)
    total = count_rows(input_path, settings.limit) if settings.progress else None
    items = itertools.islice(read_tasks(input_path, rebase), settings.limit)

    out_w = store.JsonlAppender(out_path, "ab")
    err_w = store.JsonlAppender(store.errors_path(out_path), "wb")   # this run's failures
    rej_w = store.JsonlAppender(store.rejects_path(out_path), "wb")
    endpoint_stats: dict = {}
    complete = False
    try:
        endpoint_stats = asyncio.run(label_stream(items, total, existing, settings, tally, out_w, err_w, rej_w))
        complete = True
    finally:
        for w in (out_w, err_w, rej_w):
            w.close()
        # Interrupted (Ctrl-C): rows read but not finished are `pending`; the next run takes them.
        done = tally.already_labelled + tally.labelled_this_run + sum(tally.failed.values()) + \
            sum(tally.rejected.values())
        stats = _stats(input_path, out_path, settings, tally, existing, 0 if complete else tally.read - done,
                       complete, time.monotonic() - t0, endpoint_stats)
        store.write_json_atomic(store.stats_path(out_path), stats)
    return stats


async def label_stream(items: Iterator[Task | Reject], total: int | None, existing: store.ExistingOutput,
                       settings: LabelSettings, tally: Tally, out_w, err_w, rej_w) -> dict:
    """Label ``items`` (tasks and rejects, e.g. ``read_tasks``) with ``settings.concurrency`` workers
    per endpoint; rows already in ``existing`` are counted, not sent. Each result is written as it
    finishes (labels to ``out_w``, failures to ``err_w``, rejects to ``rej_w``) and counted in
    ``tally``; ``total`` sizes the progress bar. The reader runs ahead of the workers by at most
    one queue of their number, so memory stays bounded whatever the input's size. Returns the
    endpoints' request counts ({"verdict": [...], "image": [...]})."""
    from tqdm import tqdm

    verdict_pool = TeacherPool(list(settings.endpoints), settings.model, concurrency=settings.concurrency,
                               policy=settings.policy, generation=settings.generation, api_key=settings.api_key)
    image_pool = None
    if settings.image_endpoint:
        # {"img": N, "reason": one line}: half the verdict's budget.
        image_gen = dataclasses.replace(settings.generation, max_tokens=max(16, settings.generation.max_tokens // 2))
        image_pool = TeacherPool([settings.image_endpoint], settings.image_model or settings.model,
                                 concurrency=settings.concurrency, policy=settings.policy,
                                 generation=image_gen, api_key=settings.api_key)
    n_workers = verdict_pool.capacity + (image_pool.capacity if image_pool else 0)
    # The only rows held: one per worker, and as many waiting, so a worker never waits on the reader.
    queue: asyncio.Queue[Task | None] = asyncio.Queue(maxsize=n_workers)
    bar = tqdm(total=total, desc="label", unit="sample", disable=not settings.progress,
               mininterval=1.0, dynamic_ncols=True)

    def record(result) -> None:
        # Single-threaded event loop: each record's writes are whole before the next begins.
        if isinstance(result, Labelled):
            out_w.write(result.row)
            tally.labelled_this_run += 1
            tally.add_labelled(result.route, result.l3, this_run=True)
            tally.attempts["samples"] += 1
            tally.attempts["requests"] += result.attempts
            tally.retried_samples += result.attempts > (2 if result.row["label_meta"]["image"] else 1)
            tally.latencies.append(result.latency_s)
            tally.image_declined += result.image_declined
        elif isinstance(result, Failed):
            err_w.write(result.to_json())
            tally.failed[result.code] += 1
            tally.routes[result.route].failed += 1
            tally.run_routes[result.route].failed += 1
        else:
            rej_w.write(result.to_json())
            tally.rejected[result.reason] += 1
        bar.update(1)
        bar.set_postfix_str(tally.progress_text(), refresh=False)

    async def feed() -> None:
        # Parsing a row takes well under a millisecond: done on the loop, between requests.
        for item in items:
            tally.read += 1
            if isinstance(item, Reject):
                record(item)
                continue
            done = existing.labelled.get(item.sample.id)
            if done is not None:
                tally.already_labelled += 1
                tally.add_labelled(done.route, done.l3, this_run=False)
                bar.update(1)
                continue
            await queue.put(item)
        for _ in range(n_workers):
            await queue.put(None)

    async def worker() -> None:
        while (task := await queue.get()) is not None:
            try:
                result = await label_one(task, settings, verdict_pool, image_pool)
            except Exception as e:  # noqa: BLE001 -- a bug on one sample is recorded, never fatal
                result = Failed(task.sample.id, task.sample.line, route_of(task.sample), HEAD_VERDICT, "internal_error",
                                f"{type(e).__name__}: {e}", 0)
            record(result)

    try:
        await asyncio.gather(feed(), *(worker() for _ in range(n_workers)))
    finally:
        bar.close()
        await verdict_pool.aclose()
        if image_pool:
            await image_pool.aclose()
    return {"verdict": verdict_pool.endpoint_stats(), "image": image_pool.endpoint_stats() if image_pool else []}


def _stats(input_path: str, out_path: str, settings: LabelSettings, tally: Tally,
           existing: store.ExistingOutput, pending: int, complete: bool, elapsed: float, endpoints: dict) -> dict:
    labelled = tally.already_labelled + tally.labelled_this_run
    failed = sum(tally.failed.values())
    rejected = sum(tally.rejected.values())
    if tally.read != labelled + failed + rejected + pending:
        raise AssertionError(f"label stats do not add up: read {tally.read} != labelled {labelled} + "
                             f"failed {failed} + rejected {rejected} + pending {pending}")
    by_route = {r: {"labelled": t.labelled, "fail": t.fail, "pass": t.labelled - t.fail,
                    "fail_rate": None if t.fail_rate() is None else round(t.fail_rate(), 4), "failed": t.failed}
                for r, t in tally.routes.items()}
    return {
        "input": os.path.abspath(input_path), "out": os.path.abspath(out_path), "complete": complete,
        "read": tally.read, "labelled": labelled, "failed": failed, "rejected": rejected, "pending": pending,
        "labelled_this_run": tally.labelled_this_run, "already_labelled": tally.already_labelled,
        "out_ids_not_in_input": len(existing.labelled) - tally.already_labelled,
        "repaired_torn_bytes": existing.repaired_bytes,
        "rejected_by_reason": dict(sorted(tally.rejected.items())),
        "failed_by_reason": dict(sorted(tally.failed.items())),
        "by_route": by_route,
        "requests": tally.attempts["requests"], "retried_samples": tally.retried_samples,
        "image_declined_this_run": tally.image_declined,
        "latency_s": {"p50": _pct(tally.latencies, 50), "p95": _pct(tally.latencies, 95),
                      "mean": round(float(np.mean(tally.latencies)), 4) if len(tally.latencies) else None},
        "elapsed_s": round(elapsed, 3),
        "throughput_samples_per_s": round(tally.labelled_this_run / elapsed, 3) if elapsed > 0 else None,
        "teacher_model": settings.model, "endpoints": list(settings.endpoints),
        "image_model": (settings.image_model or settings.model) if settings.image_endpoint else None,
        "image_endpoint": settings.image_endpoint, "concurrency": settings.concurrency,
        "max_retries": settings.policy.max_retries, "timeout_s": settings.policy.timeout_s,
        "thumbnail_edge": settings.thumbnail_edge, "limit": settings.limit,
        "endpoint_requests": endpoints,
    }
