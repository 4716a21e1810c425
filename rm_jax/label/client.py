"""The teacher pool: OpenAI-compatible endpoints behind one `complete` call.

* One `AsyncOpenAI` per endpoint (``base_url``, e.g. ``http://host:8000/v1``: vLLM, SGLang or
  rm_jax's launch.serve). The SDK's own retries are off; tenacity owns them, so every attempt is
  counted (label_meta.attempts) and may go to another endpoint.
* Concurrency is bounded per endpoint (a semaphore each; default 2: the report's image teacher
  saturated at 3 full-resolution multi-image requests). Each attempt goes to the least loaded
  endpoint (one whose last attempts failed comes last), ties in turn, so N shards share the work
  and a slow or dead one gets less of it.
  A slot is held only for the request itself, never across a backoff.
* Retries: 429, 5xx, 408, timeouts, connection errors and unreadable bodies (a truncated
  response) back off exponentially with full jitter; a 429/503 Retry-After is honoured (capped).
  Other 4xx (bad request, unknown model, auth) fail at once: retrying cannot help.
* A reply the caller cannot parse is asked again `unusable_retries` times (a temperature-0
  teacher may still vary under batching, but mostly repeats itself); then the sample is a
  recorded failure (``unusable_reply``), retried by the next run.
* Each attempt has a deadline of ``timeout_s`` (the SDK's timeout is per read; the deadline
  also bounds a server that trickles bytes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from typing import Callable, Generic, TypeVar

import openai
import tenacity
from openai.types.chat import ChatCompletion

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 6           # attempts = max_retries + 1
    timeout_s: float = 120.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    retry_after_max_s: float = 60.0
    # An unusable reply is asked again this many times at most: a temperature-0 teacher mostly
    # repeats itself, and the full budget would spend 7 requests per bad reply.
    unusable_retries: int = 1


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    # A verdict is one JSON line (a one-line reason); the budget also sizes the server's KV cache.
    max_tokens: int = 256
    temperature: float = 0.0   # labels must be reproducible: a rerun asks the same question


class UnusableReply(Exception):
    """The teacher answered, but not in a form the caller can use (retried)."""


class TeacherError(Exception):
    """A request that failed for good: `code` and `detail` go to OUT.errors.jsonl."""

    def __init__(self, code: str, detail: str, attempts: int, elapsed_s: float):
        super().__init__(f"{code}: {detail}")
        self.code, self.detail, self.attempts, self.elapsed_s = code, detail, attempts, elapsed_s


@dataclasses.dataclass(frozen=True)
class Completion(Generic[T]):
    value: T                 # the parsed reply
    text: str                # the teacher's raw reply
    model: str
    endpoint: str
    attempts: int
    latency_s: float         # the successful attempt
    elapsed_s: float         # first attempt to success, backoffs included


class _Deadline(Exception):
    pass


def describe(exc: BaseException) -> tuple[str, str]:
    """(a short stable code for stats, the detail) of a failed attempt."""
    if isinstance(exc, openai.APIStatusError):
        body = exc.response.text[:200] if exc.response is not None else ""
        return f"http_{exc.status_code}", body
    if isinstance(exc, (_Deadline, openai.APITimeoutError, asyncio.TimeoutError)):
        return "timeout", "no complete reply within timeout_s"
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__ or exc.__context__
        return "connection_error", f"{type(cause).__name__ if cause else ''} {cause or exc}".strip()
    if isinstance(exc, UnusableReply):
        return "unusable_reply", str(exc)
    if isinstance(exc, (openai.APIResponseValidationError, json.JSONDecodeError)):
        return "bad_response_body", f"{type(exc).__name__}: {exc}"
    return "error", f"{type(exc).__name__}: {exc}"


def retryable(exc: BaseException) -> bool:
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in (408, 409, 429) or exc.status_code >= 500
    return isinstance(exc, (openai.APIConnectionError, openai.APIResponseValidationError, _Deadline,
                            UnusableReply, json.JSONDecodeError, asyncio.TimeoutError))


def _retry_after(exc: BaseException | None) -> float | None:
    if isinstance(exc, openai.APIStatusError) and exc.response is not None:
        value = exc.response.headers.get("retry-after")
        try:
            return max(0.0, float(value)) if value is not None else None
        except ValueError:
            return None   # an HTTP date: fall back to the backoff
    return None


class RetryAfterWait(tenacity.wait.wait_base):
    """A tenacity wait strategy: full-jitter exponential backoff (``policy.backoff_initial_s`` up to
    ``policy.backoff_max_s``), but at least the server's Retry-After when it sent one, capped at
    ``policy.retry_after_max_s``."""

    def __init__(self, policy: RetryPolicy):
        self.jitter = tenacity.wait_random_exponential(multiplier=policy.backoff_initial_s,
                                                       max=policy.backoff_max_s)
        self.cap = policy.retry_after_max_s

    def __call__(self, retry_state) -> float:
        wait = self.jitter(retry_state)
        after = _retry_after(retry_state.outcome.exception() if retry_state.outcome else None)
        return max(wait, min(after, self.cap)) if after is not None else wait


@dataclasses.dataclass
class _Endpoint:
    base_url: str
    client: openai.AsyncOpenAI
    slots: asyncio.Semaphore
    capacity: int
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    streak: int = 0      # consecutive failed attempts (0 after a success)


class TeacherPool:
    """Endpoints of one teacher model. Create inside the running event loop."""

    def __init__(self, base_urls: list[str], model: str, *, concurrency: int = 2,
                 policy: RetryPolicy = RetryPolicy(), generation: GenerationSettings = GenerationSettings(),
                 api_key: str = "EMPTY"):
        if not base_urls:
            raise ValueError("a teacher pool needs at least one endpoint")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.model, self.policy, self.generation = model, policy, generation
        self.endpoints = [
            _Endpoint(url, openai.AsyncOpenAI(base_url=url, api_key=api_key, timeout=policy.timeout_s,
                                              max_retries=0),
                      asyncio.Semaphore(concurrency), concurrency)
            for url in base_urls]
        self._turn = itertools.count()

    @property
    def capacity(self) -> int:
        return sum(e.capacity for e in self.endpoints)

    def _pick(self) -> _Endpoint:
        # Healthy before failing (a dead shard has nothing in flight and would otherwise look
        # idlest), then least loaded; among equals, round robin (so idle shards all get work).
        start = next(self._turn) % len(self.endpoints)
        order = self.endpoints[start:] + self.endpoints[:start]
        return min(order, key=lambda e: (min(e.streak, 3), e.in_flight / e.capacity))

    async def _attempt(self, ep: _Endpoint, messages: list[dict]) -> tuple[str, float]:
        ep.in_flight += 1   # counted while waiting for a slot too: the next pick avoids a queue
        try:
            async with ep.slots:
                ep.requests += 1
                t0 = time.monotonic()
                try:
                    # The SDK's documented raw route (same HTTP, errors and parsing as
                    # chat.completions.create) without its typed-params walk over the
                    # messages, which cost more per request than the thumbnails.
                    resp = await asyncio.wait_for(
                        ep.client.post("/chat/completions", cast_to=ChatCompletion, body={
                            "model": self.model, "messages": messages, "max_tokens": self.generation.max_tokens,
                            "temperature": self.generation.temperature}),
                        timeout=self.policy.timeout_s)
                except asyncio.TimeoutError:
                    raise _Deadline() from None
                latency = time.monotonic() - t0
        except BaseException:
            ep.failures += 1
            ep.streak += 1
            raise
        finally:
            ep.in_flight -= 1
        ep.streak = 0
        if not getattr(resp, "choices", None):
            raise UnusableReply("reply without choices")
        return resp.choices[0].message.content or "", latency

    async def complete(self, messages: list[dict], parse: Callable[[str], T]) -> Completion[T]:
        """Send one chat request (retried); `parse` turns the reply into T or raises UnusableReply."""
        t_start = time.monotonic()
        attempts = 0
        unusable = 0
        last: dict = {}

        def again(exc: BaseException) -> bool:
            nonlocal unusable
            if isinstance(exc, UnusableReply):
                unusable += 1
                return unusable <= self.policy.unusable_retries
            return retryable(exc)

        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(self.policy.max_retries + 1),
            wait=RetryAfterWait(self.policy), retry=tenacity.retry_if_exception(again), reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    attempts += 1
                    ep = self._pick()
                    text, latency = await self._attempt(ep, messages)
                    value = parse(text)
                    last = dict(text=text, endpoint=ep.base_url, latency=latency, value=value)
        except Exception as e:  # noqa: BLE001 -- every failure becomes a recorded reason
            raise TeacherError(*describe(e), attempts, time.monotonic() - t_start) from e
        return Completion(last["value"], last["text"], self.model, last["endpoint"], attempts,
                          last["latency"], time.monotonic() - t_start)

    def endpoint_stats(self) -> list[dict]:
        return [{"endpoint": e.base_url, "requests": e.requests, "failed_requests": e.failures}
                for e in self.endpoints]

    async def aclose(self) -> None:
        for e in self.endpoints:
            await e.client.close()
