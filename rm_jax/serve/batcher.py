"""Dynamic batching: one worker thread drives the device; concurrent requests share its batches.

Request handlers (on the asyncio event loop) submit a ``Job`` -- one request's samples of one
kind -- and await its future. The worker takes the oldest job, waits up to ``max_wait_s`` *from
that job's arrival* for more jobs of the same kind, then runs them as one batch of at most the
kind's limit in samples (``batch_limits``, default ``max_batch``; a single job larger than that
runs alone). The scorer splits what it gets into device batches of its own batch size. Putting every job of a batch through one ``Scorer`` call is what keeps GRPO
groups together: the scorer finds samples with one ``prompt_id`` across requests and prefills
their shared prefix once.

* **Admission control.** ``max_queue`` bounds the samples admitted and not yet answered; a job
  that would exceed it is refused (``QueueFull``: the server answers 503 with Retry-After) rather
  than queued without bound while every client times out.
* **Isolation.** If a batch raises, its jobs are retried one by one, so a request that breaks the
  device call fails alone and its neighbours still get their results.
* **Disconnects.** A job's result is delivered to its future if anyone still waits; a client that
  went away neither cancels nor breaks the batch it is in.
* **Draining.** ``stop()`` lets the worker finish every admitted job before it exits (SIGTERM:
  uvicorn first waits for the requests in flight, then the app's shutdown calls this).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

from absl import logging


class QueueFull(Exception):
    def __init__(self, depth: int, limit: int, retry_after_s: int = 1):
        super().__init__(f"queue full: {depth} samples waiting, limit {limit}")
        self.retry_after_s = retry_after_s


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
                 on_depth: Callable[[int], None] | None = None):
        self.run_batch, self.max_batch, self.max_wait_s, self.max_queue = run_batch, max_batch, max_wait_s, max_queue
        self.batch_limits = dict(batch_limits or {})
        self.on_batch, self.on_depth = on_batch, on_depth
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._depth = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="rm_jax-device-worker", daemon=True)

    @property
    def depth(self) -> int:
        return self._depth

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
                raise QueueFull(self._depth, self.max_queue)
            self._depth += job.size
            self._queue.append(job)
            self._cond.notify_all()
        self._report_depth()
        return await job.future

    # -- worker ---------------------------------------------------------------------------------

    def _limit(self, kind: str) -> int:
        return self.batch_limits.get(kind, self.max_batch)

    def _take(self) -> list[Job] | None:
        """The next batch: the oldest job plus same-kind jobs that arrive within its wait window."""
        with self._cond:
            while not self._queue:
                if self._stopping:
                    return None
                self._cond.wait()
            first = self._queue[0]
            limit = self._limit(first.kind)
            deadline = first.enqueued + self.max_wait_s
            while not self._stopping:
                pending = sum(j.size for j in self._queue if j.kind == first.kind)
                left = deadline - time.monotonic()
                if pending >= limit or left <= 0:
                    break
                self._cond.wait(left)
            batch, total, keep = [], 0, collections.deque()
            for job in self._queue:
                if job.kind == first.kind and (not batch or total + job.size <= limit):
                    batch.append(job)
                    total += job.size
                else:
                    keep.append(job)
            self._queue = keep
            return batch

    def _work(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
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
                    for job in batch:
                        try:
                            self._deliver(job, self.run_batch(kind, [job.payload])[0], None)
                        except Exception as e1:   # noqa: BLE001
                            logging.exception("job of kind %s failed", kind)
                            self._deliver(job, None, e1)

    def _deliver(self, job: Job, result: Any, error: BaseException | None) -> None:
        with self._cond:
            self._depth -= job.size
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
