"""Build and loader throughput on the synthetic set (one process, this CPU).

  python benchmarks/data_throughput.py [--n=1000]

The loader must stay far above what training consumes (goal: >= 1,000 samples/s on one core):
it only decodes msgpack records and pads; all tokenization happened at build time.
Last line: JSON with build_samples_per_s and loader_samples_per_s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch.common import DEFAULT_CONFIG, load_config  # noqa: E402
from rm_jax.data import build, loader, synth  # noqa: E402
from rm_jax.data.render import Renderer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=100)
    args = ap.parse_args()
    cfg = load_config(DEFAULT_CONFIG)
    with tempfile.TemporaryDirectory() as tmp:
        data, shards = os.path.join(tmp, "data"), os.path.join(tmp, "shards")
        t0 = time.perf_counter()
        synth.write_dataset(data, n=args.n, seed=0)
        synth_s = time.perf_counter() - t0
        opts = build.BuildOptions.from_config(cfg.data)
        renderer = Renderer.from_config(cfg.data, os.path.join(data, "tokenizer"), storage_dtype=opts.pixel_dtype)
        t0 = time.perf_counter()
        res = build.build(os.path.join(data, "samples.jsonl"), shards, renderer, opts, progress=False)
        build_s = time.perf_counter() - t0
        build_rate = res.stats["read"] / build_s

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
    print(f"{'stage':<10} {'samples':>8} {'seconds':>8} {'samples/s':>10}")
    print(f"{'synth':<10} {args.n:>8} {synth_s:>8.2f} {args.n / synth_s:>10.1f}")
    print(f"{'build':<10} {res.stats['read']:>8} {build_s:>8.2f} {build_rate:>10.1f}")
    print(f"{'loader':<10} {n:>8} {load_s:>8.2f} {load_rate:>10.1f}   (goal >= 1000/s on one core)")
    print(json.dumps({"bench": "data_throughput", "build_samples_per_s": round(build_rate, 1),
                      "loader_samples_per_s": round(load_rate, 1), "synth_samples_per_s": round(args.n / synth_s, 1),
                      "batch_size": args.batch, "n": args.n}))


if __name__ == "__main__":
    main()
