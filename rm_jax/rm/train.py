"""The RM training run: model + head on the mesh, optax (rm_jax.train.optim), Orbax checkpoints
(rm_jax.train.checkpoint, the data position saved beside the state), metrics.jsonl.

Pair data comes from the Grain loader over group records (rm_jax.rm.pair_loader); its iterator
state is saved beside each checkpoint, so a restarted run resumes at the saved step with the same
batches. Several processes (launch.rm_train's cluster flags) each place their slice of every
microbatch's rows; the metrics, manifest and checkpoint data item are written once.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import logging

from rm_jax.rm import data as data_lib
from rm_jax.rm import pair_loader, pair_records
from rm_jax.rm.head import HEAD_DEFINITION, RewardModel, init_reward_model
from rm_jax.rm.loss import PairLossConfig
from rm_jax.rm.render import REWARD_POSITION_RULE
from rm_jax.rm.step import RMStepBuilder, RMStepConfig
from rm_jax.model import load_hf, placement
from rm_jax.run_config import RunConfig, model_config
from rm_jax.sharding import make_mesh
from rm_jax.train import distributed
from rm_jax.train.data_plan import data_state_to_save, own_data_state
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


def loader_config(cfg: RunConfig, mcfg, length: int) -> pair_loader.PairLoaderConfig:
    r = cfg.rm
    return pair_loader.PairLoaderConfig(
        groups=int(r.groups), rows=int(r.rows), pairs=int(r.pairs), length=length,
        max_patches=int(r.max_patches), max_images=int(r.max_images),
        frame_capacity=frame_capacity(cfg, mcfg), seed=int(cfg.seed),
        process_index=jax.process_index(), process_count=jax.process_count())


def run(cfg: RunConfig, workdir: str, data_dir: str, *, cluster_line: str = "single process") -> dict:
    os.makedirs(workdir, exist_ok=True)
    mesh = make_mesh(cfg.mesh)
    logging.info("%s; mesh %s", cluster_line, dict(mesh.shape))
    model, mcfg = build_reward_model(cfg, mesh)
    steps = int(cfg.rm.steps)
    builder = make_builder(cfg, model, mesh, steps)
    pair_records.load_index(data_dir, "train")          # a clear error for a folder that is not pair data
    length = run_length(cfg, data_dir)
    lcfg = loader_config(cfg, mcfg, length)
    with open(os.path.join(data_dir, "manifest.json")) as f:
        data_manifest = json.load(f)
    with open(os.path.join(data_dir, "stats.json")) as f:
        data_stats = json.load(f)
    pad_id = int(data_manifest.get("pad_token_id") or 0)
    accum = int(cfg.rm.grad_accum)

    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), CheckpointOptions(every=int(cfg.rm.checkpoint_every)))
    state = builder.init_state()
    start, data_state = 0, None
    restored = ckpt.restore(abstract_like(state))
    if restored is not None:
        state, start = restored.state, restored.step
        data_state = own_data_state(restored.data_state)
        logging.info("resumed at step %d", start)
    stream = pair_loader.PairStream(data_dir, lcfg, accum, data_state)
    primary = distributed.is_primary()       # the run's shared files are written once
    distributed.sync("resume_checked")
    metrics_out = (MetricsWriter(workdir, resume_step=start, tensorboard=cfg.train.tensorboard)
                   if primary else None)
    if primary:
        manifest = {"config": cfg.to_dict(), "data_dir": os.path.abspath(data_dir), "data_manifest": data_manifest,
                    "head_definition": HEAD_DEFINITION, "reward_position_rule": REWARD_POSITION_RULE,
                    "run_length": length, "objective": "bradley_terry",
                    "devices": {"count": jax.device_count(), "process_count": jax.process_count()}}
        with open(os.path.join(workdir, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1, default=str)

    pdim = pair_loader.patch_dim(mcfg)
    log_every = int(cfg.rm.log_every)
    t0, pairs_acc, tokens_acc, last = time.time(), 0, 0, {}
    for step in range(start, steps):
        micros = [pair_loader.micro_arrays(groups, lcfg, mcfg, pad_id, pdim, micro_index=k)
                  for k, groups in enumerate(stream.next())]
        batch = data_lib.assemble(micros, bool(cfg.rm.group_normalize))
        state, metrics = builder.train(state, batch)
        pairs_acc += int(sum(m["pair_valid"].sum() for m in micros))    # global: pairs travel to every process
        tokens_acc += data_lib.non_pad_tokens(batch)        # this process's rows
        done = step + 1
        if done % log_every == 0 or done == steps:
            row = {k: float(v) for k, v in jax.device_get(metrics).items()}
            if not np.isfinite(row["pair_loss"]):
                raise FloatingPointError(f"non-finite pair_loss at step {done}")
            dt = max(time.time() - t0, 1e-9)
            tokens_acc = int(distributed.allgather_host(np.array([tokens_acc], np.int64)).sum())
            row.update(pairs_per_s=pairs_acc / dt, non_pad_tokens_per_s=tokens_acc / dt,
                       overlength_filter_rate=float(data_stats["overlength_filter_rate"]))
            if metrics_out is not None:
                metrics_out.write(done, row)
            logging.info("step %d %s", done, " ".join(f"{k}={v:.4g}" for k, v in row.items()))
            t0, pairs_acc, tokens_acc, last = time.time(), 0, 0, row
        if done % int(cfg.rm.checkpoint_every) == 0 or done == steps:
            ckpt.save(done, state, data_state_to_save(stream))
    ckpt.close()
    if metrics_out is not None:
        metrics_out.close()
    return {"steps": steps, "resumed_from": start, "last": last, "trace_count": builder.trace_count}
