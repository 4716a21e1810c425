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
