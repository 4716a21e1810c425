"""Where arrays live on the mesh: parameters, optimizer state and batches, for every job that
puts them there (the judge's train step and evaluation, the scorer, the scalar RM's step).

Design choices:

* **Parameters by their logical names**, through the one rules table (``rm_jax.sharding``); a
  dimension the mesh axes do not divide stays replicated (tiny test shapes, odd head counts).
  Optimizer moments take their parameter's sharding, found by path suffix (a frozen tower leaves
  ``MaskedNode``s where parameters are, which a structural match would reject).
* **Batches by rows.** The token arrays of a batch shard their row dimension over the batch axes;
  image patches are replicated (they are concatenated over a batch, not laid out per row).
  Arrays may carry leading axes before the rows (``lead``: the accumulation axis of a train
  step), and ``positions_3bt`` one more (its 3 MRoPE sections).
* **One placement call for host arrays**, ``place``: ``jax.make_array_from_process_local_data``,
  so the same code places a whole batch in one process and each process's slice with several
  (a plain ``device_put`` of a slice would take it for the global array). A row count the batch
  axes do not divide stays replicated in one process and is an error with several (each process
  holds only its rows).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rm_jax.sharding import logical_to_spec

# -- parameters ---------------------------------------------------------------------------------


def divisible_spec(mesh: Mesh, shape, names) -> PartitionSpec:
    """The logical names' spec, with every dimension the mesh axes do not divide replicated."""
    spec = logical_to_spec(names or (None,) * len(shape))
    fixed = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        fixed.append(entry if size > 1 and dim % size == 0 else None)
    return PartitionSpec(*fixed)


def param_shardings(model_or_state, mesh: Mesh) -> nnx.State:
    """A NamedSharding per variable, from its logical names through the one rules table."""
    state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
    return jax.tree.map(
        lambda v: v.replace(NamedSharding(mesh, divisible_spec(mesh, v.shape, v.get_metadata().get("out_sharding")))),
        state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def place_params(model: nnx.Module, mesh: Mesh) -> None:
    """Every variable of a model (created unsharded) onto the mesh, in place."""
    state = nnx.state(model)
    shardings = param_shardings(state, mesh)
    nnx.update(model, jax.tree.map(lambda v, s: jax.device_put(v, s.get_value() if hasattr(s, "get_value") else s),
                                   state, shardings))


def opt_state_shardings(optimizer, params, mesh: Mesh):
    """Shardings of ``optimizer.init(params)``: Adam's mu/nu take their parameter's sharding;
    scalars (count) are replicated. (``optimizer.init`` under jit alone would replicate mu/nu:
    ``zeros_like`` carries no sharding.)"""
    abstract = jax.eval_shape(optimizer.init, params)
    by_path = {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_leaves_with_path(params)}

    def sharding(path, leaf):
        for i in range(len(path)):
            param = by_path.get(jax.tree_util.keystr(tuple(path[i:])))
            if param is not None and param.shape == leaf.shape:
                return param.sharding
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(sharding, abstract)


# -- batches ------------------------------------------------------------------------------------


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_axes() -> tuple[str, ...]:
    """The mesh axes a batch's rows shard over."""
    axes = logical_to_spec(("batch",))[0]
    return (axes,) if isinstance(axes, str) else tuple(axes)


def rows_sharding(x, row_dim: int, mesh: Mesh, process_count: int | None = None) -> NamedSharding | None:
    """The sharding of a host array (this process's rows) whose dimension ``row_dim`` holds rows;
    None for None."""
    if x is None:
        return None
    axes = logical_to_spec(("batch",))[0]
    n_shards = math.prod(mesh.shape[a] for a in batch_axes())
    n_proc = jax.process_count() if process_count is None else process_count
    global_rows = np.shape(x)[row_dim] * n_proc
    ok = global_rows % n_shards == 0
    if not ok and n_proc > 1:
        raise ValueError(f"global microbatch {global_rows} ({n_proc} processes x {np.shape(x)[row_dim]}) is not "
                         f"divisible by the mesh's batch axes {axes} = {n_shards} devices")
    dims = [None] * np.ndim(x)
    if ok:
        dims[row_dim] = axes
    return NamedSharding(mesh, PartitionSpec(*dims))


def inputs_shardings(inputs, mesh: Mesh, lead: int = 0, process_count: int | None = None):
    """Shardings of a ``JudgeInputs`` (host arrays, this process's rows) with ``lead`` axes
    before the rows: token arrays by rows, vision arrays replicated."""
    rows = lambda x, extra=0: rows_sharding(x, lead + extra, mesh, process_count)
    return inputs.replace(
        input_ids_bt=rows(inputs.input_ids_bt), attention_mask_bt=rows(inputs.attention_mask_bt),
        positions_3bt=rows(inputs.positions_3bt, 1), image_index_bt=rows(inputs.image_index_bt),
        kv_lengths_b=rows(inputs.kv_lengths_b),
        vision=None if inputs.vision is None else jax.tree.map(lambda _: replicated(mesh), inputs.vision))


def place(x, sharding: NamedSharding) -> jax.Array:
    """One host array onto the mesh: this process's slice of a row-sharded array, or the whole of
    a replicated one."""
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))


def place_tree(tree, shardings):
    """A tree of host arrays onto the mesh, leaf by leaf (``shardings``: the same tree)."""
    return jax.tree.map(place, tree, shardings)


def place_inputs(inputs, mesh: Mesh, lead: int = 0):
    """A ``JudgeInputs`` of host arrays onto the mesh (rows sharded, images replicated)."""
    return place_tree(inputs, inputs_shardings(inputs, mesh, lead))
