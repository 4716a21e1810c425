"""Gated DeltaNet chunked kernel, forward + backward: rm_jax vs transformers' torch reference.

    python -m benchmarks.gdn_vs_hf [--batch=2 --seq=2048 --key_heads=2 --value_heads=4 --dim=64]

rm_jax's ``chunk_gated_delta_rule`` (jitted ``jax.vjp``) against transformers'
``torch_chunk_gated_delta_rule`` (autograd) at the same shapes, fp32, the same inputs and output
cotangent, the same thread count. Gradients flow to q, k, v, g and beta; q and k are L2-normalised
inside both kernels (as the layer calls them). Prints seconds per forward+backward of each and the
ratio, the forward alone, and the largest gradient difference between the two. Single-threaded by
default and compared by process CPU time (also printed: wall time, the two timed alternately).
Last line: one JSON object. A measurement, not a test: nothing is asserted.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
import time  # noqa: E402

flags.DEFINE_integer("batch", 2, "sequences")
flags.DEFINE_integer("seq", 2048, "tokens per sequence")
flags.DEFINE_integer("key_heads", 2, "q/k heads")
flags.DEFINE_integer("value_heads", 4, "value heads (a multiple of key_heads)")
flags.DEFINE_integer("dim", 64, "key and value head dim")
flags.DEFINE_integer("chunk", 64, "chunk size")
flags.DEFINE_integer("threads", 1, "CPU threads for both; 1 (the default) is timed by CPU time, which "
                     "other tenants of a shared CPU do not stretch; 0: all this process may use, timed by wall")
flags.DEFINE_integer("iters", 7, "timed iterations of each, interleaved (after two warm-ups)")


def interleaved_medians(fn_a, fn_b, iters: int, warmup: int = 2):
    """Median (wall, process CPU) seconds of two functions timed alternately (a, b, a, b, ...),
    after warm-up: ``((wall_a, cpu_a), (wall_b, cpu_b))``."""
    for _ in range(warmup):
        fn_a(), fn_b()
    times = {0: ([], []), 1: ([], [])}
    for _ in range(iters):
        for i, fn in enumerate((fn_a, fn_b)):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[i][0].append(time.perf_counter() - w0)
            times[i][1].append(time.process_time() - c0)
    return tuple((float(np.median(w)), float(np.median(c))) for w, c in (times[0], times[1]))


def main(argv):
    del argv
    f = flags.FLAGS
    n_threads = f.threads or len(os.sched_getaffinity(0))
    if n_threads == 1:  # must precede the jax import: XLA's CPU thread pool is fixed at start
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                                   " intra_op_parallelism_threads=1").strip()
    import jax
    import jax.numpy as jnp
    import torch
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_chunk_gated_delta_rule

    from rm_jax.model.gated_deltanet import chunk_gated_delta_rule

    torch.set_num_threads(n_threads)
    b, t, g, h, d = f.batch, f.seq, f.key_heads, f.value_heads, f.dim
    rng = np.random.default_rng(0)
    arrays = dict(
        q=rng.standard_normal((b, t, g, d)), k=rng.standard_normal((b, t, g, d)),
        v=rng.standard_normal((b, t, h, d)),
        g=-np.logaddexp(0, rng.standard_normal((b, t, h))) * 0.5,       # softplus-shaped log decays
        beta=1 / (1 + np.exp(-rng.standard_normal((b, t, h)))))
    arrays = {k: v.astype(np.float32) for k, v in arrays.items()}
    cot = rng.standard_normal((b, t, h, d)).astype(np.float32)
    names = ("q", "k", "v", "g", "beta")

    # ---- rm_jax -----------------------------------------------------------------------------
    def fwd(*xs):
        return chunk_gated_delta_rule(*xs, chunk_size=f.chunk, use_qk_l2norm=True)[0]

    @jax.jit
    def fwd_bwd(xs, cot):
        o, vjp = jax.vjp(fwd, *xs)
        return o, vjp(cot)

    xs = tuple(jnp.asarray(arrays[n]) for n in names)
    cot_j = jnp.asarray(cot)
    jit_fwd = jax.jit(fwd)
    _, jax_grads = fwd_bwd(xs, cot_j)

    # ---- transformers -----------------------------------------------------------------------
    def hf_step():
        ts = [torch.from_numpy(arrays[n]).requires_grad_(True) for n in names]
        o, _ = torch_chunk_gated_delta_rule(*ts, chunk_size=f.chunk, use_qk_l2norm_in_kernel=True)
        o.backward(torch.from_numpy(cot))
        return [x.grad for x in ts]

    def hf_fwd():
        with torch.no_grad():
            torch_chunk_gated_delta_rule(*(torch.from_numpy(arrays[n]) for n in names),
                                         chunk_size=f.chunk, use_qk_l2norm_in_kernel=True)

    # Interleaved, so both see the same load on a shared CPU.
    jax_fb = lambda: jax.block_until_ready(fwd_bwd(xs, cot_j))
    jax_f = lambda: jax.block_until_ready(jit_fwd(*xs))
    jax_s, hf_s = interleaved_medians(jax_fb, hf_step, f.iters)
    jax_fwd_s, hf_fwd_s = interleaved_medians(jax_f, hf_fwd, f.iters)
    hf_grads = hf_step()
    grad_err = max(float(np.max(np.abs(np.asarray(a) - b.numpy())) / (np.max(np.abs(b.numpy())) + 1e-30))
                   for a, b in zip(jax_grads, hf_grads))

    (jw, jc), (hw, hc) = jax_s, hf_s
    (jfw, jfc), (hfw, hfc) = jax_fwd_s, hf_fwd_s
    # Single-threaded, CPU time is the steadier figure on a shared machine (other tenants do not
    # stretch it); with more threads only wall time means anything.
    use_cpu = n_threads == 1
    speedup = (hc / jc) if use_cpu else (hw / jw)
    fwd_speedup = (hfc / jfc) if use_cpu else (hfw / jfw)
    print(f"threads: jax (XLA CPU) {n_threads}, torch {torch.get_num_threads()}; B={b} T={t} "
          f"key heads {g} x {d}, value heads {h} x {d}, chunk {f.chunk}; medians of {f.iters}, interleaved")
    print(f"{'impl':<14}{'fwd+bwd wall':>14}{'fwd+bwd cpu':>13}{'fwd wall':>10}{'fwd cpu':>9}")
    print(f"{'rm_jax':<14}{jw:>14.4f}{jc:>13.4f}{jfw:>10.4f}{jfc:>9.4f}")
    print(f"{'transformers':<14}{hw:>14.4f}{hc:>13.4f}{hfw:>10.4f}{hfc:>9.4f}")
    print(f"speedup rm_jax / transformers ({'CPU time' if use_cpu else 'wall time'}): "
          f"fwd+bwd {speedup:.2f}x, fwd {fwd_speedup:.2f}x  (wall: fwd+bwd {hw / jw:.2f}x, fwd {hfw / jfw:.2f}x)")
    print(f"max relative gradient difference (q, k, v, g, beta): {grad_err:.2e}")
    print(json.dumps({"bench": "gdn_vs_hf", "speedup_vs_hf": round(speedup, 3),
                      "fwd_speedup_vs_hf": round(fwd_speedup, 3), "timing": "cpu" if use_cpu else "wall",
                      "wall_speedup_vs_hf": round(hw / jw, 3),
                      "rm_jax_fwd_bwd_s": round(jc if use_cpu else jw, 4), "hf_fwd_bwd_s": round(hc if use_cpu else hw, 4),
                      "rm_jax_fwd_s": round(jfc if use_cpu else jfw, 4), "hf_fwd_s": round(hfc if use_cpu else hfw, 4),
                      "max_rel_grad_diff": float(f"{grad_err:.3g}"), "threads": n_threads,
                      "batch": b, "seq": t, "key_heads": g, "value_heads": h, "head_dim": d,
                      "chunk": f.chunk, "platform": jax.devices()[0].platform}))


if __name__ == "__main__":
    app.run(main)
