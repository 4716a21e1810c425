"""layer_stack.STACK_CODEC: the memory plan's bit-packing codec (bf16 stacks scanned as packed
f32 words) leaves the forward and every gradient bit-identical, with and without remat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rm_jax.model import layer_stack


class _Layer(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (6, 8)).astype(jnp.bfloat16))   # packed (even last dim)
        self.odd = nnx.Param(jax.random.normal(rngs.params(), (6, 5)).astype(jnp.bfloat16))  # not packable
        self.b = nnx.Param(jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32))

    def __call__(self, x):
        h = x @ self.w[...].astype(jnp.float32)[:, :6] + self.b[...][:6]
        return jnp.tanh(h) + 0.1 * jnp.sum(x @ self.odd[...].astype(jnp.float32), -1, keepdims=True)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_bit_codec_gradients_equal_plain_scan(remat, monkeypatch):
    stack = layer_stack.LayerStack(_Layer, 3, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(stack)
    x = jax.random.normal(jax.random.key(1), (4, 6))

    def loss(state):
        out, _ = nnx.merge(graphdef, state).apply(lambda layer, c, _: (layer(c), None), x, remat=remat)
        return jnp.sum(out ** 2)

    ref_loss, ref = jax.jit(jax.value_and_grad(loss))(state)
    monkeypatch.setattr(layer_stack, "STACK_CODEC", layer_stack.bf16_bit_codec())
    assert "bitcast_convert_type" in str(jax.make_jaxpr(jax.grad(loss))(state))
    got_loss, got = jax.jit(jax.value_and_grad(loss))(state)
    assert float(got_loss) == float(ref_loss)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert any(np.abs(np.asarray(g, np.float32)).sum() > 0 for g in jax.tree.leaves(got))
