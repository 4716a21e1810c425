"""Multi-host training over loopback: two processes with 4 CPU devices each, joined by a real
`jax.distributed` coordinator, train exactly like one process with 8 devices; kill -9 of both
and a resume continue the two-process run identically.

Why a tolerance at all: the two runs compile the same program for the same 8-device mesh on the
same global batches (tests/test_loader.py checks the slices), but the cross-process all-reduces
run over gloo, whose summation order differs from the in-process CPU collectives. Measured: the
losses and gradient norms differ by at most 1 fp32 ulp after 6 steps (e.g. 8.7938108 vs
8.7938099); rtol 1e-6 (~8 ulp) holds that with a little room and would catch any row or image
placed on the wrong process (those move the loss at 1e-2).
"""

import json
import signal
import subprocess
import sys
import time

import pytest

from loopback import REPO, cpu_env, log_path, start_pair, wait_all, without
from rm_jax.train.metrics_log import read_metrics
from run_flags import OVERRIDES, TIMING, override_flags


def _cmd(workdir, shards, cluster=()):
    return [sys.executable, "-m", "launch.train", f"--config={REPO}/configs/tiny.py", f"--workdir={workdir}",
            f"--config.data.dir={shards}", *override_flags(OVERRIDES), *cluster]


def _start_pair(workdir, shards, env, logs):
    return start_pair(lambda cluster: _cmd(workdir, shards, cluster), workdir.name, env, logs)


def _assert_close(got, want, rtol):
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), (g.keys() ^ w.keys())
        for k in w:
            if isinstance(w[k], float) and w[k] != 0:
                assert abs(g[k] - w[k]) <= rtol * abs(w[k]), (g["step"], k, g[k], w[k])
            else:
                assert g[k] == w[k], (g["step"], k, g[k], w[k])


@pytest.mark.slow   # ~4 min on 2 cores: four trainings, each two-process one compiling twice at once
def test_two_processes_equal_one_and_resume_after_kill9(built_shards, tmp_path):
    shards = built_shards[0]
    logs = tmp_path
    one, two, crash = tmp_path / "one", tmp_path / "two", tmp_path / "crash"
    cache = tmp_path / "jax_cache"

    out = subprocess.run(_cmd(one, shards), cwd=REPO, env=cpu_env(8, cache), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "single process" in out.stderr
    reference = without(read_metrics(str(one)), TIMING)
    assert [r["step"] for r in reference] == list(range(1, 7))
    assert [r["step"] for r in reference if "val_loss" in r] == [3, 6]

    env2 = cpu_env(4, cache)
    wait_all(_start_pair(two, shards, env2, logs), logs, "two")
    for pid in range(2):
        text = open(log_path(logs, "two", pid)).read()
        assert "joined cluster at 127.0.0.1:" in text and f"as process {pid} of 2 (8 devices in all)" in text
    uninterrupted = without(read_metrics(str(two)), TIMING)
    _assert_close(uninterrupted, reference, rtol=1e-6)
    manifest = json.load(open(two / "manifest.json"))
    assert manifest["devices"]["process_count"] == 2 and manifest["devices"]["count"] == 8

    # kill -9 of both processes once the step-2 checkpoint is committed, then resume
    procs = _start_pair(crash, shards, env2, logs)
    deadline = time.time() + 600
    while not (crash / "checkpoints" / "2").is_dir():
        if any(p.poll() is not None for p in procs):
            tails = "\n".join(open(log_path(logs, "crash", i)).read()[-3000:] for i in range(2))
            raise AssertionError(f"a process ended before it could be killed:\n{tails}")
        assert time.time() < deadline
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()
    killed_at = max((r["step"] for r in read_metrics(str(crash))), default=0)
    assert killed_at < 6, "the kill came too late to test a resume"
    wait_all(_start_pair(crash, shards, env2, logs), logs, "crash")
    assert "resumed from" in open(log_path(logs, "crash", 0)).read()
    # the resumed two-process run is the uninterrupted one, value for value
    assert without(read_metrics(str(crash)), TIMING) == uninterrupted
