"""The BT pair loss and its gradients against a numpy reference; host weights and accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rm_jax.rm.loss import PairLossConfig, effective_weights, weighted_pair_loss


def np_softplus(x):
    return np.logaddexp(0.0, x)


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def reference(r_a, r_b, p, m, w, group, center, group_normalize):
    """Loss and d/dr_a, d/dr_b written out by hand."""
    d = r_a - r_b
    hard = (p == 0) | (p == 1)
    m = np.where(hard, m, 0.0)
    bt = p * np_softplus(-(d - m)) + (1 - p) * np_softplus(d + m)
    dbt = -p * np_sigmoid(-(d - m)) + (1 - p) * np_sigmoid(d + m)      # d bt / d delta
    c = center * ((r_a + r_b) / 2) ** 2
    dc = center * (r_a + r_b) / 2                                       # d c / d r_a (= d r_b)
    if group_normalize:
        groups = np.unique(group)
        eff = np.zeros_like(w)
        for g in groups:
            eff[group == g] = w[group == g] / w[group == g].sum() / len(groups)
        # the same as: mean over prompts of the weighted mean within each prompt
        loss = np.mean([np.sum(w[group == g] * (bt + c)[group == g]) / w[group == g].sum() for g in groups])
    else:
        eff = w / w.sum()
        loss = np.sum(w * (bt + c)) / w.sum()
    return loss, eff * (dbt + dc), eff * (-dbt + dc)


CASES = {
    "hard": dict(p=[1, 0, 1, 0, 1, 1], m=0),
    "soft": dict(p=[0.7, 0.2, 0.9, 0.4, 0.65, 0.3], m=0),
    "tie": dict(p=[0.5] * 6, m=0),
    "margin": dict(p=[1, 0, 1, 0.5, 0.8, 1], m=[0.5, 1.0, 0.0, 2.0, 3.0, 0.25]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("group_normalize,center,weighted", [(False, 0.0, False), (True, 0.3, True)])
def test_loss_and_grads_match_numpy(case, group_normalize, center, weighted):
    rng = np.random.default_rng(0)
    n = 6
    r_a, r_b = rng.normal(size=n) * 2, rng.normal(size=n) * 2
    p = np.asarray(CASES[case]["p"], np.float64)
    m = np.broadcast_to(np.asarray(CASES[case]["m"], np.float64), (n,)).copy()
    w = rng.uniform(0.2, 3.0, n) if weighted else np.ones(n)
    group = np.array([0, 0, 0, 1, 2, 2])     # a 3-pair prompt, a 1-pair prompt, a 2-pair prompt
    eff = effective_weights(w, group, np.ones(n, bool), group_normalize)
    cfg = PairLossConfig(group_normalize, center)

    def f(ra, rb):
        return weighted_pair_loss(ra, rb, jnp.asarray(p, jnp.float32), jnp.asarray(m, jnp.float32), eff, cfg)[0]

    loss, (g_a, g_b) = jax.value_and_grad(f, argnums=(0, 1))(jnp.asarray(r_a, jnp.float32), jnp.asarray(r_b, jnp.float32))
    ref_loss, ref_ga, ref_gb = reference(r_a, r_b, p, m, w, group, center, group_normalize)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g_a), ref_ga, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g_b), ref_gb, rtol=1e-4, atol=1e-6)


def test_hard_label_is_softplus_of_oriented_margin():
    # p = 0 is the same pair with a and b swapped
    ra, rb, m = jnp.float32(0.3), jnp.float32(1.1), jnp.float32(0.4)
    from rm_jax.rm.loss import pair_losses
    np.testing.assert_allclose(float(pair_losses(ra, rb, 0.0, m)), np_softplus(-((1.1 - 0.3) - 0.4)), rtol=1e-6)
    np.testing.assert_allclose(float(pair_losses(rb, ra, 1.0, m)), float(pair_losses(ra, rb, 0.0, m)), rtol=1e-6)


def test_fp32_stable_at_large_margins():
    from rm_jax.rm.loss import pair_losses
    out = pair_losses(jnp.asarray([80.0, -80.0], jnp.bfloat16), jnp.asarray([-80.0, 80.0], jnp.bfloat16),
                      jnp.asarray([1.0, 1.0]), jnp.zeros(2))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), [0.0, 160.0], atol=1e-5)


def test_accumulation_split_equals_whole():
    """Weights normalised over the whole step: the sum of microbatch objectives is the step's loss."""
    rng = np.random.default_rng(1)
    n = 8
    r_a, r_b = rng.normal(size=n), rng.normal(size=n)
    p = np.array([1, 0, 0.5, 0.8, 1, 1, 0, 0.5])
    w = rng.uniform(0.5, 2, n)
    group = np.array([0, 0, 1, 1, 1, 2, 3, 3])
    valid = np.ones(n, bool)
    cfg = PairLossConfig(True, 0.1)
    eff = effective_weights(w, group, valid, True)
    whole = weighted_pair_loss(r_a, r_b, p, np.zeros(n), eff, cfg)[0]
    parts = sum(weighted_pair_loss(r_a[s], r_b[s], p[s], np.zeros(4), eff[s], cfg)[0]
                for s in (slice(0, 4), slice(4, 8)))
    np.testing.assert_allclose(float(whole), float(parts), rtol=1e-6)
    ref = reference(r_a, r_b, p, np.zeros(n), w, group, 0.1, True)[0]
    np.testing.assert_allclose(float(whole), ref, rtol=1e-5)
    # padding pairs get weight 0 and change nothing
    eff_pad = effective_weights(np.r_[w, 1.0], np.r_[group, -1], np.r_[valid, False], True)
    np.testing.assert_allclose(eff_pad[:n], eff, rtol=1e-6)
    assert eff_pad[n] == 0
