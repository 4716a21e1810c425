"""Decode state per layer kind, through the architecture-free decoder (rm_jax.model.decode), on a
tiny attention + Gated DeltaNet judge (tests/hybrid_judge.py), fp32.

* Cached decoding (a KV cache for the attention layer, conv + delta-rule state for the GDN layers,
  the recurrent form for each step) equals a full re-forward (the chunked form) at every step.
* Shared-prefix continuation: the state after prefix + a right-padded suffix equals the state of
  a prefill over the whole prompt (right padding leaves the recurrent state unchanged), and so do
  the P(pass)-path slot logits.
"""

import jax
import numpy as np
import pytest

from hybrid_judge import HybridConfig, HybridJudge
from rm_jax.model import decode_state
from rm_jax.model.decode import Decoder
from rm_jax.model.inputs import prepare_inputs
from rm_jax.model.interface import JudgeModel
from rm_jax.model.layer_stack import LayerSpec

GDN, ATTN = LayerSpec("gated_deltanet", "dense"), LayerSpec("attention", "dense")
STEPS = 4


def _batch(cfg, rows, width):
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    return prepare_inputs(cfg, ids, mask, attention="lengths")


@pytest.fixture(scope="module")
def setup():
    from flax import nnx
    cfg = HybridConfig(specs=(GDN, GDN, ATTN, GDN))
    model = HybridJudge(cfg, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    return model, cfg, Decoder(model), rng


def test_groups_and_state_kinds(setup):
    model, cfg, dec, _ = setup
    assert isinstance(model, JudgeModel)
    assert [(g.start, g.end, g.spec.mixer) for g in model.layer_groups] == [
        (0, 2, "gated_deltanet"), (2, 3, "attention"), (3, 4, "gated_deltanet")]
    inputs = _batch(cfg, [[5, 6, 7]], 4)
    _, state = dec.prefill(inputs, 8)
    g = cfg.gdn
    assert state.kv.k_lbskh.shape == (1, 1, 8, cfg.kv_heads, cfg.head_dim)          # the attention layer
    assert state.recurrent.recurrent_bhkv.shape == (3, 1, g.num_value_heads, g.key_head_dim, g.value_head_dim)
    assert state.recurrent.recurrent_bhkv.dtype == np.float32
    assert state.recurrent.conv_bwc.shape == (3, 1, g.conv_kernel - 1, g.conv_dim)


def test_cached_steps_equal_full_forward(setup):
    model, cfg, dec, rng = setup
    lengths = (11, 6, 16)        # bucket 16: two GDN chunks of 8
    rows = [list(rng.integers(3, cfg.vocab_size, n)) for n in lengths]
    logits_bv, state = dec.prefill(_batch(cfg, rows, 16), 16 + STEPS)
    for step in range(STEPS + 1):
        # The reference: one jitted full forward over the right-padded rows (one shape, one compile).
        full = _batch(cfg, rows, 16 + STEPS)
        ref_btv = model.forward(full.input_ids_bt, full.attention_mask_bt).logits_btv
        last_b = np.asarray([len(r) - 1 for r in rows])
        np.testing.assert_allclose(np.asarray(logits_bv), np.asarray(ref_btv)[np.arange(3), last_b], atol=5e-5,
                                   rtol=1e-5, err_msg=f"step {step}")
        if step == STEPS:
            break
        tok_b = np.asarray(jax.numpy.argmax(logits_bv, -1), np.int32)
        rows = [row + [int(t)] for row, t in zip(rows, tok_b)]
        logits_bv, state = dec.step(state, tok_b)
    np.testing.assert_array_equal(np.asarray(state.length_b), np.asarray(lengths) + STEPS)


@pytest.mark.slow      # 54-63 s measured on the shared 2-core box: four compiles + an eager extend
def test_shared_prefix_equals_whole_prompt(setup):
    model, cfg, dec, rng = setup
    prefixes = [list(rng.integers(3, cfg.vocab_size, n)) for n in (9, 13)]
    rows_b = np.array([0, 0, 1, 1], np.int32)
    n_b = np.array([3, 7, 5, 1], np.int32)
    suffixes = [list(rng.integers(3, cfg.vocab_size, n)) for n in n_b]
    tokens_bn = np.zeros((4, 7), np.int32)
    for b, s in enumerate(suffixes):
        tokens_bn[b, :len(s)] = s
    tokens_bn[0, 3:] = 11          # nonzero right padding: it must not reach the recurrent state
    cache_len = 13 + 7 + STEPS
    _, prefix_state = dec.prefill(_batch(cfg, prefixes, 13), cache_len)
    whole = [prefixes[r] + s for r, s in zip(rows_b, suffixes)]
    whole_inputs = _batch(cfg, whole, 20)
    whole_logits_bv, whole_state = dec.prefill(whole_inputs, cache_len)

    # The state after prefix + suffix == the state of one prefill over the whole prompt.
    st = decode_state.take_rows(prefix_state, rows_b)
    valid_bn = np.arange(7)[None, :] < n_b[:, None]
    _, new = model.decode_tokens(st, tokens_bn, valid_bn)
    st = decode_state.write_many(st, new, n_b)
    np.testing.assert_array_equal(np.asarray(st.length_b), np.asarray(whole_state.length_b))
    np.testing.assert_array_equal(np.asarray(st.next_pos_b), np.asarray(whole_state.next_pos_b))
    # (fp32 rounding differs: the chunks fall at other positions; a leaked pad would be O(1).)
    for name in ("conv_bwc", "recurrent_bhkv"):
        np.testing.assert_allclose(np.asarray(getattr(st.recurrent, name)),
                                   np.asarray(getattr(whole_state.recurrent, name)), atol=1e-4, rtol=1e-4,
                                   err_msg=name)
    for b, n in enumerate(whole_state.length_b.tolist()):
        np.testing.assert_allclose(np.asarray(st.kv.k_lbskh[:, b, :n]), np.asarray(whole_state.kv.k_lbskh[:, b, :n]),
                                   atol=1e-4, rtol=1e-4)

    # The P(pass) path (shared prefix, continued in one jitted call) agrees with whole-prompt scoring.
    shared = dec.extend_slot_logits(prefix_state, rows_b, tokens_bn, n_b, 7, 8)
    whole_logits_bv = np.asarray(whole_logits_bv, np.float64)     # the last prompt position's logits
    ref = (whole_logits_bv[:, 7], whole_logits_bv[:, 8], np.log(np.exp(whole_logits_bv).sum(-1)))
    for got, want in zip(shared, ref):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
