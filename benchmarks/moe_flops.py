"""Achieved FLOP rate of the ragged MoE layer as a fraction of a dense matmul with the same FLOPs.

The useful MoE work is 3 matmuls per token-assignment (gate, up, down): 6 * T * k * H * I FLOPs.
The dense reference is one [T*k, H] x [H, 3I] matmul, exactly that many FLOPs, on the same
device. A fraction near 1 means the grouped matmul, sort and gather cost little beyond the
matmuls themselves; far below 1 means the grouped-matmul lowering wastes work (e.g. an XLA
expansion that multiplies every row by every expert).

    python -m benchmarks.moe_flops [--tokens=2048 --d_model=512 --d_ff=256 --experts=16 --top_k=4]
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from rm_jax.model.moe import MoeConfig, SparseMoeBlock


def _best_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--d_model", type=int, default=512)
    parser.add_argument("--d_ff", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top_k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    t, h, f, k = args.tokens, args.d_model, args.d_ff, args.top_k
    flops = 6 * t * k * h * f
    x_btd = jax.random.normal(jax.random.key(0), (1, t, h))

    lhs_md = jax.random.normal(jax.random.key(1), (t * k, h))
    rhs_dn = jax.random.normal(jax.random.key(2), (h, 3 * f))
    dense_s = _best_seconds(jax.jit(jnp.dot), lhs_md, rhs_dn, repeats=args.repeats)
    rows = [("dense matmul", dense_s)]

    for impl in ("tokamax", "lax"):
        cfg = MoeConfig(d_model=h, d_ff=f, num_experts=args.experts, top_k=k, ragged_dot=impl)
        graphdef, state = nnx.split(SparseMoeBlock(cfg, rngs=nnx.Rngs(0)))
        fwd = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0])
        rows.append((f"moe ragged ({impl})", _best_seconds(fwd, state, x_btd, repeats=args.repeats)))

    print(f"device={jax.devices()[0].device_kind} tokens={t} H={h} I={f} E={args.experts} k={k} "
          f"useful GFLOP={flops / 1e9:.2f}")
    print(f"{'path':<22}{'ms':>10}{'GFLOP/s':>10}{'fraction':>10}")
    for name, seconds in rows:
        print(f"{name:<22}{seconds * 1e3:>10.2f}{flops / seconds / 1e9:>10.1f}{dense_s / seconds:>10.3f}")
    result = {"bench": "moe_flops", "moe_flop_fraction": round(dense_s / rows[1][1], 4),
              "moe_flop_fraction_lax": round(dense_s / rows[2][1], 4),
              "dense_gflops": round(flops / dense_s / 1e9, 2), "device": jax.devices()[0].device_kind,
              "tokens": t, "d_model": h, "d_ff": f, "experts": args.experts, "top_k": k}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
