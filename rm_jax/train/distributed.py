"""Multi-host start, from explicit flags only.

`jax.distributed.initialize()` without arguments auto-detects clusters from the environment
(SLURM, Open MPI, TPU metadata...). A leftover variable from another job would then silently
join a cluster. We never call it without an explicit coordinator address, process count and
process id, and the log says which case applies.

Once joined, every process runs the same program on its slice of each batch
(`rm_jax.train.step.host_batch_to_device` places it with `jax.make_array_from_process_local_data`);
the few host-side values that must agree across processes (image patches of the microbatch, log
counters, data-iterator states) are exchanged with the helpers below. Files shared by the run
(metrics.jsonl, manifest.json) are written by process 0 only; Orbax coordinates the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
from absl import logging


@dataclasses.dataclass(frozen=True)
class ClusterFlags:
    coordinator_address: str = ""
    num_processes: int = 1
    process_id: int = 0

    @property
    def multi_host(self) -> bool:
        return bool(self.coordinator_address)


def initialize(flags: ClusterFlags) -> str:
    """Join the named cluster, or stay single-process. Returns the log line it wrote."""
    if not flags.multi_host:
        if flags.num_processes != 1 or flags.process_id != 0:
            raise ValueError("num_processes/process_id given without --coordinator_address: refusing to guess "
                             "a cluster; pass all three to run multi-host")
        line = "single process: not joining any cluster (no --coordinator_address given)"
    else:
        if flags.num_processes < 2 or not 0 <= flags.process_id < flags.num_processes:
            raise ValueError(f"bad cluster flags: num_processes={flags.num_processes}, "
                             f"process_id={flags.process_id}")
        if (jax.config.jax_platforms or "").split(",")[0] == "cpu" and \
                jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
            # CPU processes need a cross-process collectives library (gloo ships with jaxlib).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=flags.coordinator_address,
                                   num_processes=flags.num_processes, process_id=flags.process_id)
        line = (f"joined cluster at {flags.coordinator_address} as process {flags.process_id} of "
                f"{flags.num_processes} ({jax.device_count()} devices in all)")
    logging.info("%s", line)
    return line


def is_primary() -> bool:
    """The process that writes the run's shared files (metrics.jsonl, manifest.json)."""
    return jax.process_index() == 0


def allgather_host(x: np.ndarray) -> np.ndarray:
    """[process_count, ...]: every process's `x` (same shape and dtype on each), in process order."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def allgather_json(obj) -> list:
    """Every process's JSON-serializable `obj`, in process order (small values: iterator states)."""
    if jax.process_count() == 1:
        return [obj]
    raw = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), np.uint8)
    n = int(allgather_host(np.array([raw.size], np.int64)).max())
    buf = np.zeros(n, np.uint8)
    buf[:raw.size] = raw
    return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in allgather_host(buf)]


def sync(name: str) -> None:
    """A barrier across processes (a no-op in one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
