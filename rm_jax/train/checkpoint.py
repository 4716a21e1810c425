"""Orbax checkpoints of the train state plus the Grain iterator state, with exact resume.

* One `CheckpointManager` per workdir, fixed save interval, async saves (the step loop does not
  wait on disk). Every checkpoint is kept by default: the sweep scores all of them, and the
  report's best checkpoint (step 900) was not the last or the lowest-loss one.
* The data iterator state (Grain's `get_state()`, a small JSON) is saved in the same checkpoint,
  so model and data can never disagree about where the run is.
* Restore goes into an *abstract* tree (`jax.ShapeDtypeStruct`s carrying the target shardings):
  each host reads only its shards, straight into sharded device arrays.
* A damaged latest checkpoint (a kill during a non-atomic copy, a truncated file) is detected
  when it fails to restore; we fall back to the previous step and say so. Orbax's own atomic
  rename already hides checkpoints whose save never finished.
* Several processes: every process calls save and restore (Orbax writes each array's shards from
  the process that holds them and the JSON item from process 0, and synchronizes the commit);
  the data item holds every process's iterator state (`data_plan.data_state_to_save`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    every: int = 100
    max_to_keep: int | None = None     # None = keep all (the sweep needs them)
    async_save: bool = True


@dataclasses.dataclass
class Restored:
    step: int
    state: Any
    data_state: dict | None
    skipped: list[int]                 # damaged steps passed over, newest first


def abstract_like(tree) -> Any:
    """ShapeDtypeStructs with the shardings of `tree` (restore target, no memory)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


class Checkpointer:
    def __init__(self, directory: str, opts: CheckpointOptions):
        self.directory = os.path.abspath(directory)
        self.opts = opts
        self.manager = ocp.CheckpointManager(
            self.directory,
            # The loop decides when to save (every K steps, and at the end); Orbax just writes.
            options=ocp.CheckpointManagerOptions(
                save_interval_steps=1, max_to_keep=opts.max_to_keep,
                enable_async_checkpointing=opts.async_save, cleanup_tmp_directories=True))

    def save(self, step: int, state, data_state: dict | None) -> bool:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=ocp.args.JsonSave(data_state if data_state is not None else {}))
        return self.manager.save(step, args=args, force=True)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore(self, abstract_state, step: int | None = None) -> Restored | None:
        """The given step, or the newest restorable one (falling back past damaged ones)."""
        candidates = [step] if step is not None else sorted(self.steps(), reverse=True)
        skipped: list[int] = []
        for s in candidates:
            try:
                got = self.manager.restore(s, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
            except Exception as e:  # noqa: BLE001 - any failure to read means "damaged"
                if step is not None:
                    raise
                logging.warning("checkpoint step %d in %s is damaged (%s: %s); falling back to the previous one",
                                s, self.directory, type(e).__name__, str(e)[:300])
                skipped.append(s)
                continue
            if skipped:
                self._quarantine(skipped)
                logging.warning("resumed from step %d after skipping damaged checkpoints %s (moved to %s)",
                                s, skipped, self._damaged_dir)
            return Restored(step=s, state=got["state"], data_state=got["data"] or None, skipped=skipped)
        if skipped:
            # Nothing restorable: set them all aside, so the fresh run can write those steps again.
            self._quarantine(skipped)
            logging.error("every checkpoint in %s is damaged (%s, moved to %s): starting from step 0",
                          self.directory, skipped, self._damaged_dir)
        return None

    @property
    def _damaged_dir(self) -> str:
        return self.directory + "_damaged"

    def _quarantine(self, steps: list[int]) -> None:
        """Move damaged steps aside (never delete them): the run will write those steps again."""
        from rm_jax.train import distributed
        if distributed.is_primary():     # one process moves the shared directories
            os.makedirs(self._damaged_dir, exist_ok=True)
            for s in steps:
                src = os.path.join(self.directory, str(s))
                if os.path.isdir(src):
                    os.replace(src, os.path.join(self._damaged_dir, f"{s}.{int(time.time())}"))
        distributed.sync("checkpoint_quarantine")
        self.manager.reload()

    def wait(self) -> None:
        """Block until async saves are on disk; re-raises a background writer's exception."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
