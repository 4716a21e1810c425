"""Target-only, vocabulary-chunked cross-entropy equals a numpy reference, gradients included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rm_jax.train import loss as loss_lib


def _numpy_reference(final_btd, head_dv, ids_bt, mask_bt):
    logits = np.einsum("btd,dv->btv", final_btd.astype(np.float64), head_dv.astype(np.float64))
    total, count = 0.0, 0
    for b in range(ids_bt.shape[0]):
        for t in range(1, ids_bt.shape[1]):
            if mask_bt[b, t]:
                row = logits[b, t - 1]
                lse = np.log(np.exp(row - row.max()).sum()) + row.max()
                total += lse - row[ids_bt[b, t]]
                count += 1
    return total, count


@pytest.mark.parametrize("vocab,chunk", [(97, 16), (64, 64), (50, 128)])
def test_chunked_loss_matches_numpy(vocab, chunk):
    rng = np.random.default_rng(0)
    B, T, D = 3, 20, 8
    final = rng.normal(size=(B, T, D)).astype(np.float32)
    head = rng.normal(size=(D, vocab)).astype(np.float32)
    ids = rng.integers(0, vocab, size=(B, T)).astype(np.int32)
    mask = np.zeros((B, T), np.int32)
    mask[0, 12:18] = 1          # targets at the end of the prompt, various lengths
    mask[1, 5:20] = 1
    # row 2: no target at all (a padding row) contributes nothing
    ref_sum, ref_n = _numpy_reference(final, head, ids, mask)
    cfg = loss_lib.LossConfig(max_target_tokens=16, vocab_chunk=chunk)
    out = jax.jit(lambda f, h: loss_lib.target_cross_entropy(f, h, ids, mask, cfg))(final, head)
    assert int(out.n_tokens) == ref_n == 6 + 15
    np.testing.assert_allclose(float(out.loss_sum), ref_sum, rtol=1e-5)

    # gradients equal those of a dense, unchunked fp32 formulation
    def dense(f, h):
        logits = jnp.einsum("btd,dv->btv", f, h)[:, :-1]
        lp = jax.nn.log_softmax(logits, -1)
        nll = -jnp.take_along_axis(lp, ids[:, 1:, None], -1)[..., 0]
        return jnp.sum(nll * mask[:, 1:])
    g_dense = jax.grad(dense, argnums=(0, 1))(final, head)
    g_chunk = jax.grad(lambda f, h: loss_lib.target_cross_entropy(f, h, ids, mask, cfg).loss_sum,
                       argnums=(0, 1))(final, head)
    for a, b in zip(g_dense, g_chunk):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)


def test_mask_excludes_everything_but_targets():
    rng = np.random.default_rng(1)
    final = rng.normal(size=(1, 10, 4)).astype(np.float32)
    head = rng.normal(size=(4, 11)).astype(np.float32)
    ids = rng.integers(0, 11, size=(1, 10)).astype(np.int32)
    mask = np.zeros((1, 10), np.int32)
    mask[0, 7:] = 1
    cfg = loss_lib.LossConfig(max_target_tokens=4, vocab_chunk=4)
    base = loss_lib.target_cross_entropy(final, head, ids, mask, cfg)
    # changing any non-target token's *label* or any hidden state that predicts no target changes nothing
    ids2, final2 = ids.copy(), final.copy()
    ids2[0, :7] = (ids2[0, :7] + 1) % 11
    final2[0, :6] += 3.0
    final2[0, 9] += 3.0      # the last position predicts nothing
    again = loss_lib.target_cross_entropy(final2, head, ids2, mask, cfg)
    np.testing.assert_allclose(float(again.loss_sum), float(base.loss_sum), rtol=1e-6)
    final3 = final.copy()
    final3[0, 6] += 1.0      # predicts the first target token
    assert abs(float(loss_lib.target_cross_entropy(final3, head, ids, mask, cfg).loss_sum) - float(base.loss_sum)) > 1e-4


def test_target_budget_guard():
    with pytest.raises(ValueError, match="max_target_tokens=4"):
        loss_lib.check_target_budget(np.ones((2, 9)), 4)
    loss_lib.check_target_budget(np.ones((2, 4)), 4)


def test_verdict_weight_is_a_weighted_token_mean():
    """A target mask holding weights (train.verdict_weight) weights each token's NLL and the count."""
    from rm_jax.train.host_batch import weighted_target_mask
    rng = np.random.default_rng(2)
    B, T, D, V = 2, 12, 6, 29
    final = rng.normal(size=(B, T, D)).astype(np.float32)
    head = rng.normal(size=(D, V)).astype(np.float32)
    ids = rng.integers(0, V, size=(B, T)).astype(np.int32)
    mask = np.zeros((B, T), np.uint8)
    mask[0, 6:11] = 1
    batch = {"target_mask": mask, "verdict_pos": np.array([8, 3]), "example_valid": np.array([1, 0])}
    weighted = weighted_target_mask(batch, 5.0)
    assert weighted[0, 8] == 5.0 and weighted[1].sum() == 0      # a padding row stays target-free
    assert weighted_target_mask(batch, 1.0) is mask
    cfg = loss_lib.LossConfig(max_target_tokens=8, vocab_chunk=8)
    out = loss_lib.target_cross_entropy(final, head, ids, weighted, cfg)
    per_token = {}
    for t in range(6, 11):
        one = np.zeros_like(mask)
        one[0, t] = 1
        per_token[t] = float(loss_lib.target_cross_entropy(final, head, ids, one, cfg).loss_sum)
    expect = sum(per_token.values()) + 4.0 * per_token[8]
    np.testing.assert_allclose(float(out.loss_sum), expect, rtol=1e-5)
    assert float(out.n_tokens) == 5 + 4
