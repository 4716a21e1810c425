"""Ready before traffic: a served judge's time to ready, then the compiles a load run still causes.

    python -m benchmarks.serve_ready --workdir=W --input=DATA/samples.jsonl [--seconds=300 --clients=16
        --max_batch=8 --compile_cache_dir=DIR]

Starts ``python -m launch.serve`` on a free loopback port (it compiles its whole shape ladder
before ``/healthz`` turns from 503 ``starting`` to 200), times that, reads the server's compile
count from ``/metrics`` (``rm_jax_xla_compiles``), then fires ``--clients`` loopback clients for
``--seconds``: each posts ``/v1/score`` requests of 1-8 consecutive samples (GRPO groups share a
prompt, images included), ``p_pass`` and ``full`` in turn. The goal is 0 compiles after ready: a
compile under traffic stalls every request behind it (minutes for a 30B judge). A measurement,
not a test. Last line: one JSON object.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import subprocess
import sys
import threading
import time

import httpx
from absl import app, flags

from benchmarks.loopback_server import free_port

_WORKDIR = flags.DEFINE_string("workdir", None, "trained judge (launch.train --workdir)", required=True)
_INPUT = flags.DEFINE_string("input", None, "samples JSONL the requests take (images relative to it)", required=True)
_SECONDS = flags.DEFINE_float("seconds", 300.0, "load phase after ready")
_CLIENTS = flags.DEFINE_integer("clients", 16, "concurrent loopback clients")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 8, "the server's --max_batch")
_POOL = flags.DEFINE_integer("pool", 2000, "samples read from --input")
_CACHE = flags.DEFINE_string("compile_cache_dir", None, "the server's --compile_cache_dir")
_STARTUP = flags.DEFINE_float("startup_timeout_s", 3600.0, "give up waiting for ready after this long")
_SEED = flags.DEFINE_integer("seed", 0, "request mix")
_URL = flags.DEFINE_string("url", None, "attach to a server already started (its time to ready is then not "
                           "measured here: read it from its log)")

_COMPILES = re.compile(r"^rm_jax_xla_compiles (\S+)$", re.M)


def _compiles(client: httpx.Client, url: str) -> int:
    return int(float(_COMPILES.search(client.get(url + "/metrics").text).group(1)))


def _load(url: str, pool: list[dict], seconds: float, clients: int, seed: int) -> dict:
    counts = {"requests": 0, "samples": 0, "errors": 0, "http_errors": 0}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def worker(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        with httpx.Client(timeout=600) as client:
            while time.monotonic() < deadline:
                start = rng.randrange(len(pool))
                batch = pool[start:start + rng.randint(1, 8)]
                mode = "p_pass" if rng.random() < 0.5 else "full"
                resp = client.post(url + "/v1/score", json={"samples": batch, "mode": mode})
                with lock:
                    counts["requests"] += 1
                    if resp.status_code != 200:
                        counts["http_errors"] += 1
                        continue
                    rows = resp.json()["results"]
                    counts["samples"] += len(rows)
                    counts["errors"] += sum(1 for r in rows if r.get("error"))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts


def main(argv):
    del argv
    logging.getLogger("httpx").setLevel(logging.WARNING)     # one line per health poll otherwise
    with open(_INPUT.value) as f:
        pool = [json.loads(line) for _, line in zip(range(_POOL.value), f)]
    port = free_port()
    url = _URL.value.rstrip("/") if _URL.value else f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "launch.serve", f"--workdir={_WORKDIR.value}", f"--port={port}",
           f"--max_batch={_MAX_BATCH.value}", f"--image_root={os.path.dirname(os.path.abspath(_INPUT.value))}",
           f"--max_queue={max(1024, 8 * _CLIENTS.value)}"]
    if _CACHE.value:
        cmd.append(f"--compile_cache_dir={_CACHE.value}")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    t0 = time.monotonic()
    server = None if _URL.value else subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                                      stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(timeout=30) as client:
            starting_seen = False
            while True:
                if server is not None and server.poll() is not None:
                    raise SystemExit(f"launch.serve exited with {server.returncode} before ready")
                if time.monotonic() - t0 > _STARTUP.value:
                    raise SystemExit(f"not ready after {_STARTUP.value:.0f} s")
                try:
                    health = client.get(url + "/healthz")
                except httpx.TransportError:
                    time.sleep(0.5)
                    continue
                if health.status_code == 200:
                    break
                starting_seen |= health.status_code == 503 and health.json().get("status") == "starting"
                time.sleep(0.5)
            ready_s = time.monotonic() - t0
            at_ready = _compiles(client, url)
            print(f"ready after {ready_s:.1f} s ({at_ready} compiles; 503 'starting' seen before: {starting_seen})")
            t1 = time.monotonic()
            counts = _load(url, pool, _SECONDS.value, _CLIENTS.value, _SEED.value)
            load_s = time.monotonic() - t1
            after = _compiles(client, url) - at_ready
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    print(f"load: {load_s:.0f} s, {_CLIENTS.value} clients, {counts['requests']} requests, "
          f"{counts['samples']} samples ({counts['samples'] / load_s:.1f}/s), {counts['errors']} error rows, "
          f"{counts['http_errors']} non-200")
    print(f"compiles after ready: {after}")
    print(json.dumps({"bench": "serve_ready", "time_to_ready_s": round(ready_s, 1), "ladder_compiles": at_ready,
                      "starting_seen": starting_seen, "load_seconds": round(load_s, 1), **counts,
                      "samples_per_s": round(counts["samples"] / load_s, 2), "compiles_after_ready": after}))


if __name__ == "__main__":
    app.run(main)
