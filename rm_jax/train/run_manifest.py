"""The training workdir's records: ``W/manifest.json`` (the run config, the data it trained on,
code and package versions, devices, mesh and plan) and the check that a resume uses the same data."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess

from rm_jax.run_config import RunConfig
from rm_jax.sharding import describe_devices
from rm_jax.train.data_plan import RunPlan
from rm_jax.utils import file_sha256, package_versions


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


def memory_line(mem) -> str:
    """A compiled step's ``memory_analysis()`` in GiB, for the log."""
    if mem is None:
        return "unavailable on this backend"
    gib = 1 << 30
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    return ", ".join(f"{f.replace('_size_in_bytes', '')} {getattr(mem, f, 0) / gib:.3f} GiB" for f in fields)


def write_manifest(workdir: str, run: RunConfig, data_manifest: dict, mesh, plan: RunPlan) -> None:
    try:
        code = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        code = None
    data_dir = run.data.dir
    out = {"config": run.to_dict(), "data_dir": os.path.abspath(data_dir),
           "data_manifest_sha256": file_sha256(os.path.join(data_dir, "manifest.json")),
           "verdict_tokens": data_manifest.get("verdict_tokens"), "code_version": code,
           "packages": package_versions(), "devices": describe_devices(), "mesh": dict(mesh.shape),
           "plan": dataclasses.asdict(plan)}
    with open(os.path.join(workdir, "manifest.json"), "w") as f:
        json.dump(out, f, indent=2, default=str)
