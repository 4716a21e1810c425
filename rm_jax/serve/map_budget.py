"""The process's memory-mapping budget, which bounds how many executables XLA:CPU can hold.

XLA's CPU backend links each compiled kernel into memory of its own: about three mappings per
kernel (code, read-only data, data), so a few hundred per executable of a small judge. Linux caps a
process's mappings at ``vm.max_map_count`` (65,530 by default), and past it LLVM fails inside a
compile (SIGSEGV, or "Cannot allocate memory" with gigabytes free). A server's shape ladder of a
hundred-odd shapes reaches that cap on CPU, so the ladder projects its need after each shape and
stops with a ``MapBudgetExceeded`` that names the fixes, before the compile that would crash.

The check runs wherever ``/proc`` has the counts (Linux); elsewhere there is nothing to read and no
check.
"""

from __future__ import annotations

import dataclasses
import os

MAX_MAP_COUNT_FILE = "/proc/sys/vm/max_map_count"
SELF_MAPS_FILE = "/proc/self/maps"
# Stop while this share of the cap is still free: the rest of the process (threads, buffers,
# request handling) maps memory too.
RESERVE_SHARE = 0.05


class MapBudgetExceeded(RuntimeError):
    """Compiling the rest of the ladder would pass vm.max_map_count."""


def mappings_in_use() -> int:
    with open(SELF_MAPS_FILE, encoding="ascii", errors="replace") as maps:
        return sum(1 for _ in maps)


@dataclasses.dataclass
class MapBudget:
    """Tracks the mappings that compiles add, against the cap (``limit``)."""

    limit: int
    at_start: int
    largest_step: int = 0

    @classmethod
    def of_process(cls) -> "MapBudget | None":
        if not (os.path.exists(MAX_MAP_COUNT_FILE) and os.path.exists(SELF_MAPS_FILE)):
            return None
        with open(MAX_MAP_COUNT_FILE, encoding="ascii") as f:
            limit = int(f.read().strip())
        return cls(limit=limit, at_start=mappings_in_use())

    def check(self, done: int, total: int, before_step: int) -> int:
        """After ``done`` of ``total`` shapes (``before_step``: mappings before the last one):
        raises if the rest projects past the cap, or if the next shape could not fit; returns
        the mappings now in use."""
        now = mappings_in_use()
        self.largest_step = max(self.largest_step, now - before_step)
        room = int(self.limit * (1.0 - RESERVE_SHARE)) - now
        per_shape = (now - self.at_start) / max(done, 1)
        needed = per_shape * (total - done)
        if done < total and (needed > room or 2 * self.largest_step > room):
            raise MapBudgetExceeded(
                f"compiling the remaining {total - done} of {total} ladder shapes needs about "
                f"{int(needed):,} more memory mappings ({per_shape:.0f} per shape so far), and this process "
                f"has {max(room, 0):,} left under vm.max_map_count={self.limit:,} (XLA:CPU maps each compiled "
                f"kernel separately). Raise the cap (sysctl -w vm.max_map_count=262144), serve a smaller "
                f"--max_batch (fewer image rungs), or start with --nowarmup (shapes then compile on first use, "
                f"and the same cap still applies).")
        return now
