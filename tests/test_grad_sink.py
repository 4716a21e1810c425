"""train.expert_grad_in_scan: routed-expert gradients summed into the accumulator inside the layer
scan (layer_stack.GradSink) equal the plain path, which casts a copy of the expert stacks before
differentiating and adds each microbatch's gradient tree to the accumulator: in a bare layer stack
(scanned and unrolled, with and without remat) and in train steps of both architectures, sharded
on 8 devices, with the 35B recipe's bf16 compute, expert gradients and accumulator."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rm_jax.model import layer_stack
from rm_jax.sharding import make_mesh
from rm_jax.train import loop
from rm_jax.train.data_plan import BatchStream, RunPlan, loader_config
from rm_jax.train.host_batch import assemble, frame_capacity
from rm_jax.train.loss import LossConfig
from rm_jax.train.step import StepBuilder, StepConfig, host_batch_to_device
from run_flags import train_cfg
from test_train import _qwen35_cfg


class _Layer(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (6, 8)))      # the "expert" weight (fp32 master)
        self.b = nnx.Param(jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32))

    def __call__(self, x):
        # used twice, so its gradient is a sum within the layer too
        h = x @ self.w[...].astype(jnp.bfloat16).astype(jnp.float32)[:, :6] + self.b[...][:6]
        return jnp.tanh(h) + 0.1 * jnp.sum(x @ self.w[...].astype(jnp.bfloat16).astype(jnp.float32), -1, keepdims=True)


@pytest.mark.parametrize("scan,remat", [(True, "none"), (True, "full"), (False, "none")])
def test_sink_sums_each_layers_gradient_into_the_accumulator(scan, remat):
    stack = layer_stack.LayerStack(_Layer, 3, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(stack)
    xs = jax.random.normal(jax.random.key(1), (2, 4, 6))      # two microbatches
    acc0 = jax.random.normal(jax.random.key(2), (3, 6, 8)).astype(jnp.bfloat16)

    def loss(state, x):
        out, _ = nnx.merge(graphdef, state).apply(lambda layer, c, _: (layer(c), None), x, scan=scan, remat=remat)
        return jnp.sum(out ** 2)

    def plain(state):
        acc_w, acc_b = acc0, jnp.zeros((3, 8))
        for x in xs:
            g = jax.grad(loss)(jax.tree.map(lambda v: v, state), x)
            acc_w = acc_w + g["layers"]["w"][...].astype(jnp.bfloat16)
            acc_b = acc_b + g["layers"]["b"][...]
        return acc_w, acc_b

    def sunk(state):
        acc_w, acc_b = acc0, jnp.zeros((3, 8))
        for x in xs:
            def with_sink(acc_w, b):
                st = jax.tree.map(lambda v: v, state)
                st["layers"]["w"].set_value(layer_stack.GradSink(state["layers"]["w"][...], acc_w, "bfloat16"))
                st["layers"]["b"].set_value(b)
                return loss(st, x)
            acc_w, g_b = jax.grad(with_sink, argnums=(0, 1))(acc_w, state["layers"]["b"][...])
            acc_b = acc_b + g_b
        return acc_w, acc_b

    (ref_w, ref_b), (got_w, got_b) = jax.jit(plain)(state), jax.jit(sunk)(state)
    assert got_w.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got_w, np.float32), np.asarray(ref_w, np.float32))
    np.testing.assert_array_equal(np.asarray(got_b), np.asarray(ref_b))
    assert not np.array_equal(np.asarray(got_w, np.float32), np.asarray(acc0, np.float32))


def test_a_sink_outside_a_layer_stack_is_refused():
    layer = _Layer(nnx.Rngs(0))
    layer.w.set_value(layer_stack.GradSink(layer.w[...], layer.w[...], "bfloat16"))
    with pytest.raises(TypeError, match="train.expert_grad_in_scan"):
        layer(jnp.ones((2, 6)))


def _sgd_steps(cfg, in_scan: bool, accumulation: int):
    """One step of SGD(lr=1) on (fsdp=8) with the ragged experts: (metrics, params - gradient)."""
    cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, backend="ragged"))
    micro = 16 // accumulation
    mesh = make_mesh(dict(fsdp=8), devices=jax.devices(), num_experts=8, global_batch=micro)
    plan = RunPlan(total_steps=1, micro_batch=micro, accumulation=accumulation, steps_per_epoch=10.0)
    model, mcfg = loop.build_model(cfg, mesh)
    step_cfg = StepConfig(LossConfig(96, 512), lb_coef=0.01, expert_grad_dtype="bfloat16",
                          expert_accum_dtype="bfloat16", expert_grad_in_scan=in_scan)
    builder = StepBuilder(model, optax.sgd(1.0), step_cfg, mesh)
    state = builder.init_state()
    stream = BatchStream(cfg.data.dir, "train", loader_config(cfg, plan, split="train"), accumulation)
    host = assemble(mcfg, stream.next(), frame_capacity(cfg, mcfg))
    batch = host_batch_to_device(host.batch, builder.batch_shardings(host.batch))
    with jax.set_mesh(mesh):
        state, metrics = builder.jit_train(state, batch)(state, builder.rest, batch)
    return jax.device_get(metrics), jax.device_get(state.params)


def _assert_same(ref, got):
    (m_ref, p_ref), (m_got, p_got) = ref, got
    for k in ("loss", "lb_loss", "grad_norm"):
        np.testing.assert_allclose(m_got[k], m_ref[k], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(p_ref), jax.tree.leaves(p_got), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)


@pytest.mark.slow   # two compiles of the tiny judge's step (~1-2 min on 2 cores): `make test-slow`
def test_qwen3_vl_step_with_expert_grads_in_scan_equals_the_plain_path(tiny_cfg, built_shards):
    """Two microbatches of 8 (the scan over microbatches) on the tiny judge with 4 decoder layers:
    deepstack layer 0 is a stack of one (unrolled), layers 1-3 a scanned stack of three."""
    model = tiny_cfg.model.to_dict()
    model["text_config"]["num_hidden_layers"] = 4
    model["vision_config"].update(depth=1, deepstack_visual_indexes=(0,))
    cfg = train_cfg(tiny_cfg, built_shards[0], dtype="bfloat16", global_batch=16, grad_accum=2, remat="full",
                    model=model)
    _assert_same(_sgd_steps(cfg, False, 2), _sgd_steps(cfg, True, 2))


@pytest.mark.slow   # two compiles of the hybrid step per grad_accum (~2-3 min on 2 cores): `make test-slow`
@pytest.mark.parametrize("accumulation", [2, 1])
def test_qwen3_5_step_with_expert_grads_in_scan_equals_the_plain_path(tiny_cfg, built_shards, accumulation):
    """Qwen3.5 (two scanned blocks of GDN + gated attention, shared expert, images), with the 35B's
    layer-stack codec, and without accumulation (one microbatch: the zero-started accumulator)."""
    model = dict(_qwen35_cfg(tiny_cfg, built_shards[0]).model.hf)
    model["text_config"] = dict(model["text_config"], num_hidden_layers=4,
                                layer_types=["linear_attention", "full_attention"] * 2)
    cfg = train_cfg(tiny_cfg, built_shards[0], dtype="bfloat16", global_batch=16, grad_accum=accumulation,
                    remat="full", stack_codec="bf16_bits", model=model)
    _assert_same(_sgd_steps(cfg, False, accumulation), _sgd_steps(cfg, True, accumulation))
