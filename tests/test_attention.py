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


def test_attention_auto_picks_cudnn_flash_only_when_eligible():
    """train.attention=auto: the CPU kernel on CPU; on a CUDA GPU cuDNN flash for bf16/fp16 with
    a head dim it has kernels for and key lengths, else XLA's attention with the reason (a pure
    function of platform, dtype, head_dim and masking). An explicit choice is kept as is."""
    from rm_jax.model.layers import choose_attention
    assert choose_attention("auto", "cpu", "bfloat16", 128) == ("blocked", "CPU")
    for dtype in ("bfloat16", "float16"):
        for head_dim in (64, 72, 128):          # the 30B text (128) and ViT (72) head dims
            assert choose_attention("auto", "gpu", dtype, head_dim) == ("cudnn", "eligible")
    impl, why = choose_attention("auto", "gpu", "float32", 128)
    assert impl == "xla" and "float32" in why
    for head_dim in (100, 256):
        impl, why = choose_attention("auto", "gpu", "bfloat16", head_dim)
        assert impl == "xla" and f"head_dim {head_dim}" in why
    # Hopper and later have head_dim-256 kernels (Qwen3.5's full attention); an A100 does not.
    assert choose_attention("auto", "gpu", "bfloat16", 256, compute_capability="9.0") == ("cudnn", "eligible")
    impl, why = choose_attention("auto", "gpu", "bfloat16", 256, compute_capability="8.0")
    assert impl == "xla" and "head_dim 256" in why and "8.0" in why
    assert choose_attention("auto", "gpu", "bfloat16", 264, compute_capability="9.0")[0] == "xla"
    impl, why = choose_attention("auto", "gpu", "bfloat16", 128, dense_mask=True)
    assert impl == "xla" and "mask" in why
    assert choose_attention("auto", "tpu", "bfloat16", 128)[0] == "xla"
    for explicit in ("cudnn", "xla", "blocked"):
        assert choose_attention(explicit, "gpu", "float32", 100) == (explicit, "requested")
    with pytest.raises(ValueError, match="train.attention='flash'"):
        choose_attention("flash", "gpu", "bfloat16", 128)


def test_gpu_choices_are_config_keys_validated_by_name(tiny_cfg):
    """moe.ragged_dot and train.attention reach the model's layers; a bad value names its field.
    The 30B config runs what the memory plan measured: cuDNN flash and tokamax."""
    import os
    from launch.common import load_config
    from rm_jax.model import registry
    from rm_jax.run_config import model_config, parse
    cfg = tiny_cfg.copy_and_resolve_references()
    cfg.moe.ragged_dot, cfg.train.attention = "lax", "xla"
    from flax import nnx

    from rm_jax.model.layers import Attention
    from rm_jax.model.moe import SparseMoeBlock
    model = registry.abstract_model(model_config(parse(cfg)))
    nodes = [node for _, node in nnx.iter_graph(model)]
    moes = [n for n in nodes if isinstance(n, SparseMoeBlock)]
    attns = [n for n in nodes if isinstance(n, Attention)]
    assert moes and all(m.cfg.ragged_dot == "lax" for m in moes)
    assert attns and all(a.impl == "xla" for a in attns)
    for field, value in (("moe.ragged_dot", "cublas"), ("train.attention", "flash"), ("moe.backend", "a2a")):
        bad = tiny_cfg.copy_and_resolve_references()
        section, key = field.split(".")
        bad[section][key] = value
        with pytest.raises(ValueError, match=rf"{field}='{value}'"):
            parse(bad)
    big = load_config(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "qwen3_vl_30b_a3b.py"))
    assert (big.train.attention, big.moe.ragged_dot, big.moe.backend, dict(big.mesh)["fsdp"]) == \
        ("cudnn", "tokamax", "ragged", 8)
