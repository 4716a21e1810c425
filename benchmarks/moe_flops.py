"""Achieved FLOP rate of the ragged MoE layer as a fraction of a dense matmul with the same FLOPs.

The useful MoE work is 3 matmuls per token-assignment (gate, up, down): 6 * T * k * H * I FLOPs.
The dense reference is one [T*k, H] x [H, 3I] matmul, exactly that many FLOPs, on the same
device. A fraction near 1 means the grouped matmul, sort and gather cost little beyond the
matmuls themselves; far below 1 means the grouped-matmul lowering wastes work (e.g. an XLA
expansion that multiplies every row by every expert).

"moe_flop_fraction" is the layer as configured by default (``ragged_dot="auto"``: the tiled
grouped matmul on CPU, tokamax elsewhere); the other implementations are reported beside it, and
``--grad`` adds forward+backward timings (against 3x the dense matmul).

    python -m benchmarks.moe_flops [--tokens=2048 --d_model=512 --d_ff=256 --experts=16 --top_k=4]
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from rm_jax.model.moe import MoeConfig, SparseMoeBlock, resolve_ragged_dot, tile_sizes


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
    parser.add_argument("--impls", default="auto,tiled,tokamax,lax",
                        help="comma-separated MoeConfig.ragged_dot values; the first is the headline")
    parser.add_argument("--tile_rows", type=int, default=0, help="MoeConfig.tile_rows (0 = auto)")
    parser.add_argument("--max_tile_rows", type=int, default=0, help="MoeConfig.max_tile_rows (0 = auto)")
    parser.add_argument("--grad", action="store_true", help="also time forward+backward")
    args = parser.parse_args()

    t, h, f, k = args.tokens, args.d_model, args.d_ff, args.top_k
    flops = 6 * t * k * h * f
    x_btd = jax.random.normal(jax.random.key(0), (1, t, h))

    lhs_md = jax.random.normal(jax.random.key(1), (t * k, h))
    rhs_dn = jax.random.normal(jax.random.key(2), (h, 3 * f))
    dense_s = _best_seconds(jax.jit(jnp.dot), lhs_md, rhs_dn, repeats=args.repeats)
    rows = [("dense matmul", "dense", dense_s)]
    if args.grad:
        # Forward + backward of the dense reference: the three matmuls of a linear layer.
        dense_grad = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.dot(a, b) ** 2), argnums=(0, 1)))
        rows.append(("dense fwd+bwd", "dense_grad", _best_seconds(dense_grad, lhs_md, rhs_dn,
                                                                 repeats=args.repeats)))

    impls = args.impls.split(",")
    for impl in impls:
        cfg = MoeConfig(d_model=h, d_ff=f, num_experts=args.experts, top_k=k, ragged_dot=impl,
                        tile_rows=args.tile_rows, max_tile_rows=args.max_tile_rows)
        graphdef, state = nnx.split(SparseMoeBlock(cfg, rngs=nnx.Rngs(0)))
        fwd = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0])
        name = impl if impl != "auto" else f"auto={resolve_ragged_dot(impl)}"
        rows.append((f"moe ({name})", impl, _best_seconds(fwd, state, x_btd, repeats=args.repeats)))
        if args.grad:
            grad = jax.jit(jax.grad(lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x)[0] ** 2)))
            rows.append((f"moe fwd+bwd ({name})", impl + "_grad",
                         _best_seconds(grad, state, x_btd, repeats=args.repeats)))

    tile = tile_sizes(t * k, args.experts, args.tile_rows, args.max_tile_rows)
    print(f"device={jax.devices()[0].device_kind} tokens={t} H={h} I={f} E={args.experts} k={k} "
          f"useful GFLOP={flops / 1e9:.2f} tiled tile rows {tile[0]}..{tile[1]}")
    print(f"{'path':<30}{'ms':>10}{'GFLOP/s':>10}{'fraction':>10}")
    fractions = {}
    for name, key, seconds in rows:
        ref_s = rows[1][2] if key.endswith("_grad") else dense_s
        scale = 3 if key.endswith("_grad") else 1
        fractions[key] = ref_s / seconds
        print(f"{name:<30}{seconds * 1e3:>10.2f}{scale * flops / seconds / 1e9:>10.1f}"
              f"{fractions[key]:>10.3f}")
    result = {"bench": "moe_flops", "moe_flop_fraction": round(fractions[impls[0]], 4),
              "impl": resolve_ragged_dot(impls[0]), "tile_rows": tile[0], "max_tile_rows": tile[1],
              **{f"moe_flop_fraction_{key}": round(v, 4) for key, v in fractions.items()
                 if not key.startswith("dense")},
              "dense_gflops": round(flops / dense_s / 1e9, 2), "device": jax.devices()[0].device_kind,
              "tokens": t, "d_model": h, "d_ff": f, "experts": args.experts, "top_k": k}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
