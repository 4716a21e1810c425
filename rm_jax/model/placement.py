"""Where model params live on a mesh: one NamedSharding per variable, from its logical names
through the one rules table (``rm_jax.sharding``)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from rm_jax.sharding import logical_to_spec


def _divisible_spec(mesh, shape, names) -> PartitionSpec:
    spec = logical_to_spec(names or (None,) * len(shape))
    fixed = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        # A dim the mesh axes do not divide stays replicated (tiny test shapes, odd head counts).
        fixed.append(entry if size > 1 and dim % size == 0 else None)
    return PartitionSpec(*fixed)


def param_shardings(model_or_state, mesh) -> nnx.State:
    """A NamedSharding per variable, from its logical names through the one rules table."""
    state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
    return jax.tree.map(
        lambda v: v.replace(NamedSharding(mesh, _divisible_spec(mesh, v.shape, v.get_metadata().get("out_sharding")))),
        state, is_leaf=lambda v: isinstance(v, nnx.Variable))
