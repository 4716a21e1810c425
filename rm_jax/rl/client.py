"""The one reward client every RL adapter uses: batches, bounded in flight, retries, never raises.

An RL step must never fail because the judge is busy. So:

* **Batches.** Rollouts are posted to ``/get_reward`` in requests of at most ``batch_size``
  samples; ``score_one`` (verl's per-rollout async calls) coalesces the calls that arrive within
  ``coalesce_ms`` into one request.
* **Bounded in flight.** At most ``max_in_flight`` requests are open at once, so a burst of
  rollouts queues here, not in the server's admission queue (``max_in_flight * batch_size`` should
  stay under the server's ``--max_queue``).
* **Retries.** A 503 (queue full, draining), 429, 502/504 or a transport error is retried after
  the server's ``Retry-After`` (when it gives one) or an exponential backoff, plus jitter so that
  refused clients do not return in step; all retries of a request share one deadline
  (``deadline_s``). A 4xx other than 429 is not retried: the request itself is wrong.
* **At worst, the gate.** When a request still fails, its samples get the gate reward (the value
  a malformed call gets), the error is logged and counted (``stats``), and the caller carries on.

``RewardClient`` is async (one event loop); ``SyncRewardClient`` runs one on a private loop in a
background thread for synchronous callers (TRL, verl's reward managers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from typing import Any, Sequence

import httpx
import tenacity
from absl import logging

from rm_jax.rl.common import RewardRecord, auth_headers, records, reward_request, server_url

RETRY_STATUS = (429, 502, 503, 504)
GATE_REWARD = -2.0          # the server's default gate (score.reward penalties.gate_reward)


@dataclasses.dataclass(frozen=True)
class ClientSettings:
    url: str | None = None              # default: $RM_JAX_REWARD_URL, else http://127.0.0.1:8000
    api_key: str | None = None          # default: $RM_JAX_API_KEY
    batch_size: int = 32                # samples per request
    max_in_flight: int = 8              # open requests at once
    coalesce_ms: float = 5.0            # score_one: how long a call waits for others to share a request
    deadline_s: float = 900.0           # all attempts of one request
    request_timeout_s: float = 300.0    # one attempt
    backoff_s: float = 0.5              # first backoff without Retry-After; doubles, at most backoff_max_s
    backoff_max_s: float = 30.0
    gate_reward: float = GATE_REWARD


@dataclasses.dataclass
class ClientStats:
    requests: int = 0                   # requests that got an answer
    retries: int = 0                    # attempts refused or failed, then retried
    failed_samples: int = 0             # samples that took the gate because the request failed
    last_error: str | None = None


class Retryable(Exception):
    """A refused or failed attempt worth another try; ``retry_after_s`` from the server, if any."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("Retry-After")
    try:
        return max(float(value), 0.0) if value is not None else None
    except ValueError:
        return None


def gate_record(gate: float, error: str) -> RewardRecord:
    return RewardRecord(score=gate, p_pass=0.0, rule_score=gate, n_issues=0.0, img=-1.0, gated=1.0, error=error)


class RewardClient:
    """Async client of ``/get_reward`` (see the module docstring). One per event loop."""

    def __init__(self, settings: ClientSettings = ClientSettings()):
        self.settings = settings
        self.url = server_url(settings.url) + "/get_reward"
        self.headers = auth_headers(settings.api_key)
        self.stats = ClientStats()
        self._http: httpx.AsyncClient | None = None
        self._slots: asyncio.Semaphore | None = None
        self._pending: list[tuple[str, Any, asyncio.Future]] = []
        self._flush: asyncio.TimerHandle | None = None

    def _open(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        if self._http is None or self._http.is_closed:
            s = self.settings
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(s.request_timeout_s, connect=10.0),
                                           limits=httpx.Limits(max_connections=s.max_in_flight))
            self._slots = asyncio.Semaphore(s.max_in_flight)
        return self._http, self._slots  # type: ignore[return-value]

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    # -- batches --------------------------------------------------------------------------------

    async def score(self, completions: Sequence[str], contexts: Sequence[Any]) -> list[RewardRecord]:
        """One record per completion, in order; requests of ``batch_size``, ``max_in_flight`` open."""
        if len(completions) != len(contexts):
            raise ValueError(f"{len(completions)} completions for {len(contexts)} contexts")
        b = self.settings.batch_size
        chunks = [(list(completions[i:i + b]), list(contexts[i:i + b])) for i in range(0, len(completions), b)]
        got = await asyncio.gather(*(self._request(c, x) for c, x in chunks))
        return [r for part in got for r in part]

    async def score_one(self, completion: str, context: Any) -> RewardRecord:
        """One rollout; calls arriving within ``coalesce_ms`` share a request."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((completion, context, future))
        if len(self._pending) >= self.settings.batch_size:
            self._send_pending()
        elif self._flush is None:
            self._flush = loop.call_later(self.settings.coalesce_ms / 1000.0, self._send_pending)
        return await future

    def _send_pending(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        batch, self._pending = self._pending, []
        if batch:
            asyncio.ensure_future(self._answer(batch))

    async def _answer(self, batch: list[tuple[str, Any, asyncio.Future]]) -> None:
        got = await self._request([c for c, _, _ in batch], [x for _, x, _ in batch])
        for (_, _, future), rec in zip(batch, got):
            if not future.done():
                future.set_result(rec)

    # -- one request ----------------------------------------------------------------------------

    def _wait(self, state: tenacity.RetryCallState) -> float:
        s = self.settings
        error = state.outcome.exception() if state.outcome is not None else None
        backoff = min(s.backoff_s * 2 ** (state.attempt_number - 1), s.backoff_max_s)
        base = error.retry_after_s if isinstance(error, Retryable) and error.retry_after_s is not None else backoff
        return base * random.uniform(1.0, 1.5)      # jitter: refused clients do not come back in step

    async def _attempt(self, body: dict) -> dict:
        http, slots = self._open()
        async with slots:
            try:
                resp = await http.post(self.url, json=body, headers=self.headers)
            except httpx.TransportError as e:
                raise Retryable(f"{type(e).__name__}: {e}") from e
        if resp.status_code in RETRY_STATUS:
            raise Retryable(f"HTTP {resp.status_code}: {resp.text[:200]}", _retry_after(resp))
        resp.raise_for_status()
        return resp.json()

    async def _request(self, completions: list[str], contexts: list[Any]) -> list[RewardRecord]:
        s = self.settings
        try:
            body = reward_request(completions, contexts)
        except TypeError as e:                       # a context that is neither JSON text nor an object
            return self._give_up(len(completions), f"bad sample context: {e}")

        def count_retry(_state) -> None:
            self.stats.retries += 1
        try:
            async for attempt in tenacity.AsyncRetrying(
                    retry=tenacity.retry_if_exception_type(Retryable), wait=self._wait,
                    stop=tenacity.stop_before_delay(s.deadline_s), before_sleep=count_retry, reraise=True):
                with attempt:
                    answer = await self._attempt(body)
            self.stats.requests += 1
            return records(answer)
        except (Retryable, httpx.HTTPError, ValueError, KeyError) as e:
            return self._give_up(len(completions), f"{type(e).__name__}: {e}")

    def _give_up(self, n: int, error: str) -> list[RewardRecord]:
        self.stats.failed_samples += n
        self.stats.last_error = error
        logging.error("rm_jax reward: %d samples take the gate reward %.1f after the request failed: %s "
                      "(%d samples so far)", n, self.settings.gate_reward, error, self.stats.failed_samples)
        return [gate_record(self.settings.gate_reward, error)] * n


class SyncRewardClient:
    """``RewardClient`` for synchronous callers: its own event loop in a daemon thread."""

    def __init__(self, settings: ClientSettings = ClientSettings()):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rm_jax-reward-client", daemon=True)
        self._thread.start()
        self.client = RewardClient(settings)

    @property
    def stats(self) -> ClientStats:
        return self.client.stats

    def score(self, completions: Sequence[str], contexts: Sequence[Any]) -> list[RewardRecord]:
        return asyncio.run_coroutine_threadsafe(self.client.score(completions, contexts), self._loop).result()

    def score_one(self, completion: str, context: Any) -> RewardRecord:
        """Thread-safe: calls from a thread pool (verl's run_in_executor) are coalesced."""
        return asyncio.run_coroutine_threadsafe(self.client.score_one(completion, context), self._loop).result()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.client.close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
