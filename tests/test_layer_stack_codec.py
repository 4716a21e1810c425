"""train.stack_codec: the bit-packing codec (bf16 stacks scanned as packed f32 words) leaves the
forward and every gradient bit-identical, with and without remat, in a bare stack and in a
Qwen3.5 model built from the config; the 35B config trains with it (the memory plan counts it)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rm_jax.model import layer_stack
from rm_jax.model.config import RuntimeOptions
from rm_jax.model.qwen3_5_moe.config import Qwen35MoeConfig
from rm_jax.model.registry import init_model


class _Layer(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (6, 8)).astype(jnp.bfloat16))   # packed (even last dim)
        self.odd = nnx.Param(jax.random.normal(rngs.params(), (6, 5)).astype(jnp.bfloat16))  # not packable
        self.b = nnx.Param(jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32))

    def __call__(self, x):
        h = x @ self.w[...].astype(jnp.float32)[:, :6] + self.b[...][:6]
        return jnp.tanh(h) + 0.1 * jnp.sum(x @ self.odd[...].astype(jnp.float32), -1, keepdims=True)


def _assert_trees_equal(ref, got):
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert any(np.abs(np.asarray(g, np.float32)).sum() > 0 for g in jax.tree.leaves(got))


@pytest.mark.parametrize("remat", ["none", "full"])
def test_bit_codec_gradients_equal_plain_scan(remat):
    stack = layer_stack.LayerStack(_Layer, 3, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(stack)
    x = jax.random.normal(jax.random.key(1), (4, 6))

    def loss(state, codec):
        out, _ = nnx.merge(graphdef, state).apply(lambda layer, c, _: (layer(c), None), x, remat=remat, codec=codec)
        return jnp.sum(out ** 2)

    ref_loss, ref = jax.jit(jax.value_and_grad(loss), static_argnums=1)(state, "none")
    assert "bitcast_convert_type" in str(jax.make_jaxpr(jax.grad(loss), static_argnums=1)(state, "bf16_bits"))
    got_loss, got = jax.jit(jax.value_and_grad(loss), static_argnums=1)(state, "bf16_bits")
    assert float(got_loss) == float(ref_loss)
    _assert_trees_equal(ref, got)
    with pytest.raises(ValueError, match="train.stack_codec='bits'"):
        loss(state, "bits")


@pytest.mark.slow   # two compiles of a Qwen3.5 gradient: ~20 s idle, 80 s on a busy 2-core host
def test_qwen35_model_with_the_codec_equals_the_plain_path():
    """The path training takes: RuntimeOptions.stack_codec reaches the decoder's scanned blocks
    (two 4-layer blocks, bf16 weights as the step differentiates them)."""
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    text = dict(vocab_size=256, hidden_size=32, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_conv_kernel_dim=4, moe_intermediate_size=12,
                shared_expert_intermediate_size=20, num_experts=5, num_experts_per_tok=2, layer_types=kinds * 2,
                rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                     mrope_section=[2, 1, 1], mrope_interleaved=True))
    hf = {"model_type": "qwen3_5_moe_text", **text}
    ids = jax.random.randint(jax.random.key(0), (2, 24), 0, 256)

    def grads(codec):
        runtime = RuntimeOptions(dtype="bfloat16", param_dtype="bfloat16", moe_backend="dense", attention="xla",
                                 stack_codec=codec)
        model = init_model(Qwen35MoeConfig.from_hf_dict(hf, runtime), seed=3)
        graphdef, state = nnx.split(model)

        def loss(state):
            logits = nnx.merge(graphdef, state)(ids)
            return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])
        return jax.jit(jax.value_and_grad(loss))(state)

    (ref_loss, ref), (got_loss, got) = grads("none"), grads("bf16_bits")
    assert float(got_loss) == float(ref_loss)
    _assert_trees_equal(ref, got)


def test_35b_config_trains_with_the_codec_the_plan_counts():
    from rm_jax.run_config import parse, runtime_options
    run = parse(importlib.import_module("configs.qwen3_5_35b_a3b").get_config())
    assert runtime_options(run).stack_codec == "bf16_bits"
