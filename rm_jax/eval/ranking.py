"""Ranking metrics of a scalar reward against per-prompt utilities.

Everything is computed *within* a prompt and then macro-averaged over prompts: raw rewards of
different prompts are not comparable (a Bradley–Terry reward is only defined up to a per-prompt
shift), so a pooled correlation would mix prompt offsets with ranking quality.

Tie rule (declared here, before any result): pairs with equal utilities are skipped; a pair whose
rewards are equal counts 0.5. Kendall's tau is variant b (ties corrected), as scipy's default.
A prompt with constant rewards has no defined correlation; it counts 0 (no ranking information).
"""

from __future__ import annotations

import collections
import math

import numpy as np
from scipy import stats

TIE_RULE = "pairs with tied utilities skipped; tied rewards count 0.5"


def _groups(prompt_ids, *arrays):
    by = collections.OrderedDict()
    for i, pid in enumerate(prompt_ids):
        by.setdefault(pid, []).append(i)
    for pid, idx in by.items():
        yield pid, [np.asarray(a, np.float64)[idx] for a in arrays]


def pair_credit(r_i: np.ndarray, r_j: np.ndarray, u_i: np.ndarray, u_j: np.ndarray) -> np.ndarray:
    """1 when the rewards order a pair as the utilities do, 0.5 for tied rewards, 0 otherwise."""
    agree = np.sign(r_i - r_j) * np.sign(u_i - u_j)
    return np.where(r_i == r_j, 0.5, (agree > 0).astype(np.float64))


def _prompt_pairs(r: np.ndarray, u: np.ndarray):
    i, j = np.triu_indices(len(r), 1)
    keep = u[i] != u[j]
    return pair_credit(r[i][keep], r[j][keep], u[i][keep], u[j][keep])


def ranking_metrics(prompt_ids, rewards, utilities) -> dict:
    """``pairwise_accuracy`` over all within-prompt pairs of distinct utility (tie rule above),
    ``kendall_tau_b`` and ``spearman`` per prompt, macro mean over prompts with >= 2 distinct
    utilities; also the prompt-macro pairwise accuracy and the counts."""
    credits, prompt_acc, taus, rhos = [], [], [], []
    for _, (r, u) in _groups(prompt_ids, rewards, utilities):
        ok = np.isfinite(u)
        r, u = r[ok], u[ok]
        if len(np.unique(u)) < 2:
            continue
        c = _prompt_pairs(r, u)
        credits.append(c)
        prompt_acc.append(float(c.mean()))
        if len(np.unique(r)) < 2:
            taus.append(0.0)
            rhos.append(0.0)
            continue
        taus.append(float(stats.kendalltau(r, u, variant="b").statistic))
        rhos.append(float(stats.spearmanr(r, u).statistic))
    allc = np.concatenate(credits) if credits else np.zeros(0)
    nan = float("nan")
    return {"pairwise_accuracy": float(allc.mean()) if len(allc) else nan,
            "pairwise_accuracy_prompt_macro": float(np.mean(prompt_acc)) if prompt_acc else nan,
            "kendall_tau_b": float(np.mean(taus)) if taus else nan,
            "spearman": float(np.mean(rhos)) if rhos else nan,
            "n_prompts": len(taus), "n_pairs": int(len(allc))}


def pairwise_by_slice(slices, r_a, r_b, p) -> dict:
    """Tie-aware accuracy on labelled pairs (p = 0.5 pairs skipped), per slice and macro over slices."""
    slices, r_a, r_b, p = (np.asarray(x) for x in (slices, r_a, r_b, p))
    decided = p != 0.5
    credit = pair_credit(r_a, r_b, p, np.full_like(p, 0.5, dtype=np.float64))
    per = {}
    for s in sorted(set(slices[decided].tolist())):
        sel = decided & (slices == s)
        per[str(s)] = {"accuracy": float(credit[sel].mean()), "n": int(sel.sum())}
    return {"by_slice": per, "macro": float(np.mean([v["accuracy"] for v in per.values()])) if per else math.nan,
            "micro": float(credit[decided].mean()) if decided.any() else math.nan, "n": int(decided.sum()),
            "tie_rule": "label ties (p = 0.5) skipped; equal rewards count 0.5"}


def best_of_n(prompt_ids, rewards, utilities, max_n: int | None = None) -> dict:
    """Expected oracle utility of the reward's pick among N candidates drawn uniformly without
    replacement from a prompt's K, for N = 1..K (exact, not sampled): the candidate ranked j-th
    by reward is picked iff it is drawn and none of the j above it is, with probability
    C(K-1-j, N-1) / C(K, N). Reward ties are broken against the pick (the lower utility first),
    so ties never flatter the curve. Macro mean over prompts with >= N candidates; with the
    oracle's own curve (pick by utility) and the random pick (N = 1) for reference."""
    curves = collections.defaultdict(list)
    oracle = collections.defaultdict(list)
    for _, (r, u) in _groups(prompt_ids, rewards, utilities):
        ok = np.isfinite(u)
        r, u = r[ok], u[ok]
        k = len(r)
        order = np.lexsort((u, -r))         # reward descending, ties: lower utility first
        by_u = np.sort(u)[::-1]
        for n in range(1, (k if max_n is None else min(k, max_n)) + 1):
            w = np.array([math.comb(k - 1 - j, n - 1) for j in range(k)], np.float64) / math.comb(k, n)
            curves[n].append(float(np.sum(w * u[order])))
            oracle[n].append(float(np.sum(w * by_u)))
    ns = sorted(curves)
    return {"n": ns, "reward_pick": [float(np.mean(curves[n])) for n in ns],
            "oracle_pick": [float(np.mean(oracle[n])) for n in ns], "prompts": [len(curves[n]) for n in ns]}


def length_bias(prompt_ids, rewards, lengths, r_a, r_b, len_a, len_b, p, equal_tol: float = 0.05) -> dict:
    """corr(reward, length) (pooled Spearman and within-prompt macro), the length-only baseline's
    pairwise accuracy (longer = better), and the RM's accuracy on equal-length pairs (lengths
    within ``equal_tol``) and on length-conflict pairs (the preferred answer is the shorter)."""
    rewards, lengths = np.asarray(rewards, np.float64), np.asarray(lengths, np.float64)
    within = []
    for _, (r, n) in _groups(prompt_ids, rewards, lengths):
        if len(np.unique(r)) > 1 and len(np.unique(n)) > 1:
            within.append(float(stats.spearmanr(r, n).statistic))
    r_a, r_b, len_a, len_b, p = (np.asarray(x, np.float64) for x in (r_a, r_b, len_a, len_b, p))
    d = p != 0.5
    half = np.full_like(p, 0.5)
    rm_credit = pair_credit(r_a, r_b, p, half)
    len_credit = pair_credit(len_a, len_b, p, half)
    equal = d & (np.abs(len_a - len_b) <= equal_tol * np.maximum(len_a, len_b))
    pref_len = np.where(p > 0.5, len_a, len_b)
    other_len = np.where(p > 0.5, len_b, len_a)
    conflict = d & (pref_len < other_len)
    mean = lambda x, m: float(x[m].mean()) if m.any() else float("nan")
    return {"spearman_reward_length": float(stats.spearmanr(rewards, lengths).statistic) if len(rewards) > 1 else float("nan"),
            "spearman_reward_length_within_prompt": float(np.mean(within)) if within else float("nan"),
            "length_only_accuracy": mean(len_credit, d), "rm_accuracy": mean(rm_credit, d),
            "equal_length_accuracy": mean(rm_credit, equal), "n_equal_length": int(equal.sum()),
            "length_conflict_accuracy": mean(rm_credit, conflict), "n_length_conflict": int(conflict.sum())}
