"""The RM training run: model + head on the mesh, optax (rm_jax.train.optim), Orbax checkpoints
(rm_jax.train.checkpoint, the data position saved beside the state), metrics.jsonl.

Data order is a pure function of (seed, epoch, step), so a restarted run resumes at the saved
step with the same batches. One process only (the RM step keeps a prompt's pairs in one
microbatch; multi-host placement of whole groups is not wired).
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import logging

from rm_jax.rm import data as data_lib
from rm_jax.rm.head import HEAD_DEFINITION, RewardModel, init_reward_model
from rm_jax.rm.loss import PairLossConfig
from rm_jax.rm.render import REWARD_POSITION_RULE
from rm_jax.rm.step import RMStepBuilder, RMStepConfig
from rm_jax.model import load_hf, placement
from rm_jax.run_config import RunConfig, model_config
from rm_jax.sharding import make_mesh
from rm_jax.train.host_batch import frame_capacity
from rm_jax.train import optim
from rm_jax.train.checkpoint import Checkpointer, CheckpointOptions, abstract_like
from rm_jax.train.metrics_log import MetricsWriter


def batch_shape(cfg: RunConfig, mcfg, length: int) -> data_lib.BatchShape:
    r = cfg.rm
    return data_lib.BatchShape(rows=int(r.rows), pairs=int(r.pairs), length=length, max_patches=int(r.max_patches),
                               max_images=int(r.max_images), frame_capacity=frame_capacity(cfg, mcfg))


def run_length(cfg: RunConfig, data_dir: str) -> int:
    with open(os.path.join(data_dir, "stats.json")) as f:
        longest = int(json.load(f)["max_length"])
    buckets = sorted(int(b) for b in cfg.data.buckets)
    fits = [b for b in buckets if b >= longest]
    if not fits:
        raise ValueError(f"the longest built candidate ({longest}) exceeds every bucket {buckets}")
    return fits[0]


def build_reward_model(cfg: RunConfig, mesh) -> tuple[RewardModel, object]:
    mcfg = model_config(cfg)
    backbone = None
    if cfg.train.init_from:
        backbone, mcfg = load_hf(cfg.train.init_from, dtype=cfg.train.param_dtype, runtime=mcfg.runtime)
    model = init_reward_model(mcfg, int(cfg.seed), backbone)
    placement.place_params(model, mesh)
    return model, mcfg


def make_builder(cfg: RunConfig, model: RewardModel, mesh, total_steps: int) -> RMStepBuilder:
    from flax import nnx
    ocfg = optim.OptimConfig.from_config(cfg.train)
    ocfg = optim.OptimConfig(**{**ocfg.__dict__, "total_steps": total_steps})
    params = nnx.state(model, nnx.Param)
    scfg = RMStepConfig(loss=PairLossConfig(bool(cfg.rm.group_normalize), float(cfg.rm.center_coef)),
                        lb_coef=float(cfg.moe.lb_coef))
    return RMStepBuilder(model, optim.make_optimizer(ocfg, params), scfg, mesh)


def restore_latest(cfg: RunConfig, workdir: str, step: int | None = None):
    """(builder, state, step, mcfg) of a trained workdir (for evaluation)."""
    mesh = make_mesh(cfg.mesh)
    model, mcfg = build_reward_model(cfg, mesh)
    builder = make_builder(cfg, model, mesh, int(cfg.rm.steps))
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), CheckpointOptions(async_save=False))
    restored = ckpt.restore(abstract_like(builder.init_state()), step)
    ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"no checkpoint in {workdir}/checkpoints")
    return builder, restored.state, restored.step, mcfg


def run(cfg: RunConfig, workdir: str, data_dir: str) -> dict:
    if jax.process_count() > 1:
        raise ValueError("rm training runs in one process")
    os.makedirs(workdir, exist_ok=True)
    mesh = make_mesh(cfg.mesh)
    model, mcfg = build_reward_model(cfg, mesh)
    steps = int(cfg.rm.steps)
    builder = make_builder(cfg, model, mesh, steps)
    split = data_lib.load_split(data_dir, "train")
    length = run_length(cfg, data_dir)
    shape = batch_shape(cfg, mcfg, length)
    with open(os.path.join(data_dir, "manifest.json")) as f:
        data_manifest = json.load(f)
    with open(os.path.join(data_dir, "stats.json")) as f:
        data_stats = json.load(f)
    pad_id = int(data_manifest.get("pad_token_id") or 0)
    accum = int(cfg.rm.grad_accum)

    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), CheckpointOptions(every=int(cfg.rm.checkpoint_every)))
    state = builder.init_state()
    start = 0
    restored = ckpt.restore(abstract_like(state))
    if restored is not None:
        state, start = restored.state, restored.step
        logging.info("resumed at step %d", start)
    metrics_out = MetricsWriter(workdir, resume_step=start, tensorboard=cfg.train.tensorboard)
    manifest = {"config": cfg.to_dict(), "data_dir": os.path.abspath(data_dir), "data_manifest": data_manifest,
                "head_definition": HEAD_DEFINITION, "reward_position_rule": REWARD_POSITION_RULE,
                "run_length": length, "objective": "bradley_terry"}
    with open(os.path.join(workdir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, default=str)

    epoch_steps: dict[int, list] = {}

    def step_micros(step: int):
        n_per_epoch = None
        epoch, k = 0, step
        while True:
            if epoch not in epoch_steps:
                epoch_steps[epoch] = data_lib.step_groups(split, shape, accum, int(cfg.seed), epoch)
            n_per_epoch = len(epoch_steps[epoch])
            if n_per_epoch == 0:
                raise ValueError("the train split packs into no full step: more data or a smaller rm.grad_accum")
            if k < n_per_epoch:
                return epoch_steps[epoch][k]
            k -= n_per_epoch
            epoch += 1

    log_every = int(cfg.rm.log_every)
    t0, pairs_acc, tokens_acc, last = time.time(), 0, 0, {}
    for step in range(start, steps):
        micros = [data_lib.micro_arrays(split, m, shape, mcfg, pad_id) for m in step_micros(step)]
        batch = data_lib.assemble(micros, bool(cfg.rm.group_normalize))
        state, metrics = builder.train(state, batch)
        pairs_acc += int(sum(m["pair_valid"].sum() for m in micros))
        tokens_acc += data_lib.non_pad_tokens(batch)
        done = step + 1
        if done % log_every == 0 or done == steps:
            row = {k: float(v) for k, v in jax.device_get(metrics).items()}
            if not np.isfinite(row["pair_loss"]):
                raise FloatingPointError(f"non-finite pair_loss at step {done}")
            dt = max(time.time() - t0, 1e-9)
            row.update(pairs_per_s=pairs_acc / dt, non_pad_tokens_per_s=tokens_acc / dt,
                       overlength_filter_rate=float(data_stats["overlength_filter_rate"]))
            metrics_out.write(done, row)
            logging.info("step %d %s", done, " ".join(f"{k}={v:.4g}" for k, v in row.items()))
            t0, pairs_acc, tokens_acc, last = time.time(), 0, 0, row
        if done % int(cfg.rm.checkpoint_every) == 0 or done == steps:
            ckpt.save(done, state, {"step": done})
    ckpt.close()
    metrics_out.close()
    return {"steps": steps, "last": last, "trace_count": builder.trace_count}
