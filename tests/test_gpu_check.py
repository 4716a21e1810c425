"""benchmarks/gpu_check.py on a host without a GPU: it says it needs one and exits 0 (its checks
run on GPU hosts; their code paths were smoke-run on CPU with reduced shapes when written)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_on_cpu_says_it_needs_a_gpu_and_exits_0():
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "gpu_check needs a GPU" in proc.stdout
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["bench"] == "gpu_check" and last["skipped"] is True
