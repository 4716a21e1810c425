"""Where training metrics go: W/metrics.jsonl (one line per logged step) and TensorBoard events.

The JSONL file is the contract other tools read (`step`, `loss`, ...); TensorBoard is for
people. On resume the JSONL is truncated to the restored step, so a resumed run's file is the
uninterrupted run's file: no duplicated or orphaned steps after a crash.
"""

from __future__ import annotations

import json
import math
import os


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsWriter:
    def __init__(self, workdir: str, *, resume_step: int = 0, tensorboard: bool = True):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._truncate_after(resume_step)
        self._f = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1)

    def _truncate_after(self, step: int) -> None:
        if not os.path.exists(self.path):
            return
        keep = [json.dumps(row) + "\n" for row in _parse_rows(self.path) if row.get("step", 0) <= step]
        with open(self.path, "w") as f:
            f.writelines(keep)

    def write(self, step: int, metrics: dict) -> None:
        row = {"step": int(step), **{k: _clean(float(v)) if not isinstance(v, (str, list, dict)) else v
                                     for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
    """W/metrics.jsonl as a list of rows ([] when the file does not exist yet)."""
    path = os.path.join(workdir, "metrics.jsonl")
    return _parse_rows(path) if os.path.exists(path) else []


def _parse_rows(path: str) -> list[dict]:
    """The file's rows. A kill mid-write can leave the *last* line torn: it is dropped (the step
    it logged is re-run after resume); an unparsable line anywhere else is corruption and raises."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON ({e.msg})") from None
    return rows
