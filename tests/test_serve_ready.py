"""launch.serve's start with its shape ladder (the default): live but 'starting' (503) while it
compiles, then ready, with the ladder's compiles in /metrics (slow: it compiles every shape)."""

import re
import time

import httpx
import pytest

from serve_fixtures import JudgeServer, make_judge_workdir


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


@pytest.mark.slow
def test_the_server_is_ready_only_after_its_ladder(tmp_path, tiny_cfg, built_shards, renderer):
    workdir = make_judge_workdir(tmp_path, tiny_cfg, built_shards[0], renderer)
    server = JudgeServer(workdir, "--max_batch=2", warmup=True, startup_timeout_s=1200.0)
    seen = []
    try:
        server.start_process()
        deadline = time.time() + 1200.0
        while time.time() < deadline:
            assert server.proc.poll() is None, server.log()[-4000:]
            try:
                r = httpx.get(server.url + "/healthz", timeout=2.0)
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            seen.append((r.status_code, r.json()["status"]))
            if r.status_code == 200:
                break
            time.sleep(0.5)
        assert (503, "starting") in seen and seen[-1] == (200, "ok"), seen[-5:]
        metrics = httpx.get(server.url + "/metrics", timeout=10.0).text
        assert _metric(metrics, "rm_jax_ready") == 1.0
        assert _metric(metrics, "rm_jax_xla_compiles") > 0
        assert "shape ladder ready" in server.log()
    finally:
        server.stop()
