"""Prometheus metrics of the server, in their own registry (one server per process, but tests and
benchmarks build several apps in one interpreter: a private registry keeps them apart)."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclasses.dataclass
class ServerMetrics:
    registry: CollectorRegistry
    requests: Counter          # by endpoint and HTTP status
    latency: Histogram         # seconds, by endpoint
    batch_size: Histogram      # samples per worker batch (one scorer call), by kind (score_full, score_p_pass, chat)
    queue_depth: Gauge         # samples admitted and not yet answered
    samples: Counter           # samples scored, by kind and outcome (ok, error)
    ready: Gauge               # 1 once the shape ladder is compiled
    compiles: Gauge            # XLA backend compiles in this process (warmup.CompileCounter)

    @classmethod
    def create(cls) -> "ServerMetrics":
        r = CollectorRegistry()
        return cls(
            registry=r,
            requests=Counter("rm_jax_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                             registry=r),
            latency=Histogram("rm_jax_request_latency_seconds", "HTTP request latency", ["endpoint"],
                              buckets=LATENCY_BUCKETS, registry=r),
            batch_size=Histogram("rm_jax_batch_size", "samples per worker batch (one scorer call)", ["kind"], buckets=BATCH_BUCKETS,
                                 registry=r),
            queue_depth=Gauge("rm_jax_queue_depth", "samples admitted and not yet answered", registry=r),
            samples=Counter("rm_jax_samples", "samples processed by kind and outcome", ["kind", "outcome"],
                            registry=r),
            ready=Gauge("rm_jax_ready", "1 once the shape ladder is compiled", registry=r),
            compiles=Gauge("rm_jax_xla_compiles", "XLA backend compiles in this process so far", registry=r),
        )
