"""One microbatch through a StepBuilder's objective beside the model's own logits, for the tests
that check a loss term against a reference computed from those logits.

    objective, sums, logits_btv = objective_and_logits(builder, model, mesh, one, n_total)
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from rm_jax.train.step import LossSums, StepBatch, StepBuilder


def objective_and_logits(builder: StepBuilder, model, mesh, one: StepBatch, n_total) -> tuple[float, LossSums,
                                                                                               np.ndarray]:
    """``builder.micro_loss`` of ``one`` (a microbatch, no [A] axis) as the only microbatch of a step
    of ``n_total`` target tokens, its loss sums, and the full forward's logits in fp64 for the reference."""
    params = nnx.state(model, nnx.Param)      # what the builder split off the model
    with jax.set_mesh(mesh):
        objective, sums = jax.jit(builder.micro_loss)(params, builder.rest, one, n_total, 1)
        logits = jax.jit(lambda p, r, x: nnx.merge(builder.graphdef, p, r).forward_arrays(x).logits_btv)(
            params, builder.rest, one.inputs)
    return float(objective), jax.device_get(sums), np.asarray(logits, np.float64)
