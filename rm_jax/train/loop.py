"""The training run: model + data + step + checkpoints + logs, resumable from the workdir.

Run shape (the report's v3 recipe by default: lr 5e-6, global batch 32, max length 8192,
2 epochs, failures x3 in train only, checkpoints every K steps, all kept for the sweep):

1. Mesh from the config (fails early on numbers that disagree), model initialized from an HF
   checkpoint (`train.init_from`) or randomly (the embedded default), placed by logical names.
2. Resume: the newest restorable checkpoint in `W/checkpoints` (damaged ones are skipped with a
   warning) restores the train state *and* the data iterator; metrics.jsonl is cut back to that
   step, so a run killed with SIGKILL and restarted writes exactly the uninterrupted file.
3. The step is lowered and compiled ahead of time; `memory_analysis()` is logged before step 1.
   Batches have one static shape for the whole run (max length, fixed patch/image budget), so
   the step compiles exactly once.
4. Every K steps an async checkpoint; every `eval_every` steps the held-out validation and
   every `log_every` steps a metrics row, on independent cadences. The non-finite-loss check
   runs at every log step and every validation step (reading the loss syncs with the device,
   so it is not done on every step).
5. Several processes (`rm_jax.train.distributed`): each reads its contiguous slice of every
   global batch and places it with `jax.make_array_from_process_local_data`; image patches are
   exchanged so the replicated vision arrays are the one-process ones; Orbax writes the
   checkpoint from all processes; process 0 alone writes metrics.jsonl and manifest.json.

The rooms around this loop: host batch assembly (`host_batch`), the data plan and streams
(`data_plan`), held-out validation (`evaluate`), the workdir's manifest (`run_manifest`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
import numpy as np
from absl import logging
from flax import nnx
from tqdm import tqdm

from rm_jax.data import loader as loader_lib
from rm_jax.model import load_hf, mimetic_init, placement, registry
from rm_jax.run_config import RunConfig, adopt_init_config, model_config
from rm_jax.sharding import make_mesh
from rm_jax.train import distributed, optim
from rm_jax.train.checkpoint import CheckpointOptions, Checkpointer, abstract_like
from rm_jax.train.data_plan import BatchStream, data_state_to_save, loader_config, own_data_state, plan_run
from rm_jax.train.evaluate import VerdictSlot, evaluate
from rm_jax.train.host_batch import assemble, frame_capacity
from rm_jax.train.loss import LossConfig, check_target_budget
from rm_jax.train.metrics_log import MetricsWriter
from rm_jax.train.run_manifest import check_resume_data, memory_line, write_manifest
from rm_jax.train.step import StepBuilder, StepConfig, host_batch_to_device


def build_model(cfg: RunConfig, mesh):
    """Random init (embedded default) or an HF checkpoint, placed on the mesh.

    Call it outside `jax.set_mesh`: parameters are created unsharded and then placed by their
    logical names (rm_jax.model.placement)."""
    mcfg, t = model_config(cfg), cfg.train
    if t.init_from:
        return load_hf(t.init_from, dtype=t.param_dtype, mesh=mesh, runtime=mcfg.runtime,
                       expert_layout=t.init_expert_layout or None)
    model = registry.init_model(mcfg, seed=cfg.seed)
    if t.mimetic_qk_gain:
        mimetic_init.apply(model, t.mimetic_qk_gain)
    placement.place_params(model, mesh)
    model.mesh = mesh
    return model, mcfg


def step_config(cfg: RunConfig) -> StepConfig:
    t = cfg.train
    return StepConfig(loss=LossConfig(t.max_target_tokens, t.vocab_chunk), lb_coef=cfg.moe.lb_coef,
                      z_coef=cfg.moe.z_coef, expert_grad_dtype=t.expert_grad_dtype,
                      expert_accum_dtype=t.expert_accum_dtype, expert_grad_in_scan=t.expert_grad_in_scan)


def run(cfg: RunConfig, workdir: str, *, cluster_line: str = "single process", progress: bool | None = None) -> dict:
    os.makedirs(workdir, exist_ok=True)
    t, data_dir = cfg.train, cfg.data.dir
    if not data_dir or not os.path.isfile(os.path.join(data_dir, "manifest.json")):
        raise FileNotFoundError(f"data.dir={data_dir!r} is not a built shard directory (no manifest.json; "
                                "launch.build_data --out writes one)")
    index = loader_lib.records.load_index(data_dir, "train")
    manifest = loader_lib.read_manifest(data_dir)
    plan = plan_run(t, len(loader_lib.stream_indices(index["label"], cfg.data.oversample_fail)))
    has_heldout = len(loader_lib.records.load_index(data_dir, "heldout")["label"]) > 0
    if not has_heldout and t.eval_every > 0:
        logging.warning("%s has no held-out examples: validation loss is skipped (and the sweep will "
                        "have nothing to score); build with more prompts or a larger data.heldout_fraction",
                        data_dir)
    cfg = adopt_init_config(cfg)
    mesh = make_mesh(cfg.mesh, num_experts=model_config(cfg).text.num_experts, global_batch=plan.micro_batch)
    logging.info("%s; mesh %s; plan %s", cluster_line, dict(mesh.shape), plan)

    model, mcfg = build_model(cfg, mesh)
    ocfg = dataclasses.replace(optim.OptimConfig.from_config(t), total_steps=plan.total_steps)
    builder = StepBuilder(model, optim.make_optimizer(ocfg, nnx.state(model, nnx.Param)), step_config(cfg),
                          mesh, optim.schedule(ocfg))
    state = builder.init_state()

    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"),
                        CheckpointOptions(every=t.checkpoint_every, max_to_keep=t.keep or None,
                                          async_save=t.async_checkpoint))
    restored = ckpt.restore(abstract_like(state))
    start, data_state, skipped = 0, None, []
    if restored is not None:
        check_resume_data(workdir, data_dir)
        skipped = restored.skipped
        state, start, data_state = restored.state, restored.step, own_data_state(restored.data_state)
        logging.info("resumed from %s at step %d", ckpt.directory, start)
    stream = BatchStream(data_dir, "train", loader_config(cfg, plan, split="train"), plan.accumulation, data_state)
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    primary = distributed.is_primary()      # the run's shared files are written once
    if primary and start == 0 and os.path.exists(metrics_path) and os.path.getsize(metrics_path) > 0:
        # A start from scratch over an earlier run's log (its checkpoints all damaged, or none
        # written yet): keep that history beside the new one instead of truncating it.
        os.replace(metrics_path, f"{metrics_path}.before_restart.{int(time.time())}")
    distributed.sync("resume_checked")     # every process has read the old manifest before it is rewritten
    writer = MetricsWriter(workdir, resume_step=start, tensorboard=t.tensorboard) if primary else None
    if primary:
        write_manifest(workdir, cfg, manifest, mesh, plan)

    capacity = frame_capacity(cfg, mcfg)
    verdict = VerdictSlot.from_manifest(manifest)
    next_batch = lambda: assemble(mcfg, stream.next(), capacity, t.verdict_weight)
    pending = next_batch() if start < plan.total_steps else None
    if pending is not None:
        shardings = builder.batch_shardings(pending.batch)
        placed = host_batch_to_device(pending.batch, shardings)     # global shapes, for the lowering
        with jax.set_mesh(mesh):
            train = builder.jit_train(state, placed)
            t0 = time.time()
            compiled = train.lower(state, builder.rest, placed).compile()
            logging.info("compiled train step in %.1fs (length %d); memory per device: %s", time.time() - t0,
                         pending.batch.target_mask.shape[-1], memory_line(compiled.memory_analysis()))
    # Processes finish compiling at different times (or one hits the compilation cache); meet
    # before the first collective: CPU (gloo) collectives time out on a peer ~30 s late.
    distributed.sync("train_step_compiled")

    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=plan.total_steps, initial=start, desc="train", unit="step", disable=not show)
    last_metrics: dict = {}
    step = start
    t_log, tokens_since, samples_since, fails_since = time.time(), 0, 0, 0
    try:
        while step < plan.total_steps:
            host = pending if pending is not None else next_batch()
            pending = None
            check_target_budget(host.batch.target_mask.reshape(-1, host.batch.target_mask.shape[-1]),
                                t.max_target_tokens)
            dev_batch = host_batch_to_device(host.batch, shardings)
            with jax.set_mesh(mesh):
                state, metrics = compiled(state, builder.rest, dev_batch)
            step += 1
            tokens_since += int(host.batch.inputs.attention_mask_bt.sum())
            samples_since += host.n_examples
            fails_since += host.n_fail
            log_now = _due(step, t.log_every, plan.total_steps)
            eval_now = has_heldout and t.eval_every > 0 and _due(step, t.eval_every, plan.total_steps)
            if log_now or eval_now:
                m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                if not np.isfinite(m["loss"]):
                    raise FloatingPointError(f"step {step}: training loss is {m['loss']} (grad_norm "
                                             f"{m.get('grad_norm')}); stopping instead of training on it. "
                                             f"The last good checkpoint is kept in {ckpt.directory}")
                # Host counters of this process's slice, summed over processes (one exchange per row);
                # timed before the validation, which is not training throughput.
                tokens, samples, fails = distributed.allgather_host(
                    np.array([tokens_since, samples_since, fails_since], np.int64)).sum(0).tolist()
                dt = max(time.time() - t_log, 1e-9)
                m.update(tokens_per_s=tokens / dt, samples_per_s=samples / dt,
                         fail_share=fails / max(samples, 1), epoch=step / plan.steps_per_epoch)
            if eval_now:
                val = evaluate(builder, cfg, mcfg, state, plan, mesh, verdict)
                if not np.isfinite(val["val_loss"]):
                    raise FloatingPointError(f"step {step}: validation loss is {val['val_loss']}; stopping. "
                                             f"The last good checkpoint is kept in {ckpt.directory}")
                m.update(val)
            if log_now or eval_now:
                if writer is not None:
                    writer.write(step, m)
                bar.set_postfix(loss=f"{m['loss']:.4f}")
                last_metrics = m
                t_log, tokens_since, samples_since, fails_since = time.time(), 0, 0, 0
            if _due(step, t.checkpoint_every, plan.total_steps):
                ckpt.save(step, state, data_state_to_save(stream))
            bar.update(1)
        ckpt.wait()
    finally:
        bar.close()
        if writer is not None:
            writer.close()
        ckpt.close()
    return {"steps": step, "resumed_from": start, "skipped_damaged": skipped,
            "last_metrics": last_metrics, "trace_count": builder.trace_count,
            "checkpoints": ckpt.steps(), "plan": dataclasses.asdict(plan)}


def _due(step: int, every: int, last: int) -> bool:
    """Every ``every`` steps and at the last one; 0 = only at the last one (as eval_every=0 is off)."""
    return step == last or (every > 0 and step % every == 0)
