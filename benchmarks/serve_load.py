"""Reward server under load: 64 concurrent loopback clients vs in-process batched scoring.

    python -m benchmarks.serve_load [--clients=64 --seconds=30 --max_batch=32 --n=576 --compile_cache=DIR]

The tiny judge (configs/tiny.py, random weights, the synthetic tokenizer) is served by the real
app (``rm_jax.serve.app``) under uvicorn on 127.0.0.1 in this process; ``--clients`` asyncio
clients, in one child process (rollout workers are other processes; in the server's own process
their JSON and HTTP work would hold its GIL: ``--noclient_process``), each post ``/v1/score``
requests of 1-8 consecutive samples, taken in turn from one cursor cycling over a pool of ``--n``
synthetic samples (GRPO-style groups of 3, with images), back to back, for a bounded time.
The baseline is the same ``Scorer`` scoring the whole pool in-process in batches of
``--max_batch`` (what ``launch.score`` does): the ratio shows how much of the device's batched
throughput survives HTTP, JSON and dynamic batching. Both are warmed up first (compiles). Full
scoring (verdict + decoded reason/issues/img), ``--max_new_tokens`` of decoding. After the load,
the ``stream`` line drives the server's scheduler (``rm_jax.serve.stream``) in-process with the
same request mix and no HTTP, back to back with the pool figure: what scheduling alone keeps.

Warm-up: every batch the server forms mixes other buckets, image counts and GRPO group sizes,
and each new static shape compiles once; under load windows are repeated until
``--warmup_quiet_windows`` in a row compile nothing, so the timed phase measures the steady state
(the compile count is printed).

Goals: 0 errors, ratio >= 0.8, p99 < 5x p50. A measurement, not a test. Last line: one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
import time

from absl import app, flags

flags.DEFINE_integer("clients", 64, "concurrent clients")
flags.DEFINE_float("seconds", 30.0, "timed load phase")
flags.DEFINE_float("warmup_seconds", 20.0, "untimed load windows first, repeated until one compiles nothing")
flags.DEFINE_integer("warmup_quiet_windows", 2, "consecutive warm-up windows that compile nothing before the timed phase "
                     "(the rarest shapes, e.g. a batch with many images, show up once in a few windows)")
flags.DEFINE_float("warmup_max_seconds", 900.0, "stop warming up after this long (the figures then include compiles)")
flags.DEFINE_string("compile_cache", "", "JAX persistent compilation cache dir (reruns skip the warm-up compiles)")
flags.DEFINE_integer("max_batch", 32, "server batch = in-process batch")
flags.DEFINE_float("max_wait_ms", 10.0, "server batching window")
flags.DEFINE_integer("n", 576, "sample pool: larger than what 64 clients keep outstanding (~290), so no sample is queued twice (a repeat would share its group's prefill and flatter the server)")
flags.DEFINE_integer("max_new_tokens", 32, "decoding budget after the verdict")
flags.DEFINE_integer("seed", 0, "request mix")
flags.DEFINE_float("stream_seconds", 60.0, "the in-process continuous-batching figure (no HTTP): half untimed")
flags.DEFINE_bool("text_only", False, "pool without images: far fewer static shapes, so the warm-up ends sooner")
flags.DEFINE_bool("warmup", True, "the server compiles its shape ladder before ready (--nowarmup: shapes compile "
                  "in the warm-up windows instead)")
flags.DEFINE_bool("client_process", True, "run the clients in a child process, as rollout workers are (False: in the "
                  "server's own process, where 64 clients' JSON and HTTP work contends for the server's GIL)")


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def _load(url: str, pool: list[dict], clients: int, seconds: float, seed: int):
    import httpx
    rng = random.Random(seed)
    latencies: list[float] = []
    errors = samples = requests = 0
    end = time.perf_counter() + seconds
    cursor = [rng.randrange(len(pool))]

    def take(k: int) -> list[dict]:
        # Consecutive samples from one cursor cycling over the pool: concurrent requests carry
        # different samples, as RL rollouts do (random windows would repeat samples in a batch
        # and make the server recompute them).
        start, cursor[0] = cursor[0], (cursor[0] + k) % len(pool)
        return [pool[(start + i) % len(pool)] for i in range(k)]

    async def client(c: httpx.AsyncClient, r: random.Random):
        nonlocal errors, samples, requests
        while time.perf_counter() < end:
            k = r.randint(1, 8)
            t0 = time.perf_counter()
            try:
                resp = await c.post("/v1/score", json={"samples": take(k), "mode": "full"})
                ok = resp.status_code == 200 and all("error" not in row for row in resp.json()["results"])
            except Exception:   # noqa: BLE001 -- counted, the load goes on
                ok = False
            latencies.append(time.perf_counter() - t0)
            requests += 1
            if ok:
                samples += k
            else:
                errors += 1

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300.0, limits=limits) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, random.Random(rng.random())) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return dict(samples=samples, requests=requests, errors=errors, wall=wall, latencies=latencies)


_POOL: list[dict] = []


def _set_pool(pool: list[dict]) -> None:
    _POOL[:] = pool


def _load_in_child(url: str, clients: int, seconds: float, seed: int) -> dict:
    """`_load` in the client process, over the pool its initializer received once."""
    import logging as py_logging
    py_logging.getLogger("httpx").setLevel(py_logging.WARNING)
    return asyncio.run(_load(url, _POOL, clients, seconds, seed))


def _stream_in_process(engine, parsed: list, clients: int, seconds: float, seed: int, max_wait_s: float,
                       compiles: list) -> dict:
    """The server's scheduling without HTTP: ``clients`` requests of 1-8 consecutive samples kept
    outstanding (as the load's clients do), admitted straight into a ``ScoreStream`` and driven as
    the worker drives it. A first half untimed (the pool fills as under load), then the samples of
    requests answered in the second half count. Against in-process scoring it isolates the
    scheduling from HTTP."""
    from rm_jax.score.scorer import ScoreMode
    stream = engine.score_stream(max_wait_s=max_wait_s)
    rng = random.Random(seed)
    cursor, sizes, samples, requests = rng.randrange(len(parsed)), {}, 0, 0

    def submit(token: int) -> None:
        nonlocal cursor
        k = rng.randint(1, 8)
        sizes[token] = k
        batch = [parsed[(cursor + i) % len(parsed)] for i in range(k)]
        cursor = (cursor + k) % len(parsed)
        done = stream.admit(token, ScoreMode.FULL, batch, time.monotonic())
        assert not done, "a request of parsed samples cannot finish at admission"
    start = time.perf_counter()
    timed, end = start + seconds / 2, start + seconds
    for token in range(clients):
        submit(token)
    next_token, compiles0 = clients, None
    while time.perf_counter() < end:
        if compiles0 is None and time.perf_counter() >= timed:
            compiles0 = compiles[0]
        dispatched = stream.inflight < stream.depth and stream.dispatch(time.monotonic())
        if stream.inflight and (not dispatched or stream.inflight >= stream.depth):
            for token, _rows, error in stream.collect():
                assert error is None, error
                k = sizes.pop(token)
                if time.perf_counter() >= timed:
                    samples, requests = samples + k, requests + 1
                submit(next_token)
                next_token += 1
        elif not dispatched:
            time.sleep(max(0.0, stream.due() - time.monotonic()))
    while stream.inflight:              # the device's queue, so the next figure starts idle
        stream.collect()
    return dict(samples=samples, requests=requests, wall=time.perf_counter() - max(timed, start),
                compiles=compiles[0] - (compiles[0] if compiles0 is None else compiles0))


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import logging as py_logging

    py_logging.getLogger("httpx").setLevel(py_logging.WARNING)     # one INFO line per request otherwise

    from benchmarks.loopback_server import ServerThread, tiny_engine
    from rm_jax.data.schema import Sample, read_samples
    from rm_jax.serve.app import ServeSettings, create_app

    import jax
    f = flags.FLAGS
    if f.compile_cache:
        jax.config.update("jax_compilation_cache_dir", f.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compiles = [0]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_kw: compiles.__setitem__(0, compiles[0] + (event == "/jax/core/compile/backend_compile_duration")))
    tmp = tempfile.mkdtemp()
    data = os.path.join(tmp, "data")
    engine = tiny_engine(tmp, data, max(3 * f.n, 24), max_batch=f.max_batch, max_new_tokens=f.max_new_tokens)
    with open(os.path.join(data, "samples.jsonl")) as fh:
        pool = [json.loads(line) for line in fh]
    parsed = [s for s in read_samples(os.path.join(data, "samples.jsonl")) if isinstance(s, Sample)]
    assert [s.id for s in parsed] == [p["id"] for p in pool]
    if f.text_only:
        keep = [i for i, s in enumerate(parsed) if not engine.renderer.render(s, with_target=False).has_image]
        pool, parsed = [pool[i] for i in keep], [parsed[i] for i in keep]
    pool, parsed = pool[:f.n], parsed[:f.n]

    # In-process: the same scorer over the whole pool, warmed up (every bucket compiled) first;
    # timed before and after the load phase (a shared CPU's load drifts), the mean is the baseline.
    warm_rows = engine.scorer.score(parsed)
    # Samples the judge cannot take (over the largest bucket) are dropped from both sides: an
    # error row is not a server error, and it costs nothing to "score".
    keep = [i for i, r in enumerate(warm_rows) if r.error is None]
    pool, parsed = [pool[i] for i in keep], [parsed[i] for i in keep]

    def in_process() -> float:
        t0 = time.perf_counter()
        engine.scorer.score(parsed)
        return len(parsed) / (time.perf_counter() - t0)
    before = in_process()

    settings = ServeSettings(max_batch=f.max_batch, max_wait_ms=f.max_wait_ms, max_queue=4096, image_root=data,
                             warmup=f.warmup)
    asgi, fastapi_app = create_app(engine, settings)
    server = ServerThread.start(asgi)
    server.wait_listening()
    url = server.url
    if f.client_process:
        import concurrent.futures
        import multiprocessing
        # One child for every window: spawned (no fork of a process that runs XLA threads), the
        # pool pickled to it once.
        clients_proc = concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"), initializer=_set_pool, initargs=(pool,))
        run_load = lambda seconds, seed: clients_proc.submit(_load_in_child, url, f.clients, seconds, seed).result()
    else:
        run_load = lambda seconds, seed: asyncio.run(_load(url, pool, f.clients, seconds, seed))
    t_warm, warm_rounds, warm_errors, quiet = time.perf_counter(), 0, 0, 0
    while True:
        before_compiles = compiles[0]
        warm = run_load(f.warmup_seconds, f.seed + 1 + warm_rounds)
        warm_rounds, warm_errors = warm_rounds + 1, warm_errors + warm["errors"]
        new = compiles[0] - before_compiles
        quiet = quiet + 1 if new == 0 else 0
        print(f"warm-up     window {warm_rounds}: {warm['requests']} requests, {new} compiles")
        if quiet >= f.warmup_quiet_windows or time.perf_counter() - t_warm > f.warmup_max_seconds:
            break
    compiles_before_timed = compiles[0]
    reg = fastapi_app.state.metrics.registry
    count0 = reg.get_sample_value("rm_jax_batch_size_count", {"kind": "score_full"}) or 0.0
    sum0 = reg.get_sample_value("rm_jax_batch_size_sum", {"kind": "score_full"}) or 0.0
    got = run_load(f.seconds, f.seed)
    timed_compiles = compiles[0] - compiles_before_timed
    count1 = reg.get_sample_value("rm_jax_batch_size_count", {"kind": "score_full"}) or 0.0
    sum1 = reg.get_sample_value("rm_jax_batch_size_sum", {"kind": "score_full"}) or 0.0
    if f.client_process:
        clients_proc.shutdown()
    server.stop()
    after = in_process()
    inproc = (before + after) / 2
    # Back to back with the pool figure: the server's scheduling in-process (no HTTP).
    streamed = _stream_in_process(engine, parsed, f.clients, f.stream_seconds, f.seed, f.max_wait_ms / 1000.0,
                                  compiles)
    stream_compiles = streamed["compiles"]
    last = in_process()
    stream_rate = streamed["samples"] / streamed["wall"]
    print(f"in-process  {len(parsed)} samples, batch {f.max_batch}: {inproc:8.1f} samples/s "
          f"(before the load {before:.1f}, after {after:.1f}, after the stream {last:.1f})")
    print(f"stream      {f.clients} requests kept outstanding, no HTTP, {streamed['requests']} answered in "
          f"the timed {streamed['wall']:.1f}s: {stream_rate:8.1f} samples/s ({stream_rate / ((after + last) / 2):.2f}x the "
          f"in-process figures around it; {stream_compiles} compiles)")

    served = got["samples"] / got["wall"]
    p50, p99 = _percentile(got["latencies"], 0.5), _percentile(got["latencies"], 0.99)
    mean_batch = (sum1 - sum0) / max(count1 - count0, 1.0)
    print(f"server      {f.clients} clients, {got['requests']} requests in {got['wall']:.1f}s: "
          f"{served:8.1f} samples/s ({served / inproc:.2f}x in-process)")
    print(f"latency     p50 {p50 * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms ({p99 / p50:.2f}x p50)")
    print(f"batches     mean {mean_batch:.1f} samples per device batch (of at most {f.max_batch})")
    print(f"errors      {got['errors']} (warm-up: {warm_errors}); compiles during the timed phase: {timed_compiles}")
    print(json.dumps({"bench": "serve_load", "clients": f.clients, "seconds": round(got["wall"], 2),
                      "requests": got["requests"], "server_samples_per_s": round(served, 2),
                      "inprocess_samples_per_s": round(inproc, 2), "ratio_vs_inprocess": round(served / inproc, 3),
                      "p50_ms": round(p50 * 1e3, 1), "p99_ms": round(p99 * 1e3, 1),
                      "p99_over_p50": round(p99 / p50, 2), "errors": got["errors"],
                      "mean_samples_per_device_batch": round(mean_batch, 2), "max_batch": f.max_batch,
                      "stream_samples_per_s": round(stream_rate, 2),
                      "stream_ratio": round(stream_rate / ((after + last) / 2), 3), "stream_compiles": stream_compiles,
                      "timed_compiles": timed_compiles, "warmup_windows": warm_rounds, "pool": len(pool),
                      "client_process": f.client_process}))


if __name__ == "__main__":
    app.run(main)
