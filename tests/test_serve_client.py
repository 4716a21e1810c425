"""The RL reward client (rm_jax.rl.client) against a real HTTP server that refuses on purpose.

The server here is a small FastAPI app on loopback that answers ``/get_reward`` in the judge's
shape (reward = the completion's length, so answers are checkable) and refuses with 503 +
Retry-After when told to: what the client does with a busy judge -- batch, bound its requests
in flight, wait, retry, and at worst return the gate -- is the behaviour under test. The judge
server itself is exercised by test_serve.py and the burst benchmark.
"""

import asyncio
import json
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from loopback import free_port
from rm_jax.rl import verl_reward
from rm_jax.rl.client import ClientSettings, RewardClient, SyncRewardClient
from rm_jax.serve.batcher import DrainRate

LABEL = json.dumps({"id": "s", "messages": [{"role": "user", "content": "hi"}]})


class Refuser:
    """Counts requests; refuses the first ``refuse`` with 503 (Retry-After ``retry_after``)."""

    def __init__(self):
        self.refuse, self.retry_after, self.status = 0, "1", 503
        self.sizes: list[int] = []
        self.times: list[float] = []
        self.open = self.max_open = 0
        self.app = FastAPI()

        @self.app.post("/get_reward")
        async def get_reward(request: Request):
            body = await request.json()
            self.times.append(time.monotonic())
            if self.refuse > 0:
                self.refuse -= 1
                return JSONResponse({"detail": "queue full"}, status_code=self.status,
                                    headers={"Retry-After": self.retry_after})
            self.open += 1
            self.max_open = max(self.max_open, self.open)
            await asyncio.sleep(0.05)
            self.open -= 1
            self.sizes.append(len(body["query"]))
            n = len(body["query"])
            rewards = [float(len(q)) for q in body["query"]]
            logs = {k: [0.0] * n for k in ("rule_score", "n_issues", "img", "gated", "error")}
            logs["p_pass"] = [0.5] * n
            return {"rewards": rewards, "scores": [0.5] * n, "extra_logs": logs, "errors": [None] * n}


@pytest.fixture(scope="module")
def refuser():
    r = Refuser()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(r.app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    r.url = f"http://127.0.0.1:{port}"
    yield r
    server.should_exit = True
    t.join(10)


def _reset(r: Refuser, refuse=0, retry_after="1", status=503):
    r.refuse, r.retry_after, r.status = refuse, retry_after, status
    r.sizes.clear()
    r.times.clear()
    r.max_open = 0


def test_batches_bound_in_flight_and_keep_order(refuser):
    _reset(refuser)
    client = SyncRewardClient(ClientSettings(url=refuser.url, batch_size=8, max_in_flight=3))
    texts = ["x" * k for k in range(50)]
    got = client.score(texts, [LABEL] * 50)
    assert [r.score for r in got] == [float(k) for k in range(50)]
    assert sorted(refuser.sizes) == [2] + [8] * 6 and refuser.max_open <= 3
    assert client.stats.requests == 7 and client.stats.failed_samples == 0
    client.close()


def test_retry_after_is_honoured_with_jitter_then_answered(refuser):
    _reset(refuser, refuse=2, retry_after="1")
    client = SyncRewardClient(ClientSettings(url=refuser.url, batch_size=4))
    got = client.score(["abc"], [LABEL])
    assert got[0].score == 3.0 and got[0].error is None
    gaps = [b - a for a, b in zip(refuser.times, refuser.times[1:])]
    assert len(gaps) == 2 and all(1.0 <= g <= 1.5 + 0.3 for g in gaps)     # Retry-After x jitter in [1, 1.5)
    assert client.stats.retries == 2 and client.stats.failed_samples == 0
    client.close()


def test_final_failure_returns_the_gate_logs_and_counts(refuser, caplog):
    _reset(refuser, refuse=1000, retry_after="0")
    client = SyncRewardClient(ClientSettings(url=refuser.url, batch_size=4, deadline_s=1.0, backoff_s=0.1))
    t0 = time.monotonic()
    got = client.score(["a", "b", "c", "d", "e"], [LABEL] * 5)
    assert time.monotonic() - t0 < 5.0
    assert [r.score for r in got] == [-2.0] * 5 and all(r.gated == 1.0 and "503" in r.error for r in got)
    assert client.stats.failed_samples == 5 and client.stats.retries >= 2
    _reset(refuser, refuse=1, status=400)                 # the request itself is wrong: no retry
    bad = client.score(["a"], [LABEL])
    assert bad[0].score == -2.0 and len(refuser.times) == 1 and client.stats.failed_samples == 6
    client.close()
    dead = SyncRewardClient(ClientSettings(url=f"http://127.0.0.1:{free_port()}", deadline_s=0.5, backoff_s=0.1))
    assert dead.score(["a"], [LABEL])[0].score == -2.0 and "ConnectError" in dead.stats.last_error
    dead.close()


def test_verl_forms_coalesce_and_agree(refuser):
    _reset(refuser)
    kw = dict(url=refuser.url, batch_size=16)

    async def rollouts():
        return await asyncio.gather(*(verl_reward.compute_score("d", "y" * k, LABEL, {}, **kw) for k in range(40)))
    got = asyncio.run(rollouts())
    assert [g["score"] for g in got] == [float(k) for k in range(40)]
    assert sorted(refuser.sizes) == [8, 16, 16]                # 40 per-rollout calls in 3 requests
    sync = verl_reward.compute_score_sync("d", "yyy", "", {"sample": json.loads(LABEL)}, **kw)
    batch = verl_reward.compute_score_batch(["d"] * 3, ["a", "bb", "ccc"], [LABEL] * 3, None, **kw)
    assert sync["score"] == 3.0 and [b["score"] for b in batch] == [1.0, 2.0, 3.0]
    assert set(sync) == {"score", "p_pass", "rule_score", "n_issues", "img", "gated"}


def test_async_client_in_flight_bound_under_a_burst(refuser):
    _reset(refuser)

    async def burst():
        client = RewardClient(ClientSettings(url=refuser.url, batch_size=4, max_in_flight=2, coalesce_ms=1))
        got = await asyncio.gather(*(client.score_one("z" * k, LABEL) for k in range(30)))
        await client.close()
        return got
    got = asyncio.run(burst())
    assert [g.score for g in got] == [float(k) for k in range(30)] and refuser.max_open <= 2
    assert max(refuser.sizes) <= 4


def test_drain_rate_sets_retry_after():
    rate = DrainRate(window_s=10.0)
    assert rate.retry_after_s(100, now=0.0) == 1                # nothing measured yet
    for t in range(11):
        rate.add(20, now=float(t))                             # 220 samples over 10 s: 22 / s
    assert rate.retry_after_s(100, now=10.0) == 5               # ceil(100 / 22)
    assert rate.retry_after_s(10_000, now=10.0) == 60           # capped
    assert rate.retry_after_s(100, now=100.0) == 1              # stale measurements expire
