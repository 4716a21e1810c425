"""Build throughput on 1 and N worker processes, and loader throughput (the synthetic set, this CPU).

  python -m benchmarks.data_throughput [--n=4000] [--workers=1,2] [--project_rows=480000 --project_cores=16]

Build: each worker count builds the same input into its own folder (wall time from the call to
the merged reports, worker start included); the outputs are compared byte for byte. The
projection to a bigger host takes the 1-worker rate per core times the measured parallel
efficiency of the largest worker count, capped by the main process's serial share (one read of
the input for the chunks' offsets: workers read, render and write whole chunks). The builds use
the config's chunk size (data.shard_max_examples lines), so --n should give each worker a chunk.
Loader: decodes msgpack records and pads (goal >= 1,000 samples/s on one core: all tokenization
happened at build time). The machine may be shared: the load average is printed with the rows.
Last line: JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch.common import DEFAULT_CONFIG, load_config  # noqa: E402
from rm_jax.data import build, build_chunks, loader, synth  # noqa: E402
from rm_jax.data.render import Renderer  # noqa: E402


def tree_sha(root: str) -> str:
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def main_process_rate(input_path: str, opts: build.BuildOptions) -> float:
    """Rows/s of the main process's serial share: one read of the input for each chunk's offset
    (workers read, render and write their chunks themselves)."""
    t0 = time.perf_counter()
    _, n_lines = build_chunks.chunk_offsets(input_path, opts.chunk_lines)
    return n_lines / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--workers", default="1,2", help="worker counts to build with, comma-separated")
    ap.add_argument("--project_rows", type=int, default=480_000, help="the field report's conversations")
    ap.add_argument("--project_cores", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=100)
    args = ap.parse_args()
    worker_counts = [int(w) for w in args.workers.split(",")]
    cfg = load_config(DEFAULT_CONFIG)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        t0 = time.perf_counter()
        synth.write_dataset(data, n=args.n, seed=0)
        synth_s = time.perf_counter() - t0
        input_path = os.path.join(data, "samples.jsonl")
        opts = build.BuildOptions.from_config(cfg.data)
        renderer = Renderer.from_config(cfg.data, os.path.join(data, "tokenizer"), storage_dtype=opts.pixel_dtype)
        builds = {}
        for n_workers in worker_counts:
            out = os.path.join(tmp, f"shards_w{n_workers}")
            t0 = time.perf_counter()
            res = build.build(input_path, out, renderer, opts, progress=False, num_workers=n_workers)
            seconds = time.perf_counter() - t0
            builds[n_workers] = {"seconds": seconds, "rows": res.stats["read"], "rate": res.stats["read"] / seconds,
                                 "sha256": tree_sha(out)}
        main_rate = main_process_rate(input_path, opts)

        shards = os.path.join(tmp, f"shards_w{worker_counts[0]}")
        ds = loader.make_dataset(shards, "train", loader.LoaderConfig(batch_size=args.batch,
                                                                      buckets=tuple(cfg.data.buckets)))
        it = loader.make_iterator(ds)
        next(it)   # open shards outside the timing
        t0 = time.perf_counter()
        n = 0
        for _ in range(args.batches):
            n += int(next(it)["example_valid"].sum())
        load_s = time.perf_counter() - t0
        load_rate = n / load_s
    load_after = os.getloadavg()

    base = builds[worker_counts[0]]
    identical = len({b["sha256"] for b in builds.values()}) == 1
    top = max(worker_counts)
    speedup = builds[top]["rate"] / base["rate"]
    efficiency = speedup / (top / worker_counts[0])
    per_core = base["rate"] / worker_counts[0]
    projected_rate = min(per_core * args.project_cores * efficiency, main_rate)
    projected_min = args.project_rows / projected_rate / 60
    print(f"{'stage':<16} {'rows':>7} {'seconds':>8} {'rows/s':>8} {'vs 1':>6}")
    print(f"{'synth':<16} {args.n:>7} {synth_s:>8.2f} {args.n / synth_s:>8.1f}")
    for w, b in builds.items():
        print(f"{'build ' + str(w) + ' worker(s)':<16} {b['rows']:>7} {b['seconds']:>8.2f} {b['rate']:>8.1f} "
              f"{b['rate'] / base['rate']:>5.2f}x")
    print(f"{'build main only':<16} {base['rows']:>7} {'':>8} {main_rate:>8.1f}   (the serial share: chunk offsets)")
    print(f"{'loader':<16} {n:>7} {load_s:>8.2f} {load_rate:>8.1f}   (goal >= 1000/s on one core)")
    print(f"outputs byte-identical across worker counts: {identical}")
    print(f"{top} workers: {speedup:.2f}x (goal >= 1.8x on 2 cores), parallel efficiency {efficiency:.2f}")
    print(f"projection: {args.project_rows} rows on {args.project_cores} cores at min({per_core:.0f}/s/core x "
          f"{args.project_cores} x {efficiency:.2f}, main process {main_rate:.0f}/s) = {projected_rate:.0f} rows/s "
          f"-> {projected_min:.1f} min (goal < 10; synthetic rows, shorter than the report's conversations)")
    print(f"load average before {load_before[0]:.2f} after {load_after[0]:.2f} (1 min; {os.cpu_count()} cores)")
    print(json.dumps({"bench": "data_throughput",
                      "build_samples_per_s": {str(w): round(b["rate"], 1) for w, b in builds.items()},
                      "build_speedup": round(speedup, 2), "build_parallel_efficiency": round(efficiency, 2),
                      "build_workers": worker_counts, "build_outputs_identical": identical,
                      "main_process_rows_per_s": round(main_rate, 1),
                      "projected_minutes": round(projected_min, 1), "projected_rows": args.project_rows,
                      "projected_cores": args.project_cores,
                      "loader_samples_per_s": round(load_rate, 1), "synth_samples_per_s": round(args.n / synth_s, 1),
                      "batch_size": args.batch, "n": args.n, "cpu_count": os.cpu_count(),
                      "load_average_before": round(load_before[0], 2), "load_average_after": round(load_after[0], 2)}))


if __name__ == "__main__":
    main()
