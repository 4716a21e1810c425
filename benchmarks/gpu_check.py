"""One command for the day a GPU host is at hand: do the GPU paths work, and how fast are they?

    python -m benchmarks.gpu_check            # one H100/H200, jax >= 0.11 with CUDA; < 5 minutes
    python -m benchmarks.gpu_check --smoke    # any host: only the checks that run on CPU (5-8, reduced)

Checks (each prints a row; the last line is one JSON object with every figure and a pass/fail per
check; the exit status is 0 either way, so a failing check never hides the other figures):

1. ``flash_attention``: cuDNN flash attention (``jax.nn.dot_product_attention(implementation=
   "cudnn")``) against XLA's attention computed in fp32, bf16 inputs, a right-padded batch (key
   lengths T, ~2/3 T, ~1/3 T, 1), GQA, head_dim 128 (the 30B text), 72 (its ViT) and 256 (the
   Qwen3.5-35B's full attention: cuDNN has it from compute capability 9.0); forward and the
   gradient. Also that ``train.attention=auto`` picks cuDNN for these inputs where cuDNN has the
   kernel, and XLA (with the reason) where it does not (head_dim 256 before Hopper).
2. ``ragged_dot``: ``tokamax.ragged_dot`` against ``jax.lax.ragged_dot`` (and an fp32 reference),
   bf16, the 30B expert shapes (128 experts, K=2048, N=768), uneven groups with empty experts;
   alone and inside ``jax.shard_map`` over the local devices (each device its own tokens).
3. ``train_step``: the 30B config scaled down to 2 decoder layers and 2 ViT blocks (real widths,
   real vocabulary, bf16 compute, the config's optimizer dtypes, cuDNN, tokamax), FSDP over the
   local devices: ``memory_analysis()`` of the compiled step, then a few steps (finite loss, time).
4. ``score_throughput``: the tiny judge (random weights) scoring synthetic samples: samples/s.
5. ``stack_codec``: ``train.stack_codec=bf16_bits`` (the 35B's) against the plain scan: a bf16
   layer stack's loss and gradients bit-identical on this device, and the step time of both.
6. ``attention_choice``: what ``train.attention`` of the 30B and 35B configs resolves to on this
   device for their head dims (and on sm 8.0 / 9.0, for the record), with the reasons.
7. ``expert_grad_in_scan``: ``train.expert_grad_in_scan`` (the 35B's) against the plain
   accumulation (a bf16 copy of the fp32 stack differentiated per microbatch and added to the
   accumulator): the accumulated gradients bit-identical, and the compiled temp bytes of each.
8. ``moment_copies``: a donated AdamW update with bf16 mu/nu (the 35B's): how many of the donated
   moments the compiled program copies (XLA:CPU copies all of them: 15 GiB of the 35B plan's peak),
   and its temp bytes.

On a host without a GPU it says so and exits 0 (``tests/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

GIB = 1 << 30


def log(msg: str) -> None:
    print(msg, flush=True)


def _timed(fn, *args, n: int = 5) -> float:
    """Median wall ms of ``fn(*args)`` after one warm-up (compile) call."""
    import jax
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------------------------------------
# 1. cuDNN flash attention
# ---------------------------------------------------------------------------------------------

# head_dim -> (B, T, N, K): the 30B text and ViT; the 35B's full attention (16 heads, 2 KV heads)
FLASH_SHAPES = {128: (4, 2048, 32, 4), 72: (4, 1024, 16, 16), 256: (4, 4096, 16, 2)}


def _capability() -> str | None:
    import jax
    return getattr(jax.devices()[0], "compute_capability", None)


def check_flash_attention(shapes: dict = FLASH_SHAPES, fused: str = "cudnn") -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rm_jax.model.layers import choose_attention, cudnn_max_head_dim
    out: dict = {"pass": True}
    capability = _capability()
    for head_dim, (b, t, n, k) in shapes.items():
        chosen, why = choose_attention("auto", jax.default_backend(), jnp.bfloat16, head_dim,
                                       compute_capability=capability)
        if head_dim > cudnn_max_head_dim(capability):     # no cuDNN kernel here: auto must say XLA
            ok = chosen == "xla"
            out[f"h{head_dim}"] = {"auto_picks": chosen, "auto_reason": why, "compute_capability": capability,
                                   "skipped": "no cuDNN kernel for this head_dim here", "pass": ok}
            out["pass"] &= ok
            log(f"flash_attention h={head_dim}: sm {capability} has no cuDNN kernel; auto -> {chosen} ({why})  "
                f"[{'pass' if ok else 'FAIL'}]")
            continue
        rng = np.random.default_rng(head_dim)
        q, kk, v = (jnp.asarray(rng.standard_normal((b, t, h, head_dim)), jnp.bfloat16) for h in (n, k, k))
        lengths = jnp.asarray([t, 2 * t // 3, t // 3, 1], jnp.int32)
        scale = head_dim ** -0.5
        causal = head_dim != 72           # text: causal + key lengths; ViT frame slots: key lengths only

        def attn(impl, q, kk, v):
            return jax.nn.dot_product_attention(q, kk, v, scale=scale, is_causal=causal,
                                                key_value_seq_lengths=lengths, implementation=impl)

        cudnn = jax.jit(lambda q, kk, v: attn(fused, q, kk, v))
        ref = jax.jit(lambda q, kk, v: attn("xla", *(x.astype(jnp.float32) for x in (q, kk, v))))
        got, want = np.asarray(cudnn(q, kk, v), np.float32), np.asarray(ref(q, kk, v))
        # rows past a sequence's length are padding: compare the real query rows only
        valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
        err = float(np.abs(got - want)[valid].max())

        def loss(impl, q, kk, v):
            return jnp.sum(attn(impl, q, kk, v).astype(jnp.float32) * valid[:, :, None, None])

        g_cudnn = jax.jit(jax.grad(lambda q, kk, v: loss(fused, q, kk, v), argnums=(0, 1, 2)))(q, kk, v)
        g_ref = jax.jit(jax.grad(lambda q, kk, v: loss("xla", *(x.astype(jnp.float32) for x in (q, kk, v))),
                                 argnums=(0, 1, 2)))(q, kk, v)
        g_err = max(float(np.abs(np.asarray(a, np.float32) - np.asarray(r)).max() / (np.abs(np.asarray(r)).max() + 1e-9))
                    for a, r in zip(g_cudnn, g_ref))
        ms_cudnn = _timed(cudnn, q, kk, v)
        xla_bf16 = jax.jit(lambda q, kk, v: attn("xla", q, kk, v))
        ms_xla = _timed(xla_bf16, q, kk, v)
        # bf16 outputs of softmax-weighted averages of N(0,1) values: |out| <~ 3, bf16 ulp 2^-7
        ok = err < 3e-2 and g_err < 3e-2 and chosen == fused
        out[f"h{head_dim}"] = {"shape_btnkh": [b, t, n, k, head_dim], "causal": causal,
                               "max_abs_err_fwd": err, "max_rel_err_grad": g_err, "auto_picks": chosen,
                               "auto_reason": why, "ms_cudnn_fwd": ms_cudnn, "ms_xla_bf16_fwd": ms_xla,
                               "speedup_vs_xla": ms_xla / ms_cudnn, "pass": ok}
        out["pass"] &= ok
        log(f"flash_attention h={head_dim}: fwd max|err| {err:.2e}, grad rel err {g_err:.2e}, auto -> {chosen}; "
            f"cuDNN {ms_cudnn:.2f} ms vs XLA {ms_xla:.2f} ms  [{'pass' if ok else 'FAIL'}]")
    return out


# ---------------------------------------------------------------------------------------------
# 2. tokamax ragged_dot
# ---------------------------------------------------------------------------------------------

def _group_sizes(rng, m: int, e: int):
    import numpy as np
    w = rng.gamma(0.5, size=e)
    w[rng.choice(e, size=e // 8, replace=False)] = 0          # some experts get no rows
    sizes = np.floor(w / w.sum() * m).astype(np.int32)
    sizes[np.argmax(sizes)] += m - sizes.sum()
    return sizes


def check_ragged_dot(m: int = 8192, k: int = 2048, n: int = 768, e: int = 128) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import tokamax
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((m, k)) * 0.1, jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((e, k, n)) * 0.02, jnp.bfloat16)
    sizes = jnp.asarray(_group_sizes(rng, m, e))
    tok = jax.jit(lambda a, b, g: tokamax.ragged_dot(a, b, g))
    lax_ = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g))
    ref = np.asarray(jax.jit(lambda a, b, g: jax.lax.ragged_dot(a.astype(jnp.float32), b.astype(jnp.float32), g))(
        lhs, rhs, sizes))
    scale = float(np.abs(ref).max())
    got_tok, got_lax = np.asarray(tok(lhs, rhs, sizes), np.float32), np.asarray(lax_(lhs, rhs, sizes), np.float32)
    err_tok, err_lax = float(np.abs(got_tok - ref).max()) / scale, float(np.abs(got_lax - ref).max()) / scale
    ms_tok, ms_lax = _timed(tok, lhs, rhs, sizes), _timed(lax_, lhs, rhs, sizes)
    ok_alone = err_tok < 2e-2
    log(f"ragged_dot alone [{m}x{k}] x [{e}x{k}x{n}] bf16: tokamax rel err {err_tok:.2e} (lax {err_lax:.2e}); "
        f"tokamax {ms_tok:.2f} ms vs lax {ms_lax:.2f} ms  [{'pass' if ok_alone else 'FAIL'}]")

    # Inside shard_map: each device its own tokens and group sizes, the experts replicated.
    devs = jax.local_devices()
    mesh = jax.make_mesh((len(devs),), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=devs)
    d = len(devs)
    sizes_d = jnp.asarray(np.stack([_group_sizes(rng, m // d, e) for _ in range(d)]))

    def sharded(impl):
        def body(a, b, g):
            fn = tokamax.ragged_dot if impl == "tokamax" else jax.lax.ragged_dot
            return fn(a, b, g[0])
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P("x")), out_specs=P("x"),
                                     check_vma=False))

    with jax.set_mesh(mesh):
        sm_tok = np.asarray(sharded("tokamax")(lhs, rhs, sizes_d), np.float32)
        sm_lax = np.asarray(sharded("lax")(lhs, rhs, sizes_d), np.float32)
    rows = m // d
    sm_ref = np.concatenate([np.asarray(jax.lax.ragged_dot(lhs[i * rows:(i + 1) * rows].astype(jnp.float32),
                                                           rhs.astype(jnp.float32), sizes_d[i])) for i in range(d)])
    sm_err = float(np.abs(sm_tok - sm_ref).max()) / float(np.abs(sm_ref).max())
    sm_agree = float(np.abs(sm_tok - sm_lax).max()) / float(np.abs(sm_ref).max())
    ok_sm = sm_err < 2e-2
    log(f"ragged_dot in shard_map over {d} device(s): tokamax rel err {sm_err:.2e} (vs lax {sm_agree:.2e})  "
        f"[{'pass' if ok_sm else 'FAIL'}]")
    return {"shape_mkne": [m, k, n, e], "rel_err_tokamax": err_tok, "rel_err_lax": err_lax, "ms_tokamax": ms_tok,
            "ms_lax": ms_lax, "speedup_vs_lax": ms_lax / ms_tok, "shard_map_devices": d,
            "shard_map_rel_err_tokamax": sm_err, "shard_map_tokamax_vs_lax": sm_agree,
            "pass_alone": ok_alone, "pass_shard_map": ok_sm, "pass": ok_alone and ok_sm}


# ---------------------------------------------------------------------------------------------
# 3. bf16 train step of the scaled-down 30B config
# ---------------------------------------------------------------------------------------------

def check_train_step(seq: int = 4096, steps: int = 3, text_overrides: dict | None = None,
                     attention: str | None = None) -> dict:
    import dataclasses

    import jax
    import numpy as np

    from configs import qwen3_vl_30b_a3b
    from rm_jax.model import registry
    from rm_jax.run_config import model_config, parse
    from rm_jax.sharding import make_mesh
    from rm_jax.train import loop, optim
    from rm_jax.train.step import StepBatch, StepBuilder, host_batch_to_device

    cfg = qwen3_vl_30b_a3b.get_config()
    cfg.model.text_config.num_hidden_layers = 2
    cfg.model.vision_config.depth = 2
    cfg.model.vision_config.deepstack_visual_indexes = (0, 1)
    cfg.model.text_config.update(text_overrides or {})       # (a CPU smoke run shrinks the widths)
    if attention is not None:
        cfg.train.attention = attention
    n_dev = jax.local_device_count()
    cfg.mesh.fsdp = n_dev
    a, b = 2, n_dev                                    # 2 microbatches of one sequence per device
    cfg.train.grad_accum, cfg.train.global_batch = a, a * b
    run = parse(cfg)
    mcfg = model_config(run)
    mesh = make_mesh(run.mesh, num_experts=mcfg.text.num_experts, global_batch=b)
    t0 = time.time()
    model, mcfg = loop.build_model(run, mesh)
    ocfg = dataclasses.replace(optim.OptimConfig.from_config(run.train), total_steps=100, warmup_steps=1)
    builder = StepBuilder(model, optim.make_optimizer(ocfg, model), loop.step_config(run), mesh, optim.schedule(ocfg))
    state = builder.init_state()
    init_s = time.time() - t0

    rng = np.random.default_rng(0)
    micro = []
    for _ in range(a):
        lengths = rng.integers(seq // 2, seq + 1, size=b)
        ids = rng.integers(1000, mcfg.text.vocab_size, size=(b, seq)).astype(np.int32)
        mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)
        target = ((np.arange(seq)[None, :] >= lengths[:, None] - 64) & (mask > 0)).astype(np.float32)
        inputs = registry.prepare_inputs(mcfg, ids * mask, mask, attention="lengths")
        micro.append((inputs, target))
    batch = StepBatch(inputs=jax.tree.map(lambda *xs: np.stack(xs), *[m[0] for m in micro]),
                      target_mask=np.stack([m[1] for m in micro]))
    dev = host_batch_to_device(batch, builder.batch_shardings(batch))
    with jax.set_mesh(mesh):
        train = builder.jit_train(state, dev)
        t0 = time.time()
        compiled = train.lower(state, builder.rest, dev).compile()
        compile_s = time.time() - t0
        mem = compiled.memory_analysis()
        losses, times = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            state, metrics = compiled(state, builder.rest, dev)
            losses.append(float(jax.device_get(metrics["loss"])))
            times.append(time.perf_counter() - t0)
    mem_gib = {f: getattr(mem, f"{f}_size_in_bytes", 0) / GIB for f in ("argument", "output", "temp", "alias")}
    peak = mem_gib["argument"] + mem_gib["output"] + mem_gib["temp"] - mem_gib["alias"]
    tokens = a * b * seq
    ok = all(np.isfinite(losses))
    widths = "30B widths" if not text_overrides else "reduced widths"
    log(f"train_step ({widths}, 2 layers, bf16, fsdp={n_dev}, A={a} x {b} x {seq}): compiled in {compile_s:.1f}s; "
        f"per device args {mem_gib['argument']:.2f} GiB temp {mem_gib['temp']:.2f} -> peak {peak:.2f} GiB; "
        f"losses {[round(x, 4) for x in losses]}; {np.median(times[1:] or times):.3f} s/step  "
        f"[{'pass' if ok else 'FAIL'}]")
    return {"layers": 2, "vit_blocks": 2, "devices": n_dev, "grad_accum": a, "microbatch": b, "seq": seq,
            "attention": cfg.train.attention, "ragged_dot": cfg.moe.ragged_dot, "init_s": init_s,
            "compile_s": compile_s, "memory_gib_per_device": mem_gib, "peak_gib_per_device": peak,
            "losses": losses, "s_per_step": float(np.median(times[1:] or times)),
            "tokens_per_s": tokens / float(np.median(times[1:] or times)), "pass": ok}


# ---------------------------------------------------------------------------------------------
# 4. scoring throughput of the tiny judge
# ---------------------------------------------------------------------------------------------

def check_score_throughput(n: int = 192, batch: int = 32) -> dict:
    import os
    import tempfile

    import numpy as np

    from launch.common import DEFAULT_CONFIG, load_config
    from rm_jax.data import synth
    from rm_jax.data.render import Renderer
    from rm_jax.data.schema import Sample, read_samples
    from rm_jax.model import registry
    from rm_jax.run_config import model_config, parse
    from rm_jax.score.scorer import Scorer

    cfg = load_config(DEFAULT_CONFIG)
    with tempfile.TemporaryDirectory() as tmp:
        synth.write_dataset(tmp, n=n, seed=0)
        renderer = Renderer.from_config(cfg.data, os.path.join(tmp, "tokenizer"))
        samples = [s for s in read_samples(os.path.join(tmp, "samples.jsonl")) if isinstance(s, Sample)]
        model = registry.init_model(model_config(parse(cfg)), seed=0)
        scorer = Scorer(model, renderer, buckets=tuple(cfg.data.buckets), batch_size=batch, progress=False)
        scorer.p_pass(samples)                  # compile every bucket the samples need
        t0 = time.perf_counter()
        scored = scorer.p_pass(samples)
        dt = time.perf_counter() - t0
    p = np.asarray([s.p_pass for s in scored])
    ok = bool(np.isfinite(p).all() and ((p >= 0) & (p <= 1)).all())
    log(f"score_throughput (tiny judge, batch {batch}): {len(samples) / dt:.1f} samples/s over {len(samples)} "
        f"samples  [{'pass' if ok else 'FAIL'}]")
    return {"samples": len(samples), "batch": batch, "seconds": dt, "samples_per_s": len(samples) / dt, "pass": ok}


# ---------------------------------------------------------------------------------------------
# 5. layer-stack codec, 6. attention choices (both also run on CPU: --smoke)
# ---------------------------------------------------------------------------------------------

def check_stack_codec(layers: int = 8, width: int = 1024, batch: int = 4096) -> dict:
    """A bf16 layer stack (as the step differentiates the expert weights) scanned plainly and as
    packed bits: loss and every gradient bit-identical; the step time of each."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from rm_jax.model import layer_stack

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param((jax.random.normal(rngs.params(), (width, width)) / width ** 0.5).astype(jnp.bfloat16))

        def __call__(self, x):
            return jnp.tanh(x @ self.w[...])

    graphdef, state = nnx.split(layer_stack.LayerStack(Layer, layers, rngs=nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (batch, width), jnp.bfloat16)

    def make(codec):
        def loss(state):
            out, _ = nnx.merge(graphdef, state).apply(lambda layer, c, _: (layer(c), None), x, codec=codec)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.jit(jax.value_and_grad(loss))

    plain, packed = make("none"), make("bf16_bits")
    (l0, g0), (l1, g1) = plain(state), packed(state)
    same = float(l0) == float(l1) and all(
        np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)))
    ms_plain, ms_packed = _timed(plain, state), _timed(packed, state)
    log(f"stack_codec ({layers} x [{width}, {width}] bf16): loss and gradients bit-identical: {same}; "
        f"plain {ms_plain:.2f} ms, bf16_bits {ms_packed:.2f} ms  [{'pass' if same else 'FAIL'}]")
    return {"bit_identical": same, "ms_plain": ms_plain, "ms_bf16_bits": ms_packed, "pass": same}


def check_attention_choice() -> dict:
    """train.attention of the 30B and 35B configs resolved for their text head dims: on this
    device, and on compute capability 8.0 and 9.0 for the record."""
    import importlib

    import jax

    from rm_jax.model.layers import choose_attention
    platform, capability = jax.default_backend(), _capability()
    out: dict = {"pass": True, "platform": platform, "compute_capability": capability}
    for name in ("qwen3_vl_30b_a3b", "qwen3_5_35b_a3b"):
        cfg = importlib.import_module(f"configs.{name}").get_config()
        head_dim = int(cfg.model.text_config.head_dim)
        rows = {"here": choose_attention(cfg.train.attention, platform, cfg.train.dtype, head_dim,
                                         compute_capability=capability)}
        for sm in ("8.0", "9.0"):
            rows[f"sm{sm}"] = choose_attention(cfg.train.attention, "gpu", cfg.train.dtype, head_dim,
                                               compute_capability=sm)
        # Hopper runs every config's text attention as cuDNN flash (what the memory plan counts).
        ok = rows["sm9.0"][0] == "cudnn"
        out[name] = {"head_dim": head_dim, "train.attention": cfg.train.attention,
                     **{k: {"impl": v[0], "why": v[1]} for k, v in rows.items()}, "pass": ok}
        out["pass"] &= ok
        log(f"attention_choice {name} (head_dim {head_dim}, train.attention={cfg.train.attention}): "
            + "; ".join(f"{k} -> {v[0]} ({v[1]})" for k, v in rows.items()) + f"  [{'pass' if ok else 'FAIL'}]")
    return out


def check_expert_grad_in_scan(layers: int = 8, width: int = 2048, batch: int = 2048, micro: int = 4) -> dict:
    """An fp32 layer stack used in bf16 (as the MoE uses its expert weights), gradients summed
    over ``micro`` microbatches into a bf16 accumulator: through ``layer_stack.GradSink`` and the
    plain way; bit-identical sums, and each program's temp bytes."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from rm_jax.model import layer_stack

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (width, width)) / width ** 0.5)

        def __call__(self, x):
            return jnp.tanh(x @ self.w[...].astype(jnp.bfloat16))

    graphdef, state = nnx.split(layer_stack.LayerStack(Layer, layers, rngs=nnx.Rngs(0)))
    xs = jax.random.normal(jax.random.key(1), (micro, batch, width), jnp.bfloat16)

    def loss(state, x):
        out, _ = nnx.merge(graphdef, state).apply(lambda layer, c, _: (layer(c), None), x, remat="full")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    def plain(state):
        w = state["layers"]["w"][...].astype(jnp.bfloat16)

        def body(acc, x):
            st = jax.tree.map(lambda v: v, state)
            st["layers"]["w"].set_value(w)
            return acc + jax.grad(loss)(st, x)["layers"]["w"][...], None
        return jax.lax.scan(body, jnp.zeros(w.shape, jnp.bfloat16), xs)[0]

    def sunk(state):
        def body(acc, x):
            def with_sink(acc):
                st = jax.tree.map(lambda v: v, state)
                st["layers"]["w"].set_value(layer_stack.GradSink(state["layers"]["w"][...], acc, "bfloat16"))
                return loss(st, x)
            return jax.grad(with_sink)(acc), None
        return jax.lax.scan(body, jnp.zeros(state["layers"]["w"].shape, jnp.bfloat16), xs)[0]

    fns = {name: jax.jit(f) for name, f in (("plain", plain), ("in_scan", sunk))}
    temp = {name: f.lower(state).compile().memory_analysis().temp_size_in_bytes / GIB for name, f in fns.items()}
    a, b = fns["plain"](state), fns["in_scan"](state)
    same = bool(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)))
    stack = layers * width * width * 2 / GIB
    log(f"expert_grad_in_scan ({layers} x [{width}, {width}], {micro} microbatches): sums bit-identical: {same}; "
        f"temp plain {temp['plain'] * 1024:.1f} MiB, in scan {temp['in_scan'] * 1024:.1f} MiB (one bf16 stack "
        f"{stack * 1024:.1f} MiB)  "
        f"[{'pass' if same else 'FAIL'}]")
    return {"bit_identical": same, "temp_gib": temp, "bf16_stack_gib": stack, "pass": same}


def check_moment_copies(leaves: int = 6, shape: tuple = (16, 1024, 1024)) -> dict:
    """A donated AdamW update (bf16 mu/nu, fp32 weights, the 35B's optimizer dtypes): how many
    full-size moment copies the compiled program makes, and its temp bytes. XLA:CPU copies every
    donated moment (15 GiB per device in the 35B plan: docs/experiments/memory-plan-35b.md); this
    says whether the GPU's compile does too. A measurement: it passes when it compiles and runs."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from rm_jax.train import optim
    cfg = optim.OptimConfig(lr=1e-3, warmup_steps=1, total_steps=10, mu_dtype="bfloat16", nu_dtype="bfloat16")
    params = {f"w{i}": jax.random.normal(jax.random.key(i), shape) for i in range(leaves)}
    tx = optim.make_optimizer(cfg, params)

    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    fn = jax.jit(step, donate_argnums=(0, 1))
    grads = jax.tree.map(lambda p: jnp.sin(p * 3.0), params)
    compiled = fn.lower(params, jax.eval_shape(tx.init, params), grads).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes / GIB
    dims = ",".join(map(str, shape))
    copies = sum(1 for line in compiled.as_text().splitlines() if " copy(" in line and f"bf16[{dims}]" in line)
    new_params, _ = fn(params, tx.init(params), grads)
    ok = bool(all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new_params)))
    moments_gib = 2 * leaves * int(np.prod(shape)) * 2 / GIB
    log(f"moment_copies ({leaves} x {list(shape)} fp32, bf16 mu/nu, donated): {copies} full-size moment copies of "
        f"{2 * leaves}, temp {temp * 1024:.1f} MiB (the moments are {moments_gib * 1024:.1f} MiB)  "
        f"[{'pass' if ok else 'FAIL'}]")
    return {"moment_copies": copies, "moments": 2 * leaves, "temp_gib": temp, "moments_gib": moments_gib, "pass": ok}


CHECKS = {"flash_attention": check_flash_attention, "ragged_dot": check_ragged_dot,
          "train_step": check_train_step, "score_throughput": check_score_throughput,
          "stack_codec": check_stack_codec, "attention_choice": check_attention_choice,
          "expert_grad_in_scan": check_expert_grad_in_scan, "moment_copies": check_moment_copies}
# What --smoke runs on a CPU host (reduced shapes): the checks with no GPU-only kernel.
SMOKE = {"stack_codec": lambda: check_stack_codec(layers=3, width=64, batch=32),
         "attention_choice": check_attention_choice,
         "expert_grad_in_scan": lambda: check_expert_grad_in_scan(layers=3, width=64, batch=32, micro=2),
         "moment_copies": lambda: check_moment_copies(leaves=2, shape=(4, 64, 128))}


def main() -> int:
    import jax
    ap = argparse.ArgumentParser(description="GPU paths check (see the module doc)")
    ap.add_argument("--smoke", action="store_true", help="only the checks that need no GPU (stack_codec, "
                    "attention_choice, expert_grad_in_scan, moment_copies), with reduced shapes: runs on any host")
    smoke = ap.parse_args().smoke
    backend = jax.default_backend()
    if backend != "gpu" and not smoke:
        log(f"gpu_check needs a GPU (jax {jax.__version__} found only the '{backend}' platform): nothing checked "
            f"(--smoke runs the CPU-runnable checks).")
        print(json.dumps({"bench": "gpu_check", "skipped": True, "reason": f"no GPU (platform {backend})",
                          "jax": jax.__version__}), flush=True)
        return 0
    dev = jax.local_devices()[0]
    log(f"gpu_check{' --smoke' if smoke else ''}: jax {jax.__version__}, {jax.local_device_count()} x "
        f"{dev.device_kind}")
    results: dict = {}
    t_all = time.time()
    for name, fn in (SMOKE if smoke else CHECKS).items():
        t0 = time.time()
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - one broken path must not hide the others
            traceback.print_exc()
            results[name] = {"pass": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}
            log(f"{name}: ERROR {type(e).__name__}: {str(e)[:300]}  [FAIL]")
        results[name]["seconds"] = round(time.time() - t0, 1)
    summary = {"bench": "gpu_check", "smoke": smoke, "skipped": False, "jax": jax.__version__, "device": dev.device_kind,
               "devices": jax.local_device_count(), "seconds": round(time.time() - t_all, 1),
               "pass": {k: bool(v.get("pass")) for k, v in results.items()},
               "all_pass": all(bool(v.get("pass")) for v in results.values()), "checks": results}
    print(json.dumps(summary, default=float), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
