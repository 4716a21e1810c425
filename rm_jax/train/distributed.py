"""Multi-host start, from explicit flags only.

`jax.distributed.initialize()` without arguments auto-detects clusters from the environment
(SLURM, Open MPI, TPU metadata...). A leftover variable from another job would then silently
join a cluster. We never call it without an explicit coordinator address, process count and
process id, and the log says which case applies.
"""

from __future__ import annotations

import dataclasses

import jax
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
        jax.distributed.initialize(coordinator_address=flags.coordinator_address,
                                   num_processes=flags.num_processes, process_id=flags.process_id)
        line = (f"joined cluster at {flags.coordinator_address} as process {flags.process_id} of "
                f"{flags.num_processes} ({jax.device_count()} devices in all)")
    logging.info("%s", line)
    return line
