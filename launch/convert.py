"""Convert between a transformers Qwen3-VL-MoE checkpoint and an rm_jax Orbax checkpoint.

    python -m launch.convert --hf_dir=D --out=C                 # HF safetensors -> Orbax (C)
    python -m launch.convert --to_hf --ckpt=C --out=D           # Orbax (C) -> HF safetensors (D)
    python -m launch.convert --to_hf --ckpt=C --hf_dir=D        # same
    python -m launch.convert --to_hf --hf_dir=D --out=C         # same, flags read symmetrically
    python -m launch.convert --to_hf --ckpt=W [--step=N] --out=D  # a trained judge (launch.train --workdir=W)

``--ckpt`` with ``--to_hf`` takes a checkpoint written here, a training workdir (the step is
``--step``, else the sweep's chosen step, else the latest), or one of its ``checkpoints/N`` dirs.
A trained judge is exported with its run's tokenizer and image processor files, so the HF dir
is complete.

An Orbax checkpoint dir holds ``state/`` (the NNX param tree, saved with Orbax's
StandardCheckpointer) and ``config.json`` (the HF config, so the model can be rebuilt without the
source dir) plus ``rm_jax.json`` (the on-disk expert layout and dtype of the source, so export
reproduces the source bit for bit). The mesh flags shard the load (one safetensors file at a time
into sharded arrays); with none, everything lives on the default device.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from absl import app, flags, logging
from flax import nnx

from rm_jax.model.config import RuntimeOptions
from rm_jax.model.convert import load_hf, save_hf
from rm_jax.model.placement import param_shardings
from rm_jax.model.registry import abstract_model, config_from_hf_dict
from rm_jax.score.checkpoints import load_judge, run_data_dir
from rm_jax.sharding import MeshShape, make_mesh

flags.DEFINE_string("hf_dir", None, "transformers checkpoint dir (input, or output with --to_hf and no --ckpt)")
flags.DEFINE_string("out", None, "output dir (Orbax checkpoint; HF dir with --to_hf --ckpt)")
flags.DEFINE_string("ckpt", None, "with --to_hf: a launch.convert Orbax dir, a training workdir or W/checkpoints/N")
flags.DEFINE_integer("step", None, "with --to_hf and a training workdir: the step (default: the sweep's choice, else the latest)")
flags.DEFINE_bool("to_hf", False, "convert an Orbax checkpoint back to HF safetensors")
flags.DEFINE_string("dtype", "float32", "param dtype to load/export (float32 | bfloat16)")
flags.DEFINE_enum("expert_layout", None, ["published", "transformers", "in_out", "out_in"],
                  "fused-expert on-disk layout; required only when hidden_size == 2*moe_intermediate_size")
flags.DEFINE_integer("mesh_data", 1, "mesh data axis")
flags.DEFINE_integer("mesh_fsdp", 1, "mesh fsdp axis")
flags.DEFINE_integer("mesh_expert", 1, "mesh expert axis")
flags.DEFINE_integer("mesh_tensor", 1, "mesh tensor axis")


def _mesh():
    shape = MeshShape(flags.FLAGS.mesh_data, flags.FLAGS.mesh_fsdp, flags.FLAGS.mesh_expert, flags.FLAGS.mesh_tensor)
    # A mesh smaller than the host uses its first devices; size 1 means no mesh at all.
    return make_mesh(shape, devices=jax.devices()[:shape.size]) if shape.size > 1 else None


def hf_to_orbax(hf_dir, out, *, dtype="float32", expert_layout=None, mesh=None) -> Path:
    model, cfg = load_hf(hf_dir, dtype=dtype, mesh=mesh, expert_layout=expert_layout)
    out = Path(out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out / "state", nnx.to_pure_dict(nnx.state(model, nnx.Param)), force=True)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    (out / "rm_jax.json").write_text(json.dumps({"expert_layout": cfg.hf_expert_layout, "dtype": dtype,
                                                 "tensor_dtypes": cfg.hf_tensor_dtypes,
                                                 "source": str(hf_dir)}, indent=2))
    return out


def orbax_to_model(ckpt, *, mesh=None):
    """Rebuild the NNX model from an Orbax checkpoint written by ``hf_to_orbax``."""
    ckpt = Path(ckpt).absolute()
    meta = json.loads((ckpt / "rm_jax.json").read_text())
    runtime = RuntimeOptions(dtype=meta["dtype"], param_dtype=meta["dtype"])
    cfg = config_from_hf_dict(json.loads((ckpt / "config.json").read_text()), runtime)
    cfg = dataclasses.replace(cfg, hf_expert_layout=meta.get("expert_layout"),
                              hf_tensor_dtypes=meta.get("tensor_dtypes"))
    model = abstract_model(cfg)
    graphdef, params = nnx.split(model, nnx.Param)
    if mesh is not None:
        shardings = param_shardings(params, mesh)
        target = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                              nnx.to_pure_dict(params), nnx.to_pure_dict(shardings))
    else:
        target = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(params))
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(ckpt / "state", target)
    nnx.replace_by_pure_dict(params, restored)
    model = nnx.merge(graphdef, params)
    model.cfg, model.mesh = cfg, mesh
    return model, cfg


def _training_run(ckpt: Path, step: int | None) -> tuple[Path, int | None] | None:
    """(workdir, step) when ``ckpt`` is a training workdir or one of its ``checkpoints/N``."""
    if (ckpt / "manifest.json").is_file() and (ckpt / "checkpoints").is_dir():
        return ckpt, step
    if ckpt.parent.name == "checkpoints" and ckpt.name.isdigit() and (ckpt.parent.parent / "manifest.json").is_file():
        if step is not None and step != int(ckpt.name):
            raise app.UsageError(f"--step={step} contradicts the checkpoint dir {ckpt}")
        return ckpt.parent.parent, int(ckpt.name)
    return None


def _copy_tokenizer(workdir: Path, out: Path) -> None:
    """The run's tokenizer + image processor files next to the exported weights."""
    data_manifest = Path(run_data_dir(str(workdir))) / "manifest.json"
    tok_dir = Path(json.loads(data_manifest.read_text()).get("tokenizer_dir", "")) if data_manifest.is_file() else None
    if tok_dir is None or not tok_dir.is_dir():
        logging.warning("the run's tokenizer was not found (data manifest %s): exported weights and config only",
                        data_manifest)
        return
    for src in tok_dir.iterdir():
        if src.is_file() and src.name != "config.json":
            shutil.copy2(src, out / src.name)


def orbax_to_hf(ckpt, out, *, dtype=None, expert_layout=None, step: int | None = None) -> Path:
    ckpt = Path(ckpt).absolute()
    run = _training_run(ckpt, step)
    if run is not None:
        model, _, used = load_judge(str(run[0]), run[1])
        path = save_hf(model, out, dtype=dtype, expert_layout=expert_layout)
        _copy_tokenizer(run[0], path)
        logging.info("exported the judge of %s at step %d", run[0], used)
        return path
    if not (ckpt / "rm_jax.json").is_file():
        raise FileNotFoundError(f"{ckpt}: neither a launch.convert Orbax checkpoint (no rm_jax.json) nor a "
                                f"training workdir (no manifest.json + checkpoints/) nor W/checkpoints/N")
    model, _ = orbax_to_model(ckpt)
    return save_hf(model, out, dtype=dtype, expert_layout=expert_layout)


def main(argv):
    del argv
    f = flags.FLAGS
    if f.to_hf:
        if f.ckpt:
            if f.out and f.hf_dir:
                raise app.UsageError("--to_hf --ckpt=C: give the HF output dir once, as --out=D or --hf_dir=D")
            src, dst = f.ckpt, f.out or f.hf_dir
        else:
            src, dst = f.out, f.hf_dir
        if not src or not dst:
            raise app.UsageError("--to_hf needs --ckpt=C --out=D (or --out=C --hf_dir=D)")
        path = orbax_to_hf(src, dst, dtype=None, expert_layout=f.expert_layout, step=f.step)
        logging.info("single process; wrote HF checkpoint %s from %s", path, src)
    else:
        if not f.hf_dir or not f.out:
            raise app.UsageError("--hf_dir=D --out=C are required")
        path = hf_to_orbax(f.hf_dir, f.out, dtype=f.dtype, expert_layout=f.expert_layout, mesh=_mesh())
        logging.info("single process; wrote Orbax checkpoint %s from %s", path, f.hf_dir)
    print(path)


if __name__ == "__main__":
    app.run(main)
