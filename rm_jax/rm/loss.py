"""The Bradley–Terry pair loss, in fp32.

For a pair (a, b) with label p = P(a preferred to b), Δ = r_a − r_b:

* hard labels (p ∈ {0, 1}): softplus(−(Δ' − m)), Δ' the difference oriented to the preferred
  side, m the pair's margin (the same expression as p·softplus(−(Δ − m)) + (1−p)·softplus(Δ + m));
* soft labels and ties: the BCE of σ(Δ) against p, p·softplus(−Δ) + (1−p)·softplus(Δ) (margins
  do not apply: a tie has no preferred side);
* optional centering: coef · ((r_a + r_b)/2)², which picks the reward's zero (BT is shift-invariant).

Weighting is done on the host, over the whole optimizer step (all microbatches), so gradient
accumulation is exact: ``effective_weights`` gives each pair w_i / W_g / G when group-normalised
(W_g the weight sum of its prompt, G the number of prompts in the step: a prompt with 36 pairs
counts as much as one with 1) or w_i / Σw otherwise; the step then *sums* weight × loss over its
microbatches, i.e. divides by the total weight once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class PairLossConfig:
    group_normalize: bool = True
    center_coef: float = 0.0


def effective_weights(weight_p: np.ndarray, group_p: np.ndarray, valid_p: np.ndarray,
                      group_normalize: bool) -> np.ndarray:
    """Host-side per-pair weights over a whole step; they sum to 1 over valid pairs."""
    valid_p = np.asarray(valid_p, bool)
    w = np.where(valid_p, weight_p, 0.0).astype(np.float64)
    if w.sum() <= 0:
        return np.zeros_like(w, np.float32)
    if not group_normalize:
        return (w / w.sum()).astype(np.float32)
    groups = np.unique(group_p[valid_p])
    out = np.zeros_like(w)
    for g in groups:
        sel = valid_p & (group_p == g)
        out[sel] = w[sel] / w[sel].sum() / len(groups)
    return out.astype(np.float32)


def pair_losses(r_a: jax.Array, r_b: jax.Array, p: jax.Array, margin: jax.Array) -> jax.Array:
    """Per-pair BT loss [P] (fp32)."""
    r_a, r_b, p, margin = (jnp.asarray(x, jnp.float32) for x in (r_a, r_b, p, margin))
    hard = (p == 0.0) | (p == 1.0)
    m = jnp.where(hard, margin, 0.0)
    delta = r_a - r_b
    return p * jax.nn.softplus(-(delta - m)) + (1.0 - p) * jax.nn.softplus(delta + m)


def weighted_pair_loss(r_a, r_b, p, margin, eff_w, cfg: PairLossConfig) -> tuple[jax.Array, dict]:
    """Σ eff_w · (BT loss + centering) and the sums the step logs (all weighted by eff_w)."""
    eff_w = jnp.asarray(eff_w, jnp.float32)
    r_a, r_b = jnp.asarray(r_a, jnp.float32), jnp.asarray(r_b, jnp.float32)
    bt = pair_losses(r_a, r_b, p, margin)
    center = cfg.center_coef * jnp.square(0.5 * (r_a + r_b))
    objective = jnp.sum(eff_w * (bt + center))
    # Logged statistics over decided (non-tie) pairs, oriented to the preferred side.
    decided = (p != 0.5) & (eff_w > 0)
    oriented = jnp.where(p > 0.5, r_a - r_b, r_b - r_a)
    r_ch, r_rj = jnp.where(p > 0.5, r_a, r_b), jnp.where(p > 0.5, r_b, r_a)
    correct = jnp.where(oriented > 0, 1.0, jnp.where(oriented == 0, 0.5, 0.0))
    d = decided.astype(jnp.float32)
    sums = {"pair_loss_sum": jnp.sum(eff_w * bt), "center_sum": jnp.sum(eff_w * center),
            "n_decided": jnp.sum(d), "correct": jnp.sum(d * correct), "margin_sum": jnp.sum(d * oriented),
            "chosen_sum": jnp.sum(d * r_ch), "rejected_sum": jnp.sum(d * r_rj),
            "n_pairs": jnp.sum((eff_w > 0).astype(jnp.float32))}
    return objective, sums
