"""A burst of rollouts through verl's reward-loop client vs a small server queue, and cold start.

    python -m benchmarks.serve_burst [--rollouts=1024 --max_queue=256 --max_batch=32 --compile_cache=DIR]

verl's reward loop calls ``compute_score`` once per rollout, all at once. Here ``--rollouts``
coroutines of ``rm_jax.rl.verl_reward.compute_score`` (the async form verl awaits) start together
in a child process (rollout workers are other processes) against the tiny judge served by the
real app under uvicorn on 127.0.0.1, with ``--max_queue`` far below the burst. The client
coalesces, bounds its requests in flight and retries refusals after the server's Retry-After;
the goal is 0 failed samples and 0 gate rewards caused by overload.

Cold start: the server compiles its whole shape ladder before ``/healthz`` reports ready; the
time to ready and the compiles seen during the burst afterwards (goal 0) are reported.

Peer: the same ``Scorer`` scoring the same rollouts in-process (``launch.score``'s path), warmed
up. Last line: one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time

from absl import app, flags

flags.DEFINE_integer("rollouts", 1024, "rollouts fired at once")
flags.DEFINE_integer("max_queue", 256, "the server's admission limit (samples)")
flags.DEFINE_integer("max_batch", 32, "server batch = in-process batch")
flags.DEFINE_float("max_wait_ms", 10.0, "server batching window")
flags.DEFINE_integer("max_new_tokens", 32, "decoding budget after the verdict")
flags.DEFINE_string("compile_cache", "", "JAX persistent compilation cache dir")
flags.DEFINE_bool("text_only", False, "rollouts without images")
flags.DEFINE_bool("warmup", True, "compile the shape ladder before ready (--nowarmup: shapes compile during the burst)")


def _burst_in_child(url: str, texts: list[str], labels: list[str]) -> dict:
    """Every rollout's compute_score at once, as verl's reward loop awaits them."""
    from rm_jax.rl import verl_reward

    async def go():
        t0 = time.perf_counter()
        got = await asyncio.gather(*(verl_reward.compute_score("tool_agent", t, g, {}, url=url)
                                     for t, g in zip(texts, labels)))
        return got, time.perf_counter() - t0
    got, wall = asyncio.run(go())
    stats = verl_reward.client_stats()
    return {"scores": [g["score"] for g in got], "gated": [g["gated"] for g in got], "wall": wall,
            "requests": stats.requests, "retries": stats.retries, "failed": stats.failed_samples,
            "last_error": stats.last_error}


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import concurrent.futures
    import logging as py_logging
    import multiprocessing

    import httpx
    import jax
    py_logging.getLogger("httpx").setLevel(py_logging.WARNING)

    from benchmarks.loopback_server import ServerThread, tiny_engine
    from rm_jax.data.schema import Sample, read_samples
    from rm_jax.rl.trl_reward import completion_text
    from rm_jax.score.scorer import ScoreMode
    from rm_jax.serve.app import ServeSettings, create_app
    from rm_jax.serve.warmup import CompileCounter

    f = flags.FLAGS
    if f.compile_cache:
        jax.config.update("jax_compilation_cache_dir", f.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    counter = CompileCounter.install()
    tmp = tempfile.mkdtemp()
    data = os.path.join(tmp, "data")
    engine = tiny_engine(tmp, data, 2 * f.rollouts, max_batch=f.max_batch, max_new_tokens=f.max_new_tokens)
    with open(os.path.join(data, "samples.jsonl")) as fh:
        raw = [json.loads(line) for line in fh]
    parsed = [s for s in read_samples(os.path.join(data, "samples.jsonl")) if isinstance(s, Sample)]
    keep = [i for i, s in enumerate(parsed)
            if not (f.text_only and s.images) and len(engine.scorer.render([s])[0]) == 1]
    keep = keep[:f.rollouts]
    raw, parsed = [raw[i] for i in keep], [parsed[i] for i in keep]
    labels = [json.dumps({k: v for k, v in r.items() if k != "response"}) for r in raw]
    texts = [completion_text([{"role": "assistant", **r["response"]}]) for r in raw]

    settings = ServeSettings(max_batch=f.max_batch, max_wait_ms=f.max_wait_ms, max_queue=f.max_queue, image_root=data,
                             warmup=f.warmup)
    asgi, fastapi_app = create_app(engine, settings)
    t_start, compiles_start = time.perf_counter(), counter.compiles
    server = ServerThread.start(asgi)
    url = server.url
    saw_starting = False
    while True:
        try:
            r = httpx.get(url + "/healthz", timeout=5.0)
            saw_starting |= r.status_code == 503 and r.json() == {"status": "starting"}
            if r.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    ready_s, ladder_compiles = time.perf_counter() - t_start, counter.compiles - compiles_start
    print(f"cold start  ready after {ready_s:.1f}s, {ladder_compiles} compiles (the shape ladder); "
          f"/healthz said starting meanwhile: {saw_starting}")

    before_burst = counter.compiles
    child = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    got = child.submit(_burst_in_child, url, texts, labels).result()
    child.shutdown()
    burst_compiles = counter.compiles - before_burst
    reg = fastapi_app.state.metrics.registry
    refused = reg.get_sample_value("rm_jax_requests_total", {"endpoint": "/get_reward", "status": "503"}) or 0.0
    server.stop()

    engine.scorer.score(parsed)              # the in-process peer, warmed up
    t0 = time.perf_counter()
    results = engine.scorer.score(parsed)
    inproc_s = time.perf_counter() - t0
    n = len(texts)
    # Each burst reward against the in-process one: a gate from overload would differ.
    expected = [row["reward"] for row in engine.rows(ScoreMode.FULL, parsed, results)]
    differ = sum(1 for a, b in zip(got["scores"], expected) if abs(a - b) > 1e-3)
    overload_gates = got["failed"]
    print(f"burst       {n} rollouts at once vs --max_queue={f.max_queue}: {got['wall']:.1f}s total, "
          f"{got['requests']} requests, {int(refused)} refused (503) and retried ({got['retries']} retries)")
    print(f"outcome     {got['failed']} failed samples, {overload_gates} gate rewards from overload, {differ} rewards "
          f"differ from in-process scoring; {burst_compiles} compiles during the burst")
    print(f"in-process  the same {n} rollouts scored by the Scorer: {inproc_s:.1f}s "
          f"(burst / in-process = {got['wall'] / inproc_s:.2f}x)")
    print(json.dumps({"bench": "serve_burst", "rollouts": n, "max_queue": f.max_queue, "max_batch": f.max_batch,
                      "burst_s": round(got["wall"], 2), "inprocess_s": round(inproc_s, 2),
                      "burst_over_inprocess": round(got["wall"] / inproc_s, 3), "failed_samples": got["failed"],
                      "overload_gates": overload_gates, "rewards_differing_from_inprocess": differ, "refused_503": int(refused),
                      "client_retries": got["retries"], "requests": got["requests"],
                      "time_to_ready_s": round(ready_s, 1), "ladder_compiles": ladder_compiles,
                      "burst_compiles": burst_compiles, "saw_starting": saw_starting, "warmup": f.warmup}))


if __name__ == "__main__":
    app.run(main)
