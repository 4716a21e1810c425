"""A run's calibration on disk: the label shares its ``prior`` reads (from the run's manifest and
split indexes) and the temperature its sweep freezes in ``W/calibration.json``. The arithmetic is
``rm_jax.calibration``; this module only reads and writes what a run recorded.
"""

from __future__ import annotations

import json
import os

from rm_jax.calibration import IDENTITY, METHODS, Calibration, prior_shift
from rm_jax.data import records
from rm_jax.score.checkpoints import read_run_config, run_data_dir

CALIBRATION_FILE = "calibration.json"


def label_shares(data_dir: str, oversample_fail: int) -> dict:
    """Fail shares of a run's training stream (each failure ``oversample_fail`` times) and of its
    held-out split, from the build's split indexes."""
    train = records.load_index(data_dir, "train")["label"]
    held = records.load_index(data_dir, "heldout")["label"]
    n_fail, n_pass = int((train == 1).sum()), int((train == 0).sum())
    k = max(1, int(oversample_fail))
    if not len(held) or n_fail + n_pass == 0:
        raise ValueError(f"{data_dir}: the prior calibration needs a non-empty train and held-out split")
    return {"oversample_fail": k, "train_stream_fail_share": n_fail * k / (n_pass + n_fail * k),
            "heldout_fail_share": float((held == 1).mean())}


def run_label_shares(workdir: str) -> dict:
    """``label_shares`` of a training workdir, from what its manifest records (the run config's
    ``data.oversample_fail`` and its data directory)."""
    cfg = read_run_config(workdir)
    return label_shares(run_data_dir(workdir), int(cfg.data.oversample_fail))


def calibration_path(workdir: str) -> str:
    return os.path.join(workdir, CALIBRATION_FILE)


def save_temperature(workdir: str, temperature: float, *, step: int, n: int) -> str:
    path = calibration_path(workdir)
    with open(path, "w") as f:
        json.dump({"method": "temperature", "temperature": float(temperature), "step": int(step),
                   "n_calibration": int(n)}, f, indent=2)
    return path


def load_calibration(workdir: str, method: str) -> Calibration:
    """The calibration ``method`` of a run: ``prior`` from its manifest, ``temperature`` frozen by
    its sweep (``W/calibration.json``)."""
    if method == "none":
        return IDENTITY
    if method == "prior":
        return Calibration("prior", shift=prior_shift(run_label_shares(workdir)))
    if method == "temperature":
        path = calibration_path(workdir)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no fitted temperature; run launch.sweep --workdir={workdir} "
                                    f"--calibration=temperature first")
        with open(path) as f:
            rec = json.load(f)
        if "temperature" not in rec:
            raise ValueError(f"{path}: field 'temperature' is missing")
        return Calibration("temperature", temperature=float(rec["temperature"]))
    raise ValueError(f"--calibration={method!r} is not one of {METHODS}")
