"""benchmarks/memory_plan.py's assumptions are what training runs: its flash-like attention
stand-in computes XLA's attention (forward and gradient), and it is used only where the config's
train.attention resolves to cuDNN flash on the planned GPU."""

import importlib.util
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# benchmarks/ is a folder of scripts, not an installed package: load the plan by its path.
_spec = importlib.util.spec_from_file_location(
    "memory_plan", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                "memory_plan.py"))
memory_plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory_plan)


@pytest.mark.parametrize("head_dim,kv_heads", [(256, 2), (128, 4)])
def test_chunked_attention_stand_in_equals_xla_attention(head_dim, kv_heads):
    b, t, n = 2, 64, 8
    rng = np.random.default_rng(head_dim)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, h, head_dim)), jnp.float32) for h in (n, kv_heads, kv_heads))
    lengths = jnp.asarray([t, 37], jnp.int32)
    xla = jax.nn.dot_product_attention
    chunked = memory_plan.make_chunked_attention(xla, block=16)

    def loss(attn, q, k, v):
        out = attn(q, k, v, is_causal=True, key_value_seq_lengths=lengths, implementation=None)
        return jnp.sum(jnp.sin(out) * (jnp.arange(t) < lengths[:, None])[:, :, None, None]), out

    (ref_l, ref_o), ref_g = jax.value_and_grad(lambda *a: loss(xla, *a), argnums=(0, 1, 2), has_aux=True)(q, k, v)
    (got_l, got_o), got_g = jax.value_and_grad(lambda *a: loss(chunked, *a), argnums=(0, 1, 2),
                                               has_aux=True)(q, k, v)
    valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    np.testing.assert_allclose(np.asarray(got_o)[valid], np.asarray(ref_o)[valid], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(got_l), float(ref_l), rtol=1e-5)
    for g, r in zip(got_g, ref_g):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def _flags(**kw):
    return types.SimpleNamespace(**{"attention": "auto", "model": "qwen3_5_35b_a3b", "override": [],
                                    "target_sm": "9.0", **kw})


def test_plan_counts_flash_attention_only_where_training_runs_cudnn():
    assert memory_plan.plan_attention(_flags())[0] == "chunked"                    # H100/H200: cuDNN, head_dim 256
    impl, why = memory_plan.plan_attention(_flags(target_sm="8.0"))               # A100: XLA, as training
    assert impl == "xla" and "head_dim 256" in why
    assert memory_plan.plan_attention(_flags(override=["train.attention=xla"]))[0] == "xla"
    assert memory_plan.plan_attention(_flags(model="qwen3_vl_30b_a3b", target_sm="8.0"))[0] == "chunked"
    assert memory_plan.plan_attention(_flags(attention="xla"))[0] == "xla"
