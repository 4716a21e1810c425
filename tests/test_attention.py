"""Attention implementations agree: the CPU kernel (query-blocked causal text attention, key-length
vision attention; rm_jax.model.attention_cpu) equals jax.nn.dot_product_attention, gradients included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rm_jax.model.layers import AttentionMask, causal_attention, causal_padding_mask, key_length_attention


def _qkv(b, t, n, k, h, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, t, n, h), (b, t, k, h), (b, t, k, h)))


# one block, a ragged last block (slow: ~17 s; `make test-slow`), whole blocks
@pytest.mark.parametrize("t", [100, pytest.param(300, marks=pytest.mark.slow), 384])
def test_blocked_equals_dense_with_key_lengths(t):
    q, k, v = _qkv(3, t, 4, 2, 8)
    lengths = jnp.asarray([t, 1, t - 77], jnp.int32)
    mask = AttentionMask(kv_lengths_b=lengths)
    dense = causal_attention(q, k, v, mask, 0.3, "xla")
    blocked = causal_attention(q, k, v, mask, 0.3, "blocked")
    np.testing.assert_allclose(blocked, dense, atol=2e-6)
    # Gradients too: the trainer differentiates through it.
    loss = lambda impl: jax.grad(lambda q, k, v: jnp.sum(causal_attention(q, k, v, mask, 0.3, impl) ** 2),
                                 argnums=(0, 1, 2))(q, k, v)
    for g_blocked, g_dense in zip(loss("blocked"), loss("xla")):
        np.testing.assert_allclose(g_blocked, g_dense, rtol=2e-5, atol=2e-5)


def test_blocked_equals_dense_with_left_padding_mask():
    t = 260
    q, k, v = _qkv(2, t, 2, 1, 8, seed=1)
    pad_bt = np.ones((2, t), np.int32)
    pad_bt[1, :40] = 0                              # left padding: not a prefix, so an explicit mask
    mask = AttentionMask(mask_b1ts=causal_padding_mask(jnp.asarray(pad_bt)))
    dense = causal_attention(q, k, v, mask, 0.25, "xla")
    blocked = causal_attention(q, k, v, mask, 0.25, "blocked")
    np.testing.assert_allclose(np.asarray(blocked)[:, 40:], np.asarray(dense)[:, 40:], atol=2e-6)
    np.testing.assert_allclose(np.asarray(blocked)[0], np.asarray(dense)[0], atol=2e-6)


def test_key_length_attention_equals_dense():
    """The vision tower's frame slots: non-causal, keys [0, len) per slot, GQA-free (K = N)."""
    q, k, v = _qkv(4, 64, 2, 2, 8, seed=2)
    lengths = jnp.asarray([64, 1, 37, 5], jnp.int32)
    dense = key_length_attention(q, k, v, lengths, 0.35, "xla")
    kernel = key_length_attention(q, k, v, lengths, 0.35, "blocked")
    np.testing.assert_allclose(kernel, dense, atol=2e-6)
    grads = lambda impl: jax.grad(lambda q, k, v: jnp.sum(jnp.sin(key_length_attention(q, k, v, lengths, 0.35, impl))),
                                  argnums=(0, 1, 2))(q, k, v)
    for g_kernel, g_dense in zip(grads("blocked"), grads("xla")):
        np.testing.assert_allclose(g_kernel, g_dense, rtol=2e-5, atol=2e-5)


def test_unknown_implementation_is_refused():
    q, k, v = _qkv(1, 8, 2, 1, 4)
    with pytest.raises(ValueError, match="attention='flash'"):
        causal_attention(q, k, v, AttentionMask(kv_lengths_b=jnp.asarray([8])), 1.0, "flash")
    with pytest.raises(ValueError, match="attention='flash'"):
        key_length_attention(q, k[..., :1, :].repeat(2, 2), v[..., :1, :].repeat(2, 2), jnp.asarray([8]), 1.0, "flash")


def test_vision_frame_slots_round_trip_and_capacity():
    """Frames laid back to back -> [F, P] slots and back; padding images keep a slot; a frame
    over the static capacity is refused with the budget named."""
    from rm_jax.model.vision import frame_slots
    lens = np.array([12, 0, 20, 4])                 # a padding image (0) between real ones
    n_rows = 40                                     # 36 real rows + 4 padding rows
    rows_fp, len_f, slot_n = frame_slots(lens, n_rows, capacity=32)
    assert rows_fp.shape == (4, 32) and len_f.tolist() == [12, 1, 20, 4]
    flat = np.arange(n_rows)
    gathered = flat[rows_fp].reshape(-1)
    np.testing.assert_array_equal(gathered[slot_n[:36]], flat[:36])      # back to the flat order
    assert rows_fp[2, :20].tolist() == list(range(12, 32)) and rows_fp[3, :4].tolist() == [32, 33, 34, 35]
    assert frame_slots(lens, n_rows, capacity=None)[0].shape == (4, 64)   # power-of-two bucket
    with pytest.raises(ValueError, match="frame capacity 16"):
        frame_slots(lens, n_rows, capacity=16)
