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
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from rm_jax.data import loader as loader_lib
from rm_jax.data import seen_tokens, value_swap
from rm_jax.model import registry
from rm_jax.model.config import RuntimeOptions
from rm_jax.model.decode import verdict_probabilities
from rm_jax.sharding import describe_devices, make_mesh
from rm_jax.train import distributed, optim
from rm_jax.train.checkpoint import CheckpointOptions, Checkpointer, abstract_like
from rm_jax.train.loss import LossConfig, check_target_budget
from rm_jax.train.metrics_log import MetricsWriter
from rm_jax.train.step import StepBatch, StepBuilder, StepConfig, host_batch_to_device, place
from rm_jax.utils import file_sha256, package_versions


@dataclasses.dataclass(frozen=True)
class RunPlan:
    total_steps: int
    micro_batch: int          # global examples per microbatch
    accumulation: int
    steps_per_epoch: float


def plan_run(train_cfg, stream_len: int) -> RunPlan:
    gb, acc = int(train_cfg.global_batch), int(train_cfg.grad_accum)
    if gb % acc:
        raise ValueError(f"train.global_batch={gb} is not divisible by train.grad_accum={acc}")
    per_epoch = stream_len / gb
    steps = int(train_cfg.steps) if int(train_cfg.steps) > 0 else max(1, int(round(per_epoch * float(train_cfg.epochs))))
    return RunPlan(total_steps=steps, micro_batch=gb // acc, accumulation=acc, steps_per_epoch=per_epoch)


def model_config(cfg):
    """The typed model config of a run (its architecture by ``model.model_type``); the run-time
    choices are validated here, once, by name."""
    from rm_jax.model.layers import ATTENTION_IMPLS
    from rm_jax.model.moe import BACKENDS, RAGGED_DOT_IMPLS
    t = cfg.train
    choices = {"train.attention": (t.get("attention", "auto"), ATTENTION_IMPLS),
               "moe.backend": (cfg.moe.backend, BACKENDS),
               "moe.ragged_dot": (cfg.moe.get("ragged_dot", "auto"), RAGGED_DOT_IMPLS)}
    for field, (value, allowed) in choices.items():
        if value not in allowed:
            raise ValueError(f"{field}={value!r}; expected one of {tuple(allowed)}")
    runtime = RuntimeOptions(dtype=t.dtype, param_dtype=t.param_dtype, remat=t.remat,
                             scan_layers=bool(t.scan_layers), moe_backend=cfg.moe.backend,
                             ragged_dot=cfg.moe.get("ragged_dot", "auto"), attention=t.get("attention", "auto"))
    return registry.config_from_hf_dict(cfg.model.to_dict(), runtime)


def adopt_init_config(cfg) -> None:
    """With ``train.init_from``, the checkpoint's architecture is the run's: its config.json
    replaces ``cfg.model``, so the mesh check, the manifest and everything that rebuilds the
    model from the manifest (score, sweep, export) see the sizes that were trained."""
    from rm_jax.model import convert
    loaded = convert.read_config(cfg.train.init_from)
    with cfg.unlocked():
        cfg.model = ml_collections.ConfigDict(loaded.to_hf_dict())


def build_model(cfg, mesh):
    """Random init (embedded default) or an HF checkpoint, placed on the mesh.

    Call it outside `jax.set_mesh`: parameters are created unsharded and then placed by their
    logical names through rm_jax.sharding's rules (which never map one mesh axis twice)."""
    from rm_jax.model import convert
    from rm_jax.model.placement import param_shardings
    mcfg = model_config(cfg)
    if cfg.train.init_from:
        model, mcfg = convert.load_hf(cfg.train.init_from, dtype=cfg.train.param_dtype, mesh=mesh,
                                 runtime=mcfg.runtime, expert_layout=cfg.train.get("init_expert_layout") or None)
        return model, mcfg
    model = registry.init_model(mcfg, seed=int(cfg.seed))
    if float(cfg.train.get("mimetic_qk_gain", 0.0)):
        from rm_jax.model import mimetic_init
        mimetic_init.apply(model, float(cfg.train.mimetic_qk_gain))
    state = nnx.state(model)
    shardings = param_shardings(state, mesh)
    nnx.update(model, jax.tree.map(lambda v, s: jax.device_put(v, s.get_value() if hasattr(s, "get_value") else s),
                                   state, shardings))
    model.mesh = mesh
    return model, mcfg


def step_config(cfg, manifest: dict | None = None) -> StepConfig:
    """``manifest``: the data's, which the swapped-value term needs (the verdict token ids)."""
    t = cfg.train
    # The swapped-value and seen-token terms share the per-position loss (one of them at a time).
    seen_weight = float(t.get("seen_check_weight", 0.0))
    value_weight = float(t.get("value_check_weight", 0.0)) or seen_weight
    value_tokens = int(t.get("seen_check_tokens", 64)) if seen_weight else int(t.get("value_check_tokens", 32))
    value_ids = (0, 0)
    if value_weight:
        tokens = (manifest or {}).get("verdict_tokens")
        if not tokens:
            raise ValueError("train.value_check_weight / seen_check_weight need the data manifest's verdict_tokens")
        value_ids = (int(tokens["fail_id"]), int(tokens["pass_id"]))
    return StepConfig(loss=LossConfig(int(t.max_target_tokens), int(t.vocab_chunk)),
                      value_weight=value_weight, value_tokens=value_tokens,
                      value_ids=value_ids,
                      lb_coef=float(cfg.moe.lb_coef), z_coef=float(cfg.moe.z_coef),
                      expert_grad_dtype=str(t.get("expert_grad_dtype", "")),
                      expert_accum_dtype=str(t.get("expert_accum_dtype", "")),
                      context_weight=float(t.get("context_lm_weight", 0.0)),
                      context_tokens=int(t.get("context_lm_tokens", 0)))


@dataclasses.dataclass(frozen=True)
class TokenWeights:
    """How the host turns a loader batch's masks into the step's loss weights (train.*)."""
    verdict_weight: float = 1.0
    context_tokens: int = 0             # 0: no context LM term
    context_passing_only: bool = False
    image_token_id: int = -1

    @classmethod
    def from_config(cls, cfg, mcfg) -> "TokenWeights":
        t = cfg.train
        weight, n = float(t.get("context_lm_weight", 0.0)), int(t.get("context_lm_tokens", 0))
        if weight and n <= 0:
            raise ValueError(f"train.context_lm_weight={weight} needs train.context_lm_tokens > 0 (got {n})")
        return cls(verdict_weight=float(t.get("verdict_weight", 1.0)), context_tokens=n if weight else 0,
                   context_passing_only=bool(t.get("context_lm_passing_only", False)),
                   image_token_id=int(mcfg.image_token_id))


@dataclasses.dataclass(frozen=True)
class ValueCheck:
    """The host side of the swapped-value term (train.value_check_*, rm_jax.data.value_swap): in a
    ``rate`` share of the passing examples one value token is swapped, and the class tokens of
    every passing response are labelled, ``tokens`` at most a row."""
    classes: value_swap.ValueClasses
    rate: float
    tokens: int
    seed: int
    # A swapped value contradicts what the response copied it from, so the swapped example is a
    # failure: with ``fail_id`` its verdict token is trained as fail (the reason and the rest of
    # its target stay dropped: they describe the unswapped response). None: the whole target drops.
    fail_id: int | None = None

    @classmethod
    def from_config(cls, cfg, manifest: dict) -> "ValueCheck | None":
        t = cfg.train
        if not float(t.get("value_check_weight", 0.0)):
            return None
        rate, n = float(t.get("value_check_rate", 0.5)), int(t.get("value_check_tokens", 32))
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"train.value_check_rate={rate}: must be in (0, 1]")
        if n <= 0:
            raise ValueError(f"train.value_check_tokens={n}: must be > 0")
        rows = manifest.get("value_classes")
        if rows is None:
            raise ValueError(f"train.value_check_weight: the shards in {cfg.data.dir} record no value classes "
                             "(built before they were); rebuild them with launch.build_data")
        if not rows:
            raise ValueError("train.value_check_weight: the data has no value classes (no tool-call argument "
                             "takes two or more single-token values), so there is nothing to swap")
        fail_id = None
        if bool(t.get("value_check_verdict", False)):
            fail_id = int(manifest["verdict_tokens"]["fail_id"])
        return cls(value_swap.ValueClasses.from_json(rows), rate, n, int(cfg.seed), fail_id)

    def apply(self, b: dict, step: int, micro_index: int) -> tuple[dict, np.ndarray]:
        """A loader batch with its swaps applied (swapped rows lose their target) and its labels."""
        got = value_swap.swap_batch(b, self.classes, self.rate, (self.seed, step, micro_index),
                                    row_offset=jax.process_index() * len(b["label"]), max_positions=self.tokens)
        target = np.where(got.swapped[:, None], 0, b["target_mask"]).astype(b["target_mask"].dtype)
        ids = got.input_ids
        if self.fail_id is not None:
            rows = np.flatnonzero(got.swapped & (b["verdict_pos"] >= 0))
            pos = b["verdict_pos"][rows]
            ids[rows, pos] = self.fail_id
            target[rows, pos] = 1
        return {**b, "input_ids": ids, "target_mask": target}, got.value_target


@dataclasses.dataclass(frozen=True)
class SeenCheck:
    """The host side of the seen-token term (train.seen_check_*, rm_jax.data.seen_tokens): every
    judged response's first ``tokens`` tokens labelled by whether they occur before it."""
    tokens: int
    skip_ids: np.ndarray
    only_ids: np.ndarray | None = None    # the value classes' tokens (train.seen_check_values_only)
    cumulative: bool = False              # train.seen_check_cumulative

    @classmethod
    def from_config(cls, cfg, manifest: dict) -> "SeenCheck | None":
        t = cfg.train
        if not float(t.get("seen_check_weight", 0.0)):
            return None
        if float(t.get("value_check_weight", 0.0)):
            raise ValueError("train.seen_check_weight and train.value_check_weight share the per-position "
                             "loss; set one of them")
        n = int(t.get("seen_check_tokens", 64))
        if n <= 0:
            raise ValueError(f"train.seen_check_tokens={n}: must be > 0")
        special = [manifest.get("pad_id", 0), manifest.get("eos_id", 0), manifest.get("image_pad_id", 0)]
        only = None
        if bool(t.get("seen_check_values_only", False)):
            rows = manifest.get("value_classes")
            if not rows:
                raise ValueError("train.seen_check_values_only: the shards record no value classes; rebuild them")
            only = np.asarray(sorted({int(x) for c in rows for x in c}), np.int32)
        return cls(n, np.asarray(sorted(set(int(x) for x in special)), np.int32), only,
                   bool(t.get("seen_check_cumulative", False)))

    def apply(self, b: dict, step: int, micro_index: int) -> tuple[dict, np.ndarray]:
        del step, micro_index   # the labels are a function of the batch alone
        return b, seen_tokens.seen_targets(b, self.tokens, self.skip_ids, self.only_ids, self.cumulative)


@dataclasses.dataclass(frozen=True)
class HostBatch:
    batch: StepBatch
    n_examples: int
    n_fail: int           # the oversampling ratio, visible in the stream itself


def frame_capacity(cfg, mcfg) -> int:
    """Patches per vision frame slot: the image budget's largest image (one static shape)."""
    from rm_jax.data.images import ImageBudget
    return ImageBudget.from_config(cfg.data.image).max_patches(mcfg.vision.patch_size, mcfg.vision.spatial_merge_size)


def weighted_target_mask(b: dict, verdict_weight: float) -> np.ndarray:
    """The loader's 0/1 target mask, with the verdict token weighted (1.0: the plain token mean).
    The verdict is one token of a few dozen in the target; its weight lets the one token the
    reward reads compete with the reason's tokens for the gradient."""
    mask = b["target_mask"]
    if verdict_weight == 1.0:
        return mask
    mask = mask.astype(np.float32)
    rows = np.flatnonzero(b["example_valid"].astype(bool))
    pos = b["verdict_pos"][rows]
    on_target = mask[rows, pos] > 0          # never turns a non-target token into one
    mask[rows[on_target], pos[on_target]] = verdict_weight
    return mask


def context_mask(b: dict, n_tokens: int, image_token_id: int, passing_only: bool) -> np.ndarray:
    """1.0 on the last ``n_tokens`` prompt tokens before each example's target: the judged
    response and the turn around it (image placeholders excluded, as they are not text).

    Why: a random-init judge must learn to compare a value in the response with the request or
    a tool result before any verdict can depend on it. Predicting the response's own tokens
    (a call's arguments copy the request; a delivery note copies the tool result) trains exactly
    that lookup, on every example, where the verdict gives one bit per example. With
    ``passing_only`` only responses the teacher passed are modelled (no copying of errors)."""
    is_target_bt = b["target_mask"] > 0
    rows_ok_b = is_target_bt.any(1) & b["example_valid"].astype(bool)
    if passing_only:
        rows_ok_b &= b["label"] == 0
    first_b = np.argmax(is_target_bt, axis=1)
    t_1t = np.arange(is_target_bt.shape[1])[None, :]
    mask = ((t_1t >= first_b[:, None] - n_tokens) & (t_1t < first_b[:, None]) & (t_1t >= 1)
            & rows_ok_b[:, None] & (b["input_ids"] != image_token_id))
    return mask.astype(np.float32)


def assemble(mcfg, micro: list[dict], frame_capacity: int,
             weights: TokenWeights = TokenWeights(), value_check: ValueCheck | SeenCheck | None = None,
             step: int = 0) -> HostBatch:
    """Loader batches (numpy) -> one StepBatch with a leading accumulation axis. ``step``: the
    step the batch trains (the swapped-value term's draws are a function of it, for resume)."""
    value_target = None
    if value_check is not None:
        swapped = [value_check.apply(b, step, k) for k, b in enumerate(micro)]
        micro = [b for b, _ in swapped]
        value_target = np.stack([v for _, v in swapped])
    # The loader right-pads, so attention takes per-row key lengths (cuDNN flash on GPU) instead
    # of a [B, T, T] mask; an all-padding row gets length 1 so its softmax stays finite.
    prepared = [registry.prepare_inputs(mcfg, b["input_ids"], b["attention_mask"], b["pixel_values"],
                                         b["image_grid_thw"], attention="lengths", frame_capacity=frame_capacity)
                for b in micro]
    if jax.process_count() > 1:
        prepared = [_with_global_images(mcfg, p, b, frame_capacity) for p, b in zip(prepared, micro)]
    prepared = [p.replace(kv_lengths_b=np.maximum(p.kv_lengths_b, 1)) for p in prepared]
    top = max(int(b["input_ids"].max(initial=0)) for b in micro)
    if top >= mcfg.text.vocab_size:
        raise ValueError(f"token id {top} >= the model's vocab_size {mcfg.text.vocab_size}: the data was "
                         "tokenized with a larger vocabulary than the model has (train.init_from a checkpoint "
                         "whose vocabulary does not cover the data's tokenizer?)")
    inputs = jax.tree.map(lambda *xs: np.stack(xs), *prepared)
    valid = [b["example_valid"].astype(bool) for b in micro]
    ctx = None
    if weights.context_tokens:
        ctx = np.stack([context_mask(b, weights.context_tokens, weights.image_token_id, weights.context_passing_only)
                        for b in micro])
    target = np.stack([weighted_target_mask(b, weights.verdict_weight) for b in micro])
    return HostBatch(StepBatch(inputs=inputs, target_mask=target, context_mask=ctx, value_target=value_target),
                     n_examples=int(sum(v.sum() for v in valid)),
                     n_fail=int(sum((b["label"][v] == 1).sum() for b, v in zip(micro, valid))))


def gather_images(b: dict, merge: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Several processes: the microbatch's images over all of them.

    Returns (pixel_values, image_grid_thw) laid out as the one-process collate lays out the
    whole microbatch (every real patch in process order, then padding; real grid rows, then zero
    rows; the same static shapes), and this process's offset into the merged image features
    (those of the processes before it). Only real rows travel (padded to the largest process's
    count, a power of two so the exchange compiles a few times, not per batch)."""
    pix, grid = b["pixel_values"], b["image_grid_thw"]
    n_rows, n_img = int(grid.prod(-1).sum()), int((grid.prod(-1) > 0).sum())
    counts = distributed.allgather_host(np.array([n_rows, n_img], np.int64))
    pad_rows = loader_lib._next_pow2(int(counts[:, 0].max()), 1)
    pad_img = loader_lib._next_pow2(int(counts[:, 1].max()), 1)
    local_pix = np.zeros((pad_rows, pix.shape[1]), pix.dtype)
    local_pix[:n_rows] = pix[:n_rows]
    local_grid = np.zeros((pad_img, 3), grid.dtype)
    local_grid[:n_img] = grid[:n_img]
    all_pix, all_grid = distributed.allgather_host(local_pix), distributed.allgather_host(local_grid)
    total_rows, total_img = int(counts[:, 0].sum()), int(counts[:, 1].sum())
    if total_rows > pix.shape[0] or total_img > grid.shape[0]:
        raise ValueError(f"the microbatch holds {total_rows} patches / {total_img} images over "
                         f"{len(counts)} processes, over the budget train.max_patches={pix.shape[0]} / "
                         f"train.max_images={grid.shape[0]}; raise them")
    out_pix = np.zeros_like(pix)
    out_grid = np.zeros_like(grid)
    out_pix[:total_rows] = np.concatenate([all_pix[p, :n] for p, n in enumerate(counts[:, 0])])
    out_grid[:total_img] = np.concatenate([all_grid[p, :n] for p, n in enumerate(counts[:, 1])])
    offset = int(counts[:jax.process_index(), 0].sum()) // (merge * merge)
    return out_pix, out_grid, offset


def _with_global_images(mcfg, prepared, b: dict, frame_capacity: int):
    """This process's token arrays, with the whole microbatch's (replicated) vision inputs."""
    from rm_jax.model.vision import vision_inputs
    pix, grid, offset = gather_images(b, mcfg.vision.spatial_merge_size)
    image_index = None
    if prepared.image_index_bt is not None:
        image_index = np.where(prepared.image_index_bt >= 0, prepared.image_index_bt + offset, -1).astype(np.int32)
    return prepared.replace(image_index_bt=image_index, vision=vision_inputs(mcfg.vision, pix, grid, frame_capacity))


class BatchStream:
    """`accumulation` loader batches per step, with the Grain state to checkpoint."""

    def __init__(self, data_dir: str, split: str, cfg: loader_lib.LoaderConfig, accumulation: int,
                 state: dict | None = None):
        self.ds = loader_lib.make_dataset(data_dir, split, cfg)
        self.it = loader_lib.make_iterator(self.ds, state)
        self.accumulation = accumulation

    def next(self) -> list[dict]:
        return [next(self.it) for _ in range(self.accumulation)]

    def state(self) -> dict:
        return self.it.get_state()


def run_length(cfg) -> int:
    """The one sequence length of the run: the smallest bucket that holds every built example
    (both splits), so the step compiles once without padding everything to max_len."""
    longest = max(int(loader_lib.records.load_index(cfg.data.dir, s)["length"].max(initial=0))
                  for s in loader_lib.records.SPLITS)
    return loader_lib.pick_bucket(longest, sorted(int(b) for b in cfg.data.buckets))


def loader_config(cfg, plan: RunPlan, *, split: str) -> loader_lib.LoaderConfig:
    t = cfg.train
    return loader_lib.LoaderConfig(
        batch_size=plan.micro_batch, buckets=(run_length(cfg),), seed=int(cfg.seed), shuffle=split == "train",
        # The run's config decides the stream's fail share (the build's recorded factor is its default).
        oversample_fail=int(cfg.data.oversample_fail), group_by_prompt=bool(cfg.data.group_by_prompt),
        num_epochs=None if split == "train" else 1, drop_remainder=split == "train",
        process_index=jax.process_index(), process_count=jax.process_count(),
        fixed_patches=int(t.max_patches), fixed_images=int(t.max_images))


def run(cfg, workdir: str, *, cluster_line: str = "single process", progress: bool | None = None) -> dict:
    os.makedirs(workdir, exist_ok=True)
    t, data_dir = cfg.train, cfg.data.dir
    if not data_dir or not os.path.isfile(os.path.join(data_dir, "manifest.json")):
        raise FileNotFoundError(f"data.dir={data_dir!r} is not a built shard directory (no manifest.json; "
                                "launch.build_data --out writes one)")
    index = loader_lib.records.load_index(data_dir, "train")
    manifest = loader_lib.read_manifest(data_dir)
    stream_len = len(loader_lib.stream_indices(index["label"], int(cfg.data.oversample_fail)))
    plan = plan_run(t, stream_len)
    has_heldout = len(loader_lib.records.load_index(data_dir, "heldout")["label"]) > 0
    if not has_heldout and int(t.eval_every) > 0:
        logging.warning("%s has no held-out examples: validation loss is skipped (and the sweep will "
                        "have nothing to score); build with more prompts or a larger data.heldout_fraction",
                        data_dir)
    for key in ("log_every", "checkpoint_every", "eval_every"):
        if int(t[key]) < 0:
            raise ValueError(f"train.{key}={t[key]}: must be >= 0 (0 = only at the last step)")
    # refuses shards without value classes early
    value_check = SeenCheck.from_config(cfg, manifest) or ValueCheck.from_config(cfg, manifest)
    if t.init_from:
        adopt_init_config(cfg)
    mesh = make_mesh(cfg.mesh, num_experts=int(cfg.model.text_config.num_experts), global_batch=plan.micro_batch)
    logging.info("%s; mesh %s; plan %s", cluster_line, dict(mesh.shape), plan)

    model, mcfg = build_model(cfg, mesh)
    ocfg = dataclasses.replace(optim.OptimConfig.from_config(t), total_steps=plan.total_steps)
    step_cfg = step_config(cfg, manifest)
    builder = StepBuilder(model, optim.make_optimizer(ocfg, nnx.state(model, nnx.Param)), step_cfg, mesh,
                          optim.schedule(ocfg))
    state = builder.init_state()

    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"),
                        CheckpointOptions(every=int(t.checkpoint_every), max_to_keep=t.get("keep") or None,
                                          async_save=bool(t.async_checkpoint)))
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
    writer = MetricsWriter(workdir, resume_step=start, tensorboard=bool(t.tensorboard)) if primary else None
    if primary:
        _write_manifest(workdir, cfg, manifest, data_dir, mesh, plan)

    capacity, weights = frame_capacity(cfg, mcfg), TokenWeights.from_config(cfg, mcfg)
    verdict = VerdictSlot.from_manifest(manifest)
    first = (assemble(mcfg, stream.next(), capacity, weights, value_check, start)
             if start < plan.total_steps else None)
    if first is not None:
        shardings = builder.batch_shardings(first.batch)
        placed = host_batch_to_device(first.batch, shardings)     # global shapes, for the lowering
        with jax.set_mesh(mesh):
            train = builder.jit_train(state, placed)
            t0 = time.time()
            compiled = train.lower(state, builder.rest, placed).compile()
            logging.info("compiled train step in %.1fs (length %d); memory per device: %s", time.time() - t0,
                         first.batch.target_mask.shape[-1], _memory_line(compiled.memory_analysis()))
    pending = first
    # Processes finish compiling at different times (or one hits the compilation cache); meet
    # before the first collective: CPU (gloo) collectives time out on a peer ~30 s late.
    distributed.sync("train_step_compiled")

    from tqdm import tqdm
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=plan.total_steps, initial=start, desc="train", unit="step", disable=not show)
    last_metrics: dict = {}
    step = start
    t_log, tokens_since, samples_since, fails_since = time.time(), 0, 0, 0
    try:
        while step < plan.total_steps:
            host = (pending if pending is not None
                    else assemble(mcfg, stream.next(), capacity, weights, value_check, step))
            pending = None
            check_target_budget(host.batch.target_mask.reshape(-1, host.batch.target_mask.shape[-1]),
                                int(t.max_target_tokens))
            dev_batch = host_batch_to_device(host.batch, shardings)
            with jax.set_mesh(mesh):
                state, metrics = compiled(state, builder.rest, dev_batch)
            step += 1
            tokens_since += int(host.batch.inputs.attention_mask_bt.sum())
            samples_since += host.n_examples
            fails_since += host.n_fail
            log_now = _due(step, t.log_every, plan.total_steps)
            eval_now = has_heldout and int(t.eval_every) > 0 and _due(step, t.eval_every, plan.total_steps)
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


def data_state_to_save(stream: BatchStream) -> dict:
    """The data iterator state for the checkpoint: this process's, or with several processes all
    of theirs (Orbax writes the JSON item once, from process 0)."""
    states = distributed.allgather_json(stream.state())
    return states[0] if len(states) == 1 else {"process_states": states}


def own_data_state(saved: dict | None) -> dict | None:
    """This process's iterator state from a checkpoint's data item."""
    n_proc = jax.process_count()
    if saved and "process_states" in saved:
        states = saved["process_states"]
        if len(states) != n_proc:
            raise ValueError(f"the checkpoint was written by {len(states)} processes, this run has {n_proc}: "
                             "resume with the same --num_processes")
        return states[jax.process_index()]
    if saved and n_proc > 1:
        raise ValueError(f"the checkpoint was written by one process, this run has {n_proc}: resume with "
                         "the same --num_processes")
    return saved


def _due(step: int, every, last: int) -> bool:
    """Every ``every`` steps and at the last one; 0 = only at the last one (as eval_every=0 is off)."""
    return step == last or (int(every) > 0 and step % int(every) == 0)


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


def evaluate(builder: StepBuilder, cfg, mcfg, state, plan: RunPlan, mesh,
             verdict: VerdictSlot | None = None) -> dict:
    """Held-out validation over ``train.eval_batches`` batches (0 = the whole split):
    ``val_loss`` (token sum / target-token count) and, with ``verdict``, the judge metrics of
    P(pass) read at the verdict slot of the same forward (``val_auc``, ``val_middle_zone``,
    ``val_fail_f1``, ``val_accuracy``, ``val_majority_baseline``, ``val_off_vocab_mass``)."""
    stream = BatchStream(cfg.data.dir, "heldout", loader_config(cfg, plan, split="heldout"), 1)
    total, count = 0.0, 0.0
    first = True
    labels, p_pass, off_vocab = [], [], []
    limit = int(cfg.train.eval_batches)
    for i, micro in enumerate(stream.it):
        if limit and i >= limit:
            break
        batch = assemble(mcfg, [micro], frame_capacity(cfg, mcfg)).batch
        dev = host_batch_to_device(batch, builder.batch_shardings(batch))
        if first and jax.process_count() > 1:    # the eval step compiles on first use, each process at its pace
            fn = builder.jit_eval() if verdict is None else builder.jit_eval_verdict()
            with jax.set_mesh(mesh):
                if verdict is None:
                    fn.lower(state.params, builder.rest, dev).compile()
                else:
                    slot = place(np.zeros(micro["verdict_pos"].shape, np.int32),
                                 NamedSharding(mesh, PartitionSpec(dev.inputs.kv_lengths_b.sharding.spec[1])))
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
        # this process's rows, sharded like the batch's [A, B] arrays without their A axis
        slot_b = place(slot_b, NamedSharding(mesh, PartitionSpec(dev.inputs.kv_lengths_b.sharding.spec[1])))
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
        from rm_jax.eval.metrics import judge_metrics
        jm = judge_metrics(labels, p_pass, off_vocab_mass=off_vocab)
        out.update({f"val_{k}": jm[k] for k in ("auc", "middle_zone", "fail_f1", "accuracy", "majority_baseline")})
        out["val_off_vocab_mass"] = jm["mean_off_vocab_mass"]
    return out


def check_resume_data(workdir: str, data_dir: str) -> None:
    """Refuse to resume a workdir whose checkpoints were trained on other data.

    Resuming restores the data iterator's position, which only means something in the same
    shards; on rebuilt data it would silently continue (or end) a different run."""
    path = os.path.join(workdir, "manifest.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        recorded = json.load(f).get("data_manifest_sha256")
    current = file_sha256(os.path.join(data_dir, "manifest.json"))
    if recorded and recorded != current:
        raise ValueError(f"{workdir} holds checkpoints trained on other data (data manifest sha256 "
                         f"{recorded[:12]}, now {current[:12]} for {data_dir}): resume with the same "
                         f"shards, or train in a new workdir")


def _memory_line(mem) -> str:
    if mem is None:
        return "unavailable on this backend"
    gib = 1 << 30
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    return ", ".join(f"{f.replace('_size_in_bytes', '')} {getattr(mem, f, 0) / gib:.3f} GiB" for f in fields)


def _write_manifest(workdir, cfg, data_manifest, data_dir, mesh, plan) -> None:
    import subprocess
    try:
        code = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        code = None
    out = {"config": cfg.to_dict(), "data_dir": os.path.abspath(data_dir),
           "data_manifest_sha256": file_sha256(os.path.join(data_dir, "manifest.json")),
           "verdict_tokens": data_manifest.get("verdict_tokens"), "code_version": code,
           "packages": package_versions(), "devices": describe_devices(), "mesh": dict(mesh.shape),
           "plan": dataclasses.asdict(plan)}
    with open(os.path.join(workdir, "manifest.json"), "w") as f:
        json.dump(out, f, indent=2, default=str)
