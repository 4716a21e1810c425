"""The labelling job: input JSONL -> teacher labels, appended to OUT, exactly once per id.

Every input row ends as one of: labelled (its line is in OUT, from this or an earlier run),
failed (OUT.errors.jsonl: the teacher still failed after the retries; a rerun retries it), or
rejected (OUT.rejects.jsonl: bad input, with the reason the build would give). The stats file
asserts read = labelled + failed + rejected (+ pending, only for an interrupted run).

Image paths in samples are relative to their JSONL's folder; OUT carries the rows as they were,
so OUT must sit in the input's folder when rows use relative paths (refused otherwise, before
any request: the labels would point at images that are not there).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import time
from typing import Any

import numpy as np

from rm_jax.data.render import ROUTE_TEXT_ONLY, ROUTE_TOOL_CALL, route_of
from rm_jax.data.schema import Reject, Sample, read_rows, render_error
from rm_jax.data.tool_content import parse_tool_content
from rm_jax.label import store
from rm_jax.label.client import Completion, GenerationSettings, RetryPolicy, TeacherError, TeacherPool
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
    raw: dict


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
    latencies: list[float] = dataclasses.field(default_factory=list)

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


# ---------------------------------------------------------------- input checks


def _relative_image(value: Any) -> bool:
    return isinstance(value, str) and not value.startswith("data:") and not os.path.isabs(value)


def uses_relative_images(raw: dict) -> bool:
    for m in raw.get("messages") or []:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            for p in content:
                if isinstance(p, dict):
                    src = p.get("image")
                    url = p.get("image_url")
                    src = src if src is not None else (url.get("url") if isinstance(url, dict) else url)
                    if _relative_image(src):
                        return True
        elif m.get("role") == "tool" and isinstance(content, str):
            if any(_relative_image(s) for s in parse_tool_content(content).images):
                return True
    return False


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
    row = {k: v_ for k, v_ in task.raw.items() if k not in ("label", "label_meta")}
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


def _read_input(path: str, limit: int | None, tally: Tally) -> tuple[list[Task], list[Reject]]:
    tasks: list[Task] = []
    rejects: list[Reject] = []
    for item, raw in read_rows(path, require_label=False):
        if limit is not None and tally.read >= limit:
            break
        tally.read += 1
        if isinstance(item, Reject):
            rejects.append(item)
        else:
            tasks.append(Task(item, json.loads(raw)))
    return tasks, rejects


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


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
    tasks, rejects = _read_input(input_path, settings.limit, tally)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    same_folder = out_dir == os.path.dirname(os.path.abspath(input_path))
    if not same_folder and any(uses_relative_images(t.raw) for t in tasks):
        raise ValueError(f"--out={out_path} is not in the folder of --input={input_path}, whose rows name "
                         "images by relative paths (resolved against the JSONL's folder): write OUT next "
                         "to the input")
    existing = store.scan_and_repair(out_path)
    todo: list[Task] = []
    for t in tasks:
        done = existing.labelled.get(t.sample.id)
        if done is None:
            todo.append(t)
        else:
            tally.already_labelled += 1
            tally.add_labelled(done.route, done.l3, this_run=False)
    for r in rejects:
        tally.rejected[r.reason] += 1

    out_w = store.JsonlAppender(out_path, "ab")
    err_w = store.JsonlAppender(store.errors_path(out_path), "wb")   # this run's failures
    rej_w = store.JsonlAppender(store.rejects_path(out_path), "wb")
    for r in rejects:
        rej_w.write(r.to_json())
    endpoint_stats: dict = {}
    complete = False
    try:
        endpoint_stats = asyncio.run(_label_all(todo, settings, tally, out_w, err_w, rej_w))
        complete = True
    finally:
        for w in (out_w, err_w, rej_w):
            w.close()
        # Interrupted (Ctrl-C): the rows not reached yet are `pending`; the next run takes them.
        done = tally.already_labelled + tally.labelled_this_run + sum(tally.failed.values()) + \
            sum(tally.rejected.values())
        stats = _stats(input_path, out_path, settings, tally, existing, 0 if complete else tally.read - done,
                       complete, time.monotonic() - t0, endpoint_stats)
        store.write_json_atomic(store.stats_path(out_path), stats)
    return stats


async def _label_all(todo: list[Task], settings: LabelSettings, tally: Tally, out_w, err_w, rej_w) -> dict:
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
    queue: asyncio.Queue[Task] = asyncio.Queue()
    for t in todo:
        queue.put_nowait(t)
    bar = tqdm(total=len(todo), desc="label", unit="sample", disable=not settings.progress,
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

    async def worker() -> None:
        while True:
            try:
                task = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                result = await label_one(task, settings, verdict_pool, image_pool)
            except Exception as e:  # noqa: BLE001 -- a bug on one sample is recorded, never fatal
                result = Failed(task.sample.id, task.sample.line, route_of(task.sample), HEAD_VERDICT, "internal_error",
                                f"{type(e).__name__}: {e}", 0)
            record(result)

    n_workers = verdict_pool.capacity + (image_pool.capacity if image_pool else 0)
    try:
        await asyncio.gather(*(worker() for _ in range(max(1, min(n_workers, len(todo))))))
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
                      "mean": round(float(np.mean(tally.latencies)), 4) if tally.latencies else None},
        "elapsed_s": round(elapsed, 3),
        "throughput_samples_per_s": round(tally.labelled_this_run / elapsed, 3) if elapsed > 0 else None,
        "teacher_model": settings.model, "endpoints": list(settings.endpoints),
        "image_model": (settings.image_model or settings.model) if settings.image_endpoint else None,
        "image_endpoint": settings.image_endpoint, "concurrency": settings.concurrency,
        "max_retries": settings.policy.max_retries, "timeout_s": settings.policy.timeout_s,
        "thumbnail_edge": settings.thumbnail_edge, "limit": settings.limit,
        "endpoint_requests": endpoints,
    }
