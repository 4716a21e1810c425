"""Every entry point starts: its module imports and its flags parse (`--helpshort`).

The heavy paths are tested through their library functions elsewhere; this catches what only the
CLI wiring can break (a missing import, a flag defined twice)."""

import os
import subprocess
import sys

import pytest

from launch.common import REPO_ROOT

ENTRY_POINTS = sorted(f[:-3] for f in os.listdir(os.path.join(REPO_ROOT, "launch"))
                      if f.endswith(".py") and f not in ("__init__.py", "common.py"))


def test_entry_points_listed():
    assert {"synth", "build_data", "train", "sweep", "score", "convert", "demo"} <= set(ENTRY_POINTS)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_starts(name):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", f"launch.{name}", "--helpshort"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    # absl's help exits with status 1 after printing usage; a broken module prints a traceback.
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode in (0, 1) and f"launch.{name}" in proc.stdout and "  --" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("name, args", [("score", ["--workdir=W", "--input=I", "--out=O"]),
                                        ("sweep", ["--workdir=W", "--data=D"])])
def test_single_process_jobs_refuse_cluster_flags(name, args):
    """launch.score and launch.sweep run in one process: given cluster flags they refuse, naming
    the flags, before loading anything (they never join a cluster half-way)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", f"launch.{name}", *args, "--coordinator_address=127.0.0.1:1234",
                           "--num_processes=2", "--process_id=0"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert f"launch.{name} runs in one process and does not join a cluster" in proc.stderr, proc.stderr[-2000:]
    assert "--num_processes=2" in proc.stderr
