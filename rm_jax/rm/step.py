"""The RM train step, in the pattern of rm_jax.train.step: ``nnx.split`` once, one pure step
jitted with explicit in/out shardings and donated state, ``jax.value_and_grad`` over the params,
gradient accumulation as a ``lax.scan`` over microbatches.

Accumulation is exact: the per-pair weights of a step are normalised on the host over all of its
microbatches (rm_jax.rm.loss.effective_weights), and each microbatch contributes Σ w·loss, so the
summed gradient is the gradient of the whole step's loss. The MoE load-balancing loss enters with
``lb_coef`` (its mean over microbatches).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rm_jax.model import placement
from rm_jax.rm.data import RMBatch
from rm_jax.rm.head import RewardModel
from rm_jax.rm.loss import PairLossConfig, weighted_pair_loss


@flax.struct.dataclass
class RMState:
    step: jax.Array
    params: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class RMStepConfig:
    loss: PairLossConfig = PairLossConfig()
    lb_coef: float = 0.0


class RMStepBuilder:
    def __init__(self, model: RewardModel, optimizer: optax.GradientTransformation, cfg: RMStepConfig, mesh):
        self.graphdef, self._params, self.rest = nnx.split(model, nnx.Param, ...)
        self.optimizer, self.cfg, self.mesh = optimizer, cfg, mesh
        self.trace_count = 0
        self._train = self._score = None

    def init_state(self) -> RMState:
        opt_sh = placement.opt_state_shardings(self.optimizer, self._params, self.mesh)
        with jax.set_mesh(self.mesh):
            opt_state = jax.jit(self.optimizer.init, out_shardings=opt_sh)(self._params)
            step = jax.device_put(jnp.zeros((), jnp.int32), placement.replicated(self.mesh))
        return RMState(step=step, params=self._params, opt_state=opt_state)

    # -- pure functions ---------------------------------------------------------------------

    def _micro(self, params, rest, mb, n_micro):
        model = nnx.merge(self.graphdef, params, rest)
        r_c, lb = model.rewards_and_aux(mb.inputs, mb.response_mask)
        r_a, r_b = jnp.take(r_c, mb.pair_a), jnp.take(r_c, mb.pair_b)
        obj, sums = weighted_pair_loss(r_a, r_b, mb.pair_p, mb.pair_m, mb.pair_w, self.cfg.loss)
        sums["lb_loss"] = lb / n_micro
        return obj + self.cfg.lb_coef * lb / n_micro, sums

    def _train_step(self, state: RMState, rest, batch: RMBatch):
        self.trace_count += 1
        n_micro = batch.pair_w.shape[0]
        grad_fn = jax.value_and_grad(self._micro, has_aux=True)
        take = lambda i: jax.tree.map(lambda x: x[i], batch)
        if n_micro == 1:
            (_, sums), grads = grad_fn(state.params, rest, take(0), 1)
        else:
            zeros_g = jax.tree.map(jnp.zeros_like, state.params)
            (_, sums0), _ = jax.eval_shape(grad_fn, state.params, rest, take(0), n_micro)
            zeros_s = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums0)

            def body(carry, mb):
                g_acc, s_acc = carry
                (_, s), g = grad_fn(state.params, rest, mb, n_micro)
                return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, s_acc, s)), None

            (grads, sums), _ = jax.lax.scan(body, (zeros_g, zeros_s), batch)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = step_metrics(sums)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return RMState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    def _score_step(self, params, rest, inputs, response_mask_bt):
        model = nnx.merge(self.graphdef, params, rest)
        return model.rewards(inputs, response_mask_bt)

    # -- jitted entry points ------------------------------------------------------------------

    def batch_shardings(self, batch: RMBatch) -> RMBatch:
        """Candidate rows sharded over the batch axes (dim 1 after [A]); pair arrays replicated."""
        rows = lambda x: placement.rows_sharding(x, 1, self.mesh)
        rep = placement.replicated(self.mesh)
        return RMBatch(inputs=placement.inputs_shardings(batch.inputs, self.mesh, lead=1),
                       response_mask=rows(batch.response_mask), pair_a=rep, pair_b=rep, pair_p=rep, pair_m=rep,
                       pair_w=rep)

    def to_device(self, batch: RMBatch) -> RMBatch:
        return placement.place_tree(batch, self.batch_shardings(batch))

    def jit_train(self, state: RMState, batch: RMBatch):
        if self._train is None:
            state_sh = jax.tree.map(lambda x: x.sharding, state)
            rest_sh = jax.tree.map(lambda x: x.sharding, self.rest)
            rep = placement.replicated(self.mesh)
            self._train = jax.jit(self._train_step, in_shardings=(state_sh, rest_sh, self.batch_shardings(batch)),
                                  out_shardings=(state_sh, rep), donate_argnums=(0,))
        return self._train

    def train(self, state: RMState, batch: RMBatch):
        with jax.set_mesh(self.mesh):
            return self.jit_train(state, batch)(state, self.rest, self.to_device(batch))

    def score(self, params, batch: RMBatch) -> np.ndarray:
        """Rewards [A, C] of a batch's rows (no gradient)."""
        if self._score is None:
            self._score = jax.jit(self._score_step, out_shardings=placement.replicated(self.mesh))
        dev = self.to_device(batch)
        out = []
        with jax.set_mesh(self.mesh):
            for i in range(batch.pair_w.shape[0]):
                mb = jax.tree.map(lambda x: x[i], dev)
                out.append(np.asarray(self._score(params, self.rest, mb.inputs, mb.response_mask)))
        return np.stack(out)


def step_metrics(sums: dict) -> dict:
    n = jnp.maximum(sums["n_decided"], 1.0)
    return {"pair_loss": sums["pair_loss_sum"], "center_loss": sums["center_sum"],
            "pair_accuracy": sums["correct"] / n, "margin": sums["margin_sum"] / n,
            "chosen_reward": sums["chosen_sum"] / n, "rejected_reward": sums["rejected_sum"] / n,
            "pairs": sums["n_pairs"], "lb_loss": sums["lb_loss"]}
