"""Child processes of the repository's CLIs on loopback, for the tests that start them.

    from loopback import cpu_env, free_port, start_pair, wait_all, without

* ``free_port()``: a free TCP port on 127.0.0.1.
* ``cpu_env(n_devices, cache_dir)``: the environment of one CPU process with ``n_devices``
  devices, a persistent compile cache shared by the processes of one test, and the repository
  on ``PYTHONPATH`` (for ``python -m launch.*``).
* ``start_pair(cmd, name, env, logs)``: two processes of ``cmd(cluster_flags)`` joined into one
  ``jax.distributed`` cluster by a coordinator on a free loopback port; process ``i`` appends its
  output to ``logs/NAME.i.log``. ``wait_all`` waits for them and fails with the logs' tails when
  one exits non-zero.
* ``without(rows, keys)``: metrics rows less the keys that differ between equal runs (timings).
"""

from __future__ import annotations

import os
import socket
import subprocess
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(n_devices: int, cache_dir) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_devices}"   # devices per process
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def log_path(logs, name: str, process_id: int) -> str:
    return os.path.join(str(logs), f"{name}.{process_id}.log")


def start_pair(cmd: Callable[[tuple[str, ...]], list[str]], name: str, env: dict, logs) -> list[subprocess.Popen]:
    """Two processes of ``cmd(cluster_flags)``, one cluster; see the module docstring."""
    port = free_port()
    procs = []
    for pid in range(2):
        cluster = (f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={pid}")
        with open(log_path(logs, name, pid), "a") as log:
            procs.append(subprocess.Popen(cmd(cluster), cwd=REPO, env=env, stdout=log, stderr=log))
    return procs


def wait_all(procs: list[subprocess.Popen], logs, name: str, timeout_s: float = 600) -> None:
    for p in procs:
        rc = p.wait(timeout=timeout_s)
        if rc:
            tails = "\n".join(open(log_path(logs, name, i)).read()[-3000:] for i in range(len(procs)))
            raise AssertionError(f"{name}: a process exited with {rc}\n{tails}")


def without(rows: list[dict], keys) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in keys} for r in rows]
