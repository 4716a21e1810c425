"""Mimetic initialization of the text decoder's attention (Trockman & Kolter, 2023).

A randomly initialized head attends almost uniformly, so a head that should match a token with the
same token earlier in the context (the primitive under every comparison a judge makes: is this
call value the one the request stated?) gets a gradient diluted by the context length, and a small
model on a small data set forms it late or never (docs/experiments/, issue 16). Mimetic initialization
starts W_Q W_K^T near the identity, as trained attention layers are: each query head's projection
starts equal to its key head's, so at step 0 a token already attends to earlier copies of itself
(through the rotary frequencies slow enough to survive the distance). ``gain`` scales the q/k
norms' weights, sharpening that initial preference (a logit gain of ``gain**2``).

It changes initial values only: shapes, the architecture and the HF export are unchanged, and a
model loaded from a checkpoint (``train.init_from``) is never touched.
"""

from __future__ import annotations

import jax
from flax import nnx


def _path_str(path) -> str:
    return "/".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path)


def apply(model: nnx.Module, gain: float = 1.0) -> int:
    """Sets every decoder attention layer's query projections to its key projections (grouped
    query heads share their kv head's) and scales the q/k norm weights by ``gain``. Returns the
    number of attention blocks changed (the vision tower is left as it is)."""
    state = nnx.state(model)
    flat = {_path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(state)[0]}
    changed = 0
    updates = {}
    for name, wq in flat.items():
        if not name.startswith("decoder/") or "/attn/wq_dnh" not in name:
            continue
        prefix = name.split("/attn/")[0] + "/attn/"
        wk = flat[prefix + "wk_dkh/value"]
        n_heads, n_kv = wq.shape[-2], wk.shape[-2]
        updates[name] = wk.repeat(n_heads // n_kv, axis=-2).astype(wq.dtype)
        for norm in ("q_norm", "k_norm"):
            key = prefix + f"{norm}/weight/value"
            updates[key] = flat[key] * gain
        changed += 1
    if not changed:
        raise ValueError("mimetic init: the model has no decoder attention weights (wq_dnh / wk_dkh)")
    leaves = [updates.get(name, v) for name, v in flat.items()]
    treedef = jax.tree_util.tree_structure(state)
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, leaves))
    return changed
