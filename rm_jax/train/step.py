"""The train step: one pure function, jitted once with explicit shardings and donated state.

* `nnx.split` happens once, when the `StepBuilder` is made; the step itself is a pure function of
  (TrainState, frozen rest, batch) -> (TrainState, metrics). No NNX graph traversal per step, no
  nested `nnx.jit` (both known to be slow or broken inside `jax.jit`).
* Gradient accumulation is a `lax.scan` over microbatches inside the step. Each microbatch's
  token-sum loss is divided by the *global* target-token count of the whole step, so the result
  is exactly the loss of one big batch (not a mean of per-microbatch means).
* Master weights and optimizer state live in `param_dtype` (fp32); the model casts to its
  compute dtype (bf16 on GPU) at use.
* `expert_grad_dtype` (= the compute dtype, e.g. bf16): the routed-expert weights, ~95% of a
  30B-A3B model, are cast to it *before* differentiation, so their per-microbatch gradients (and
  the gradient reduce-scatters) are stored in bf16 and summed into an fp32 accumulator. This is
  exact, not an approximation: the MoE casts those weights to the compute dtype at use anyway, so
  their gradient is bf16-valued either way (the cast's transpose only widens it). What changes is
  the storage (and reduce-scatter traffic) of the expert gradients, which halves. (XLA's CPU
  memory plan for 30B did not show a lower peak from it: 88.0 GiB per device at A=4.)
* The MoE load-balancing (and optional z-) loss enter the objective with configurable
  coefficients and are logged separately, with per-expert load and its imbalance (max/mean).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rm_jax.model.decode import verdict_logits_at
from rm_jax.model import placement
from rm_jax.model.interface import JudgeInputs, JudgeModel
from rm_jax.model.layer_stack import GradSink
from rm_jax.train.loss import LossConfig, target_cross_entropy


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any          # nnx.State of the model's nnx.Param leaves
    opt_state: Any


@flax.struct.dataclass
class StepBatch:
    """A step's microbatches, each leaf with a leading [A] (accumulation) axis."""
    inputs: JudgeInputs
    target_mask: jax.Array     # [A, B, T]


@flax.struct.dataclass
class LossSums:
    """One microbatch's loss pieces (summed over the accumulation): the target token sum and count,
    the MoE aux losses and the per-expert token counts."""
    ce_sum: jax.Array
    n_tokens: jax.Array
    lb: jax.Array
    z: jax.Array
    expert_counts: jax.Array

    @classmethod
    def zeros(cls, n_exp: int) -> "LossSums":
        z = jnp.zeros((), jnp.float32)
        return cls(z, z, z, z, jnp.zeros((n_exp,), jnp.float32))


@dataclasses.dataclass(frozen=True)
class StepConfig:
    loss: LossConfig = LossConfig()
    lb_coef: float = 0.0
    z_coef: float = 0.0
    expert_grad_dtype: str = ""     # "" = the parameter dtype
    expert_accum_dtype: str = ""    # dtype expert gradients are summed in over microbatches ("" = param dtype)
    # Routed-expert gradients summed into the accumulator inside the layer scan (layer_stack.GradSink):
    # no cast copy of the expert stacks and no per-microbatch expert gradient beside the accumulator.
    expert_grad_in_scan: bool = False

class StepBuilder:
    """Splits the model once and builds the jitted train / eval steps for one run."""

    def __init__(self, model: JudgeModel, optimizer: optax.GradientTransformation, cfg: StepConfig,
                 mesh, schedule=None):
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.optimizer, self.cfg, self.mesh, self.schedule = optimizer, cfg, mesh, schedule
        self.trace_count = 0          # a test asserts one trace per run
        self._params = params
        self._train = self._eval = self._eval_verdict = None
        compute = self._compute_dtype = model.cfg.runtime.dtype
        if cfg.expert_grad_dtype and jnp.dtype(cfg.expert_grad_dtype) != jnp.dtype(compute):
            # Casting earlier than the model does is only exact in the dtype it casts to.
            raise ValueError(f"expert_grad_dtype={cfg.expert_grad_dtype!r} must be '' or the compute "
                             f"dtype {compute!r}")
        # expert_leaf[i]: whether the i-th flattened param leaf is a routed-expert weight (logical
        # axis "exp"), the leaves `expert_grad_dtype` / `expert_accum_dtype` apply to.
        is_var = lambda x: isinstance(x, nnx.Variable)
        self.expert_leaf = [("exp" in (v.get_metadata().get("out_sharding") or ()))
                            for v in jax.tree.leaves(params, is_leaf=is_var)]
        assert len(self.expert_leaf) == len(jax.tree.leaves(params))

    # -- state --------------------------------------------------------------------------------

    def opt_state_shardings(self, params):
        return placement.opt_state_shardings(self.optimizer, params, self.mesh)

    def init_state(self) -> TrainState:
        replicated = placement.replicated(self.mesh)
        with jax.set_mesh(self.mesh):
            opt_state = jax.jit(self.optimizer.init,
                                out_shardings=self.opt_state_shardings(self._params))(self._params)
            step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
        return TrainState(step=step, params=self._params, opt_state=opt_state)

    def state_shardings(self, state: TrainState):
        return jax.tree.map(lambda x: x.sharding, state)

    # -- the pure functions ---------------------------------------------------------------------

    def micro_loss(self, params, rest, mb: StepBatch, n_total, n_micro) -> tuple[jax.Array, LossSums]:
        """The objective one microbatch adds to the step's (what is differentiated), and its loss
        sums. ``mb``: one microbatch (no A axis); ``n_total``: the step's global target-token
        count, which the target sum is divided by; ``n_micro``: the microbatches in the step (the
        MoE aux losses are their mean)."""
        model = nnx.merge(self.graphdef, params, rest)
        out = model.forward_arrays(mb.inputs, logits=False)
        ids_bt = jnp.asarray(mb.inputs.input_ids_bt)
        tl = target_cross_entropy(out.final_hidden_btd, model.head_dv(), ids_bt, mb.target_mask, self.cfg.loss)
        aux = out.moe_aux
        if aux is None:
            lb = z = jnp.zeros((), jnp.float32)
            counts = jnp.zeros((1,), jnp.float32)
        else:
            lb, z = jnp.mean(aux.lb_loss), jnp.mean(aux.z_loss)
            counts = jnp.sum(aux.expert_counts.astype(jnp.float32).reshape(-1, aux.expert_counts.shape[-1]), 0)
        objective = tl.loss_sum / n_total + (self.cfg.lb_coef * lb + self.cfg.z_coef * z) / n_micro
        return objective, LossSums(tl.loss_sum, tl.n_tokens, lb, z, counts)

    def _grad_view(self, params):
        """The params as differentiated: expert weights in `expert_grad_dtype` when set."""
        return self._cast_experts(params, self.cfg.expert_grad_dtype)

    def _accum_view(self, params):
        """The gradient accumulator's dtypes: expert leaves in `expert_accum_dtype` when set."""
        return self._cast_experts(params, self.cfg.expert_accum_dtype)

    def _cast_experts(self, params, dtype: str):
        if not dtype:
            return params
        dt = jnp.dtype(dtype)
        leaves, treedef = jax.tree.flatten(params)
        return jax.tree.unflatten(treedef, [x.astype(dt) if low else x for x, low in zip(leaves, self.expert_leaf)])

    def _add_grad(self, params, acc_g, rest, mb: StepBatch, n_total, n_micro):
        """((objective, LossSums), acc_g + the microbatch's gradient). With ``expert_grad_in_scan``
        the expert leaves reach the model as ``GradSink(master, acc)``: differentiating with
        respect to their accumulators gives the accumulators plus the gradient, summed layer by
        layer in the scan's backward pass."""
        if not self.cfg.expert_grad_in_scan:
            out, g = jax.value_and_grad(self.micro_loss, has_aux=True)(params, rest, mb, n_total, n_micro)
            return out, jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc_g, g)
        leaves, treedef = jax.tree.flatten(params)
        acc_leaves = treedef.flatten_up_to(acc_g)

        def loss(diff_leaves):
            merged = [GradSink(m, d, self._compute_dtype) if e else d
                      for m, d, e in zip(leaves, diff_leaves, self.expert_leaf)]
            return self.micro_loss(treedef.unflatten(merged), rest, mb, n_total, n_micro)
        out, g = jax.value_and_grad(loss, has_aux=True)(
            [a if e else x for x, a, e in zip(leaves, acc_leaves, self.expert_leaf)])
        return out, treedef.unflatten([x if e else a + x.astype(a.dtype)
                                       for a, x, e in zip(acc_leaves, g, self.expert_leaf)])

    def accumulate(self, params, rest, batch: StepBatch, with_grad: bool):
        """A step's microbatches (the [A] axis) summed: the gradient of the step's objective in the
        params' dtypes (None without ``with_grad``) and the step's metrics. Pure: jit it."""
        n_micro = batch.target_mask.shape[0]
        master = params
        if with_grad and not self.cfg.expert_grad_in_scan:
            params = self._grad_view(params)
        # The target sum is divided by the *global* target-token count (of the whole step).
        n_total = jnp.maximum(jnp.sum(batch.target_mask.astype(jnp.float32)), 1.0)
        grad_fn = jax.value_and_grad(self.micro_loss, has_aux=True)

        def body(carry, mb):
            acc_g, acc = carry
            if with_grad:
                (_, extras), acc_g = self._add_grad(params, acc_g, rest, mb, n_total, n_micro)
            else:
                _, extras = self.micro_loss(params, rest, mb, n_total, n_micro)
            acc = jax.tree.map(jnp.add, acc, extras)
            return (acc_g, acc), None

        n_exp = self._n_experts()
        if n_micro == 1:
            # No scan: a second (accumulator) gradient tree would double gradient memory.
            mb = jax.tree.map(lambda x: x[0], batch)
            if with_grad and self.cfg.expert_grad_in_scan:
                # (the expert accumulator starts at zero: one expert gradient buffer, no cast copy)
                zeros_g = jax.tree.map(jnp.zeros_like, self._accum_view(master))
                (_, extras), grads = self._add_grad(params, zeros_g, rest, mb, n_total, 1)
                grads = jax.tree.map(lambda g, m: g.astype(m.dtype), grads, master)
            elif with_grad:
                (_, extras), grads = grad_fn(params, rest, mb, n_total, 1)
                grads = jax.tree.map(lambda g, m: g.astype(m.dtype), grads, master)   # fused into the update
            else:
                _, extras = self.micro_loss(params, rest, mb, n_total, 1)
                grads = None
            return grads, self._metrics(extras, n_micro=1, n_exp=n_exp)
        # The accumulator is in the master dtype (fp32), except for the routed-expert leaves when
        # `expert_accum_dtype` is set: they are ~95% of a 30B-A3B model, so a bf16 accumulator saves
        # a quarter of the gradient memory (the per-microbatch expert gradients are bf16 already).
        zeros_g = jax.tree.map(jnp.zeros_like, self._accum_view(master)) if with_grad else None
        (grads, extras), _ = jax.lax.scan(body, (zeros_g, LossSums.zeros(n_exp)), batch)
        if with_grad:
            grads = jax.tree.map(lambda g, m: g.astype(m.dtype), grads, master)
        return grads, self._metrics(extras, n_micro=n_micro, n_exp=n_exp)

    @staticmethod
    def _metrics(s: LossSums, *, n_micro: int, n_exp: int) -> dict:
        metrics = {"loss": s.ce_sum / jnp.maximum(s.n_tokens, 1.0), "target_tokens": s.n_tokens,
                   "lb_loss": s.lb / n_micro, "z_loss": s.z / n_micro}
        if n_exp > 1:
            counts = s.expert_counts
            load = counts / jnp.maximum(jnp.sum(counts), 1.0)
            metrics["expert_load_max"] = jnp.max(load)
            metrics["expert_imbalance"] = jnp.max(counts) / jnp.maximum(jnp.mean(counts), 1e-9)
        return metrics

    def _n_experts(self) -> int:
        t = nnx.merge(self.graphdef, self._params, self.rest).cfg.text
        return int(t.num_experts) if any(t.is_sparse(i) for i in range(t.num_hidden_layers)) else 1

    def _train_step(self, state: TrainState, rest, batch: StepBatch):
        self.trace_count += 1
        grads, metrics = self.accumulate(state.params, rest, batch, with_grad=True)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics["grad_norm"] = optax.tree.norm(grads)
        if self.schedule is not None:
            metrics["lr"] = self.schedule(state.step)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    def _eval_step(self, params, rest, batch: StepBatch):
        _, metrics = self.accumulate(params, rest, batch, with_grad=False)
        return metrics

    def _eval_verdict_step(self, params, rest, batch: StepBatch, slot_b, pass_id: int, fail_id: int):
        """One held-out microbatch, one forward: the target loss (token sum and count) and the
        verdict-slot logits at ``slot_b``, teacher-forced through the same prompt and target
        prefix the scorer appends, so P(pass) here is the scorer's (tests/test_train.py)."""
        model = nnx.merge(self.graphdef, params, rest)
        inputs = jax.tree.map(lambda x: x[0], batch.inputs)
        out = model.forward_arrays(inputs, logits=False)
        tl = target_cross_entropy(out.final_hidden_btd, model.head_dv(), jnp.asarray(inputs.input_ids_bt),
                                  batch.target_mask[0], self.cfg.loss)
        lp, lf, lse = verdict_logits_at(model, out.final_hidden_btd, slot_b, pass_id, fail_id)
        return {"loss_sum": tl.loss_sum, "target_tokens": tl.n_tokens, "logit_pass": lp, "logit_fail": lf,
                "logsumexp": lse}

    # -- jitted entry points --------------------------------------------------------------------

    def batch_shardings(self, batch: StepBatch):
        return batch_shardings(batch, self.mesh)

    def _replicated(self):
        return placement.replicated(self.mesh)

    def jit_train(self, state: TrainState, batch: StepBatch):
        """``batch``: a placed batch (its arrays' shardings are used) or this process's host batch."""
        if self._train is None:
            state_sh = self.state_shardings(state)
            rest_sh = jax.tree.map(lambda x: x.sharding, self.rest)
            leaves = jax.tree.leaves(batch)
            batch_sh = (jax.tree.map(lambda x: x.sharding, batch) if all(isinstance(x, jax.Array) for x in leaves)
                        else self.batch_shardings(batch))
            # Metrics replicated: every process reads the same values (the non-finite check).
            self._train = jax.jit(self._train_step, in_shardings=(state_sh, rest_sh, batch_sh),
                                  out_shardings=(state_sh, self._replicated()), donate_argnums=(0,))
        return self._train

    def jit_eval(self):
        if self._eval is None:
            self._eval = jax.jit(self._eval_step, out_shardings=self._replicated())
        return self._eval

    def jit_eval_verdict(self):
        if self._eval_verdict is None:
            # Per-row logits come back replicated, so every process can compute the judge metrics.
            self._eval_verdict = jax.jit(self._eval_verdict_step, static_argnums=(4, 5),
                                         out_shardings=self._replicated())
        return self._eval_verdict


def batch_shardings(batch: StepBatch, mesh, process_count: int | None = None) -> StepBatch:
    """Shardings of a step batch given as *this process's* host batch (rm_jax.model.placement:
    rows over the batch axes after the [A] axis, image patches replicated)."""
    rows = lambda x: placement.rows_sharding(x, 1, mesh, process_count)
    return StepBatch(inputs=placement.inputs_shardings(batch.inputs, mesh, lead=1, process_count=process_count),
                     target_mask=rows(batch.target_mask))


def host_batch_to_device(batch: StepBatch, shardings) -> StepBatch:
    return placement.place_tree(batch, shardings)
