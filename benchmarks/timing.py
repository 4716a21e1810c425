"""Shared by the benchmarks: a median wall time that shrugs off a busy shared CPU."""

from __future__ import annotations

import time


def median_seconds(fn, iters: int, warmup: int = 2) -> float:
    """Median seconds per call after `warmup` calls (compile, allocator, kernel selection)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(sorted(times)[len(times) // 2])
