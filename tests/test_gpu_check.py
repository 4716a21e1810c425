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


def test_gpu_check_smoke_runs_the_cpu_runnable_checks():
    """--smoke on CPU: the layer-stack codec is bit-identical to the plain scan, and both real
    configs' text attention resolves to cuDNN flash on Hopper (head_dim 128 and 256)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--smoke"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["smoke"] is True and last["all_pass"] is True, last
    assert last["checks"]["stack_codec"]["bit_identical"] is True
    assert last["checks"]["expert_grad_in_scan"]["bit_identical"] is True
    assert last["checks"]["moment_copies"]["moment_copies"] == 4    # XLA:CPU copies each donated bf16 moment
    choice = last["checks"]["attention_choice"]["qwen3_5_35b_a3b"]
    assert choice["head_dim"] == 256 and choice["sm9.0"]["impl"] == "cudnn" and choice["sm8.0"]["impl"] == "xla"
