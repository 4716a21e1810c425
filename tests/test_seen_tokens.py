"""Seen-token labels (rm_jax.data.seen_tokens) against a plain-Python reference, and mimetic
initialization (rm_jax.model.mimetic_init)."""

import jax
import numpy as np
import pytest
from flax import nnx

from rm_jax.data.seen_tokens import SEEN, UNSEEN, seen_targets
from rm_jax.data.value_swap import VALUE_OFF


def _batch(rows, starts, ends, verdict_pos, t=16):
    ids = np.zeros((len(rows), t), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    n = len(rows)
    return {"input_ids": ids, "example_valid": np.ones(n, bool), "response_start": np.asarray(starts),
            "response_end": np.asarray(ends), "verdict_pos": np.asarray(verdict_pos)}


def _reference(row, lo, hi, stop, only, cumulative):
    out = {}
    new = [tok in only and tok not in row[:lo] for tok in row[lo:hi]]
    if not cumulative:
        for j, tok in enumerate(row[lo:hi]):
            if tok in only:
                out[lo + j] = UNSEEN if new[j] else SEEN
        return out
    seen_new = False
    for t in range(lo, stop):
        if t < hi:
            seen_new = seen_new or new[t - lo]
        out[t] = UNSEEN if seen_new else SEEN
        if t < hi and row[t] in only:       # a labelled token keeps its own label
            out[t] = UNSEEN if new[t - lo] else SEEN
    return out


@pytest.mark.parametrize("cumulative", [False, True])
def test_labels_equal_a_plain_reference(cumulative):
    rng = np.random.default_rng(0)
    rows, starts, ends, vps = [], [], [], []
    for _ in range(12):
        lo = int(rng.integers(3, 7))
        hi = lo + int(rng.integers(1, 5))
        vp = hi + int(rng.integers(2, 4))
        rows.append(rng.integers(10, 18, size=vp + 2).tolist())
        starts.append(lo), ends.append(hi), vps.append(vp)
    b = _batch(rows, starts, ends, vps)
    only = np.arange(10, 15)
    got = seen_targets(b, 64, only_ids=only, cumulative=cumulative)
    for i, row in enumerate(rows):
        want = _reference(row, starts[i], ends[i], vps[i] - 1, set(only.tolist()), cumulative)
        labelled = {int(t): int(got[i, t]) for t in np.flatnonzero(got[i] != VALUE_OFF)}
        assert labelled == want, i
    assert (got == UNSEEN).any() and (got == SEEN).any()


def test_budget_invalid_rows_and_skipped_ids():
    b = _batch([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8]], [2, 2], [6, 6], [8, 8])
    b["example_valid"][1] = False
    got = seen_targets(b, 2, skip_ids=np.array([3]))
    assert (got[1] == VALUE_OFF).all()
    assert np.flatnonzero(got[0] != VALUE_OFF).tolist() == [3, 4]      # token 3 skipped; 2 at most
    cum = seen_targets(b, 3, cumulative=True)
    assert np.flatnonzero(cum[0] != VALUE_OFF).tolist() == [4, 5, 6]  # the 3 nearest the slot (7 excluded)


def test_mimetic_init_ties_queries_to_keys():
    """Every decoder query head starts equal to its kv head, the decoder's q/k norms scaled by the
    gain; nothing else (the vision tower included) changes."""
    from configs import tiny
    from rm_jax.model import mimetic_init, registry
    from rm_jax.run_config import model_config, parse
    mcfg = model_config(parse(tiny.get_config()))
    plain, mimetic = registry.init_model(mcfg, 0), registry.init_model(mcfg, 0)
    assert mimetic_init.apply(mimetic, 1.5) > 0
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(nnx.state(mimetic))[0]}
    base = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(nnx.state(plain))[0]}
    tied = [k for k in flat if "decoder" in k and "wq_dnh" in k]
    assert tied
    for k in tied:
        q, kv = np.asarray(flat[k]), np.asarray(flat[k.replace("wq_dnh", "wk_dkh")])
        group = q.shape[-2] // kv.shape[-2]
        for n in range(q.shape[-2]):
            np.testing.assert_array_equal(q[..., n, :], kv[..., n // group, :])
    for k, v in flat.items():
        if k in tied:
            continue
        scale = 1.5 if "decoder" in k and ("q_norm" in k or "k_norm" in k) else 1.0
        np.testing.assert_allclose(np.asarray(v), scale * np.asarray(base[k]), rtol=0, atol=0)
