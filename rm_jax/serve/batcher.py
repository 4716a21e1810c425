"""Dynamic batching: one worker thread drives the device; concurrent requests share its batches.

Request handlers (on the asyncio event loop) submit a ``Job`` -- one request's samples of one
kind -- and await its future.

* **Scoring (with a ``stream``: continuous batching).** The worker admits each scoring job into
  the ``ScoreStream`` (renders its samples into one pool of items across requests) and keeps the
  device fed from it: a device batch is formed from the oldest waiting item and the items that
  pack best with it, from every admitted request, once a full batch waits or the oldest has
  waited ``max_wait_s``; ``stream.depth`` device batches are in flight while the host forms the
  next. A job is answered when its last item is read. GRPO groups are kept whole in one prefix
  prefill, across requests.
* **Other kinds (chat; scoring without a stream).** The worker takes the oldest job, waits up to
  ``max_wait_s`` *from that job's arrival* for more jobs of the same kind, then runs them as one
  ``run_batch`` call of at most the kind's limit in samples (``batch_limits``, default
  ``max_batch``; a single job larger than that runs alone).
* **Admission control.** ``max_queue`` bounds the samples admitted and not yet answered; a job
  that would exceed it is refused (``QueueFull``: the server answers 503 with Retry-After) rather
  than queued without bound while every client times out. Retry-After is the time the measured
  drain rate (samples answered per second, last 30 s) needs to make room for the job.
* **Isolation.** If a device batch (or a ``run_batch`` call) raises, the jobs in it are retried
  one by one with ``run_batch``, so a request that breaks the device call fails alone and its
  neighbours still get their results.
* **Disconnects.** A job's result is delivered to its future if anyone still waits; a client that
  went away neither cancels nor breaks the batch it is in.
* **Draining.** ``stop()`` lets the worker finish every admitted job before it exits (SIGTERM:
  uvicorn first waits for the requests in flight, then the app's shutdown calls this).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import threading
import time
from typing import Any, Callable, Sequence

from absl import logging

from rm_jax.serve.stream import StepFailed


class QueueFull(Exception):
    def __init__(self, depth: int, limit: int, retry_after_s: int = 1):
        super().__init__(f"queue full: {depth} samples waiting, limit {limit}; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class DrainRate:
    """Samples answered per second over the last ``window_s``: what a refused client should wait
    for its request to fit (``retry_after_s``), instead of a fixed guess."""

    def __init__(self, window_s: float = 30.0, max_retry_s: int = 60):
        self.window_s, self.max_retry_s = float(window_s), int(max_retry_s)
        self._answered: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, n: int, now: float) -> None:
        self._answered.append((now, int(n)))
        while self._answered and self._answered[0][0] < now - self.window_s:
            self._answered.popleft()

    def per_s(self, now: float) -> float | None:
        recent = [(t, n) for t, n in self._answered if t >= now - self.window_s]
        if len(recent) < 2:
            return None
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span

    def retry_after_s(self, excess: int, now: float) -> int:
        """Whole seconds until ``excess`` more samples have drained (1 without a measurement)."""
        rate = self.per_s(now)
        if rate is None or rate <= 0:
            return 1
        return int(min(max(math.ceil(excess / rate), 1), self.max_retry_s))


class JobTooLarge(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclasses.dataclass
class Job:
    kind: str
    payload: Any
    size: int                              # samples: what max_batch and max_queue count
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    enqueued: float = dataclasses.field(default_factory=time.monotonic)


RunBatch = Callable[[str, Sequence[Any]], list[Any]]   # (kind, payloads) -> one result per payload


class Batcher:
    def __init__(self, run_batch: RunBatch, *, max_batch: int, max_wait_s: float, max_queue: int,
                 batch_limits: dict[str, int] | None = None, on_batch: Callable[[str, int], None] | None = None,
                 on_depth: Callable[[int], None] | None = None, stream=None):
        self.run_batch, self.max_batch, self.max_wait_s, self.max_queue = run_batch, max_batch, max_wait_s, max_queue
        self.batch_limits = dict(batch_limits or {})
        self.on_batch, self.on_depth = on_batch, on_depth
        self.stream = stream                   # a ScoreStream for its kinds, or None
        self._streamed = frozenset(stream.kinds) if stream is not None else frozenset()
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._depth = 0
        self.drain = DrainRate()
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="rm_jax-device-worker", daemon=True)

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def worker_alive(self) -> bool:
        """Whether the device worker runs: False before ``start()``, and after a ``stop()`` that
        answered every admitted job (``stop(timeout_s)`` may return while it still runs)."""
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Finish every admitted job, then end the worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    async def submit(self, kind: str, payload: Any, size: int) -> Any:
        loop = asyncio.get_running_loop()
        job = Job(kind, payload, max(int(size), 1), loop, loop.create_future())
        with self._cond:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if job.size > self.max_queue:
                raise JobTooLarge(f"{job.size} samples in one request > --max_queue={self.max_queue}")
            if self._depth + job.size > self.max_queue:
                excess = self._depth + job.size - self.max_queue
                raise QueueFull(self._depth, self.max_queue, self.drain.retry_after_s(excess, time.monotonic()))
            self._depth += job.size
            self._queue.append(job)
            self._cond.notify_all()
        self._report_depth()
        return await job.future

    # -- worker ---------------------------------------------------------------------------------

    def _limit(self, kind: str) -> int:
        return self.batch_limits.get(kind, self.max_batch)

    def _take_ready(self, now: float) -> list[Job] | None:
        """(Under the lock.) The next run_batch batch if its window has closed: the oldest
        unstreamed job plus same-kind jobs that arrived meanwhile, up to the kind's limit."""
        first = next((j for j in self._queue if j.kind not in self._streamed), None)
        if first is None:
            return None
        limit = self._limit(first.kind)
        pending = sum(j.size for j in self._queue if j.kind == first.kind)
        if not (self._stopping or pending >= limit or now >= first.enqueued + self.max_wait_s):
            return None
        batch, total, keep = [], 0, collections.deque()
        for job in self._queue:
            if job.kind == first.kind and (not batch or total + job.size <= limit):
                batch.append(job)
                total += job.size
            else:
                keep.append(job)
        self._queue = keep
        return batch

    def _due(self) -> float | None:
        """(Under the lock.) The earliest time a waiting batch's window closes."""
        times = [j.enqueued + self.max_wait_s for j in self._queue if j.kind not in self._streamed][:1]
        if self.stream is not None and self.stream.due() is not None:
            times.append(self.stream.due())
        return min(times) if times else None

    def _next(self):
        """Block until there is work: (jobs to admit into the stream, a run_batch batch or None,
        stopping); None when stopped with nothing left."""
        stream = self.stream
        with self._cond:
            while True:
                now = time.monotonic()
                fresh = [j for j in self._queue if j.kind in self._streamed]
                if fresh:
                    self._queue = collections.deque(j for j in self._queue if j.kind not in self._streamed)
                other = self._take_ready(now)
                if fresh or other or (stream is not None and (stream.inflight or stream.ready(now, self._stopping))):
                    return fresh, other, self._stopping
                if self._stopping and not self._queue and (stream is None or not stream.pending):
                    return None
                due = self._due()
                self._cond.wait(None if due is None else max(due - now, 0.0))

    def _work(self) -> None:
        stream = self.stream
        while True:
            work = self._next()
            if work is None:
                return
            fresh, other, stopping = work
            for job in fresh:
                try:
                    done = stream.admit(job, job.kind, job.payload, job.enqueued)
                except Exception as e:   # noqa: BLE001 -- this request fails alone
                    logging.exception("job of kind %s failed", job.kind)
                    done = [(job, None, e)]
                self._deliver_all(done)
            if other:
                self._run(other)
            if stream is None:
                continue
            dispatched = False
            if stream.inflight < stream.depth:
                try:
                    dispatched = stream.dispatch(time.monotonic(), flush=stopping)
                except StepFailed as f:
                    self._isolate(f)
                    continue
            if stream.inflight and (not dispatched or stream.inflight >= stream.depth):
                try:
                    self._deliver_all(stream.collect())
                except StepFailed as f:
                    self._isolate(f)

    def _run(self, batch: list[Job]) -> None:
        kind = batch[0].kind
        if self.on_batch is not None:
            self.on_batch(kind, sum(j.size for j in batch))
        try:
            results = self.run_batch(kind, [j.payload for j in batch])
            for job, result in zip(batch, results):
                self._deliver(job, result, None)
        except Exception as e:   # noqa: BLE001 -- isolate the job that broke the batch
            if len(batch) == 1:
                logging.exception("batch of kind %s failed", kind)
                self._deliver(batch[0], None, e)
            else:
                logging.warning("batch of %d %s jobs failed (%s); retrying them one by one", len(batch), kind, e)
                self._one_by_one(batch)

    def _isolate(self, failed: StepFailed) -> None:
        """A device step of the stream raised: its jobs leave the stream and run alone."""
        jobs = failed.tokens
        for job in jobs:
            self.stream.drop(job)
        if len(jobs) == 1:
            logging.error("device batch of one %s job failed: %s", jobs[0].kind, failed.error)
            self._deliver(jobs[0], None, failed.error)
            return
        logging.warning("device batch of %d jobs failed (%s); retrying them one by one", len(jobs), failed.error)
        self._one_by_one(jobs)

    def _one_by_one(self, jobs: list[Job]) -> None:
        for job in jobs:
            try:
                self._deliver(job, self.run_batch(job.kind, [job.payload])[0], None)
            except Exception as e1:   # noqa: BLE001
                logging.exception("job of kind %s failed", job.kind)
                self._deliver(job, None, e1)

    def _deliver_all(self, done) -> None:
        for job, result, error in done:
            self._deliver(job, result, error)

    def _deliver(self, job: Job, result: Any, error: BaseException | None) -> None:
        with self._cond:
            self._depth -= job.size
            self.drain.add(job.size, time.monotonic())
        self._report_depth()

        def resolve():
            if job.future.done():        # the handler was cancelled (client gone): nobody waits
                return
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)
        try:
            job.loop.call_soon_threadsafe(resolve)
        except RuntimeError:             # the event loop is closed: nobody can wait any more
            pass

    def _report_depth(self) -> None:
        if self.on_depth is not None:
            self.on_depth(self._depth)
