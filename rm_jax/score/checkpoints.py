"""Load a trained judge from a training workdir: ``load_judge(W, step=None) -> (model, config, step)``.

* **The model comes from the run's own manifest.** ``W/manifest.json`` holds the full run config;
  ``rm_jax.run_config`` parses it and ``model_config`` turns it into the ``ModelConfig`` the trainer used, and
  ``registry.abstract_model`` gives the module tree without allocating anything.
* **Only the params are read.** Training checkpoints hold ``state`` (a ``TrainState``: step, params,
  optimizer state -- twice the params again for Adam) and ``data`` (the Grain iterator). Scoring
  needs the params only, so the ``state`` item is restored with Orbax's partial restore into an
  abstract ``{"params": ...}`` tree; the optimizer state is never read into memory.
* **Straight into sharded arrays.** Every abstract param carries the ``NamedSharding`` its logical
  names ask for on the mesh (the training mesh from the config by default), so each device reads
  only its shards.
* **Which step.** An explicit ``step``; else the sweep's chosen step (``W/sweep.json`` ->
  ``chosen.step``: checkpoint selection follows downstream use, not the last step); else the
  latest checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from rm_jax import run_config
from rm_jax.model.interface import JudgeModel
from rm_jax.model.placement import param_shardings
from rm_jax.model.registry import abstract_model
from rm_jax.run_config import RunConfig
from rm_jax.sharding import MeshConfigError, make_mesh


def read_run_config(workdir: str) -> RunConfig:
    """The run config a training workdir recorded in its manifest, parsed (``rm_jax.run_config``)."""
    path = os.path.join(workdir, "manifest.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no training manifest (is {workdir} a launch.train --workdir?)")
    with open(path) as f:
        manifest = json.load(f)
    if "config" not in manifest:
        raise ValueError(f"{path}: field 'config' is missing")
    try:
        return run_config.parse(manifest["config"])
    except ValueError as e:
        raise ValueError(f"{path}: field 'config': {e}") from None


def run_data_dir(workdir: str) -> str:
    """The run's data directory as an absolute path (the manifest's ``data_dir``; the config keeps
    the path as given on the command line, relative to wherever training was launched)."""
    with open(os.path.join(workdir, "manifest.json")) as f:
        manifest = json.load(f)
    return manifest.get("data_dir") or os.path.abspath(manifest["config"]["data"]["dir"])


def chosen_step(workdir: str) -> int | None:
    """The sweep's chosen step, or None when there is no sweep.json."""
    path = os.path.join(workdir, "sweep.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        sweep = json.load(f)
    try:
        return int(sweep["chosen"]["step"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: field chosen.step is missing or not an integer ({e})") from None


def list_steps(workdir: str) -> list[int]:
    """Complete checkpoint steps of a training workdir, ascending."""
    ckpt_dir = os.path.join(os.path.abspath(workdir), "checkpoints")
    if not os.path.isdir(ckpt_dir):
        return []
    with ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(read_only=True)) as manager:
        return sorted(manager.all_steps())


def scoring_mesh(cfg: RunConfig):
    """The run's mesh over the devices present; when it does not fit them (trained on 8 GPUs,
    scored on 1), data parallelism over whatever is here: the params are resharded on restore."""
    experts = run_config.model_config(cfg).text.num_experts
    try:
        return make_mesh(cfg.mesh, num_experts=experts)
    except MeshConfigError as e:
        logging.warning("the run's mesh %s does not fit these %d device(s) (%s): scoring data-parallel "
                        "over them instead", dataclasses.asdict(cfg.mesh), jax.device_count(), e)
        return make_mesh(None, num_experts=experts)


def load_judge(workdir: str, step: int | None = None, *, mesh=None
               ) -> tuple[JudgeModel, object, int]:
    """Restore a training checkpoint's params into a (sharded) judge. ``mesh`` defaults to the
    run's mesh config over the devices present (``scoring_mesh``)."""
    cfg = read_run_config(workdir)
    mcfg = run_config.model_config(cfg)
    if mesh is None:
        mesh = scoring_mesh(cfg)
    ckpt_dir = os.path.join(os.path.abspath(workdir), "checkpoints")
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir}: no checkpoints")

    model = abstract_model(mcfg)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    shardings = param_shardings(params, mesh)
    target = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                          nnx.to_pure_dict(params), nnx.to_pure_dict(shardings))

    with ocp.CheckpointManager(ckpt_dir) as manager:
        steps = sorted(manager.all_steps())
        if not steps:
            raise FileNotFoundError(f"{ckpt_dir}: no complete checkpoint")
        if step is None:
            step = chosen_step(workdir)
            step = steps[-1] if step is None else step
        if step not in steps:
            raise ValueError(f"{ckpt_dir}: step {step} not found; available steps {steps}")
        # TrainState.params is an nnx.State of Variables: on disk each leaf is {"value": array}.
        item = {"params": jax.tree.map(lambda x: {"value": x}, target)}
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True)))
    values = jax.tree.map(lambda d: d["value"], restored["state"]["params"],
                          is_leaf=lambda d: isinstance(d, dict) and set(d) == {"value"})
    nnx.replace_by_pure_dict(params, values)
    model = nnx.merge(graphdef, params, rest)
    model.cfg, model.mesh = mcfg, mesh
    return model, mcfg, int(step)
