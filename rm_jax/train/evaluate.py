"""Held-out validation during training: the target loss and, on verdict-first data, the judge
metrics of P(pass) read at the verdict slot of the same forward."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rm_jax.metrics import judge_metrics
from rm_jax.model import placement
from rm_jax.model.decode import verdict_probabilities
from rm_jax.run_config import RunConfig
from rm_jax.train import distributed
from rm_jax.train.data_plan import BatchStream, RunPlan, loader_config
from rm_jax.train.host_batch import assemble, frame_capacity
from rm_jax.train.step import StepBuilder, host_batch_to_device


@dataclasses.dataclass(frozen=True)
class VerdictSlot:
    """What the held-out validation needs to read P(pass): the verdict's first token ids. Only
    for verdict-first data; reason-first targets put the teacher's reason before the slot, so a
    teacher-forced read there would not be the judge's own P(pass)."""
    pass_id: int
    fail_id: int

    @classmethod
    def from_manifest(cls, manifest: dict) -> "VerdictSlot | None":
        tokens, order = manifest.get("verdict_tokens"), manifest.get("field_order") or []
        if not tokens or not order or order[0] != "l3":
            return None
        return cls(int(tokens["pass_id"]), int(tokens["fail_id"]))


def evaluate(builder: StepBuilder, run: RunConfig, mcfg, state, plan: RunPlan, mesh,
             verdict: VerdictSlot | None = None) -> dict:
    """Held-out validation over ``train.eval_batches`` batches (0 = the whole split):
    ``val_loss`` (token sum / target-token count) and, with ``verdict``, the judge metrics of
    P(pass) read at the verdict slot of the same forward (``val_auc``, ``val_middle_zone``,
    ``val_fail_f1``, ``val_accuracy``, ``val_majority_baseline``, ``val_off_vocab_mass``)."""
    stream = BatchStream(run.data.dir, "heldout", loader_config(run, plan, split="heldout"), 1)
    total, count = 0.0, 0.0
    first = True
    labels, p_pass, off_vocab = [], [], []
    limit = run.train.eval_batches
    for i, micro in enumerate(stream.it):
        if limit and i >= limit:
            break
        batch = assemble(mcfg, [micro], frame_capacity(run, mcfg)).batch
        dev = host_batch_to_device(batch, builder.batch_shardings(batch))
        if first and jax.process_count() > 1:    # the eval step compiles on first use, each process at its pace
            fn = builder.jit_eval() if verdict is None else builder.jit_eval_verdict()
            with jax.set_mesh(mesh):
                if verdict is None:
                    fn.lower(state.params, builder.rest, dev).compile()
                else:
                    slot = np.zeros(micro["verdict_pos"].shape, np.int32)
                    slot = placement.place(slot, placement.rows_sharding(slot, 0, mesh))
                    fn.lower(state.params, builder.rest, dev, slot, verdict.pass_id, verdict.fail_id).compile()
            distributed.sync("eval_step_compiled")
            first = False
        if verdict is None:
            with jax.set_mesh(mesh):
                m = jax.device_get(builder.jit_eval()(state.params, builder.rest, dev))
            total += float(m["loss"]) * float(m["target_tokens"])
            count += float(m["target_tokens"])
            continue
        # The logits at verdict_pos - 1 predict the verdict token (padding rows read position 0).
        slot_b = np.maximum(micro["verdict_pos"].astype(np.int32) - 1, 0)
        # this process's rows, sharded like the batch's rows
        slot_b = placement.place(slot_b, placement.rows_sharding(slot_b, 0, mesh))
        with jax.set_mesh(mesh):
            m = jax.device_get(builder.jit_eval_verdict()(state.params, builder.rest, dev, slot_b,
                                                           verdict.pass_id, verdict.fail_id))
        total += float(m["loss_sum"])
        count += float(m["target_tokens"])
        # The logits are replicated over the whole microbatch; its rows are the processes' in order.
        valid_b, pos_b, label_b = (distributed.allgather_host(micro[k]).reshape(-1)
                                   for k in ("example_valid", "verdict_pos", "label"))
        rows = np.flatnonzero(valid_b.astype(bool) & (pos_b > 0))
        p_b, off_b = verdict_probabilities(m["logit_pass"], m["logit_fail"], m["logsumexp"])
        p_pass.extend(p_b[rows])
        off_vocab.extend(off_b[rows])
        labels.extend(label_b[rows].astype(int))
    out = {"val_loss": total / max(count, 1.0)}
    if verdict is not None and labels:
        jm = judge_metrics(labels, p_pass, off_vocab_mass=off_vocab)
        out.update({f"val_{k}": jm[k] for k in ("auc", "middle_zone", "fail_f1", "accuracy", "majority_baseline")})
        out["val_off_vocab_mass"] = jm["mean_off_vocab_mass"]
    return out
