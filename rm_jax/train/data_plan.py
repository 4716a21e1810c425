"""The run's data plan: how many steps, the static batch shape, and the Grain streams (with the
iterator state a checkpoint keeps, one per process)."""

from __future__ import annotations

import dataclasses

import jax

from rm_jax.data import loader as loader_lib
from rm_jax.run_config import RunConfig, TrainSection
from rm_jax.train import distributed


@dataclasses.dataclass(frozen=True)
class RunPlan:
    total_steps: int
    micro_batch: int          # global examples per microbatch
    accumulation: int
    steps_per_epoch: float


def plan_run(train: TrainSection, stream_len: int) -> RunPlan:
    """Steps (``train.steps``, else ``train.epochs`` over the stream) and the microbatch size."""
    gb, acc = train.global_batch, train.grad_accum
    per_epoch = stream_len / gb
    steps = train.steps if train.steps > 0 else max(1, int(round(per_epoch * train.epochs)))
    return RunPlan(total_steps=steps, micro_batch=gb // acc, accumulation=acc, steps_per_epoch=per_epoch)


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


def run_length(run: RunConfig) -> int:
    """The one sequence length of the run: the smallest bucket that holds every built example
    (both splits), so the step compiles once without padding everything to max_len."""
    longest = max(int(loader_lib.records.load_index(run.data.dir, s)["length"].max(initial=0))
                  for s in loader_lib.records.SPLITS)
    return loader_lib.pick_bucket(longest, sorted(run.data.buckets))


def loader_config(run: RunConfig, plan: RunPlan, *, split: str) -> loader_lib.LoaderConfig:
    return loader_lib.LoaderConfig(
        batch_size=plan.micro_batch, buckets=(run_length(run),), seed=run.seed, shuffle=split == "train",
        # The run's config decides the stream's fail share (the build's recorded factor is its default).
        oversample_fail=run.data.oversample_fail, group_by_prompt=run.data.group_by_prompt,
        num_epochs=None if split == "train" else 1, drop_remainder=split == "train",
        process_index=jax.process_index(), process_count=jax.process_count(),
        fixed_patches=run.train.max_patches, fixed_images=run.train.max_images)


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
