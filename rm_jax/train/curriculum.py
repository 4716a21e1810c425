"""A curriculum for the judge's stream: one failure kind on short inputs first, then everything.

A single failure kind on short inputs forms the comparison a verdict needs within a few hundred
steps; ten kinds mixed from step 0 do not (docs/experiments/issue38-levers.md). With
``train.curriculum_kind`` set, the first ``train.curriculum_steps`` steps draw only from the
training records that pass or fail with that teacher issue and are at most
``train.curriculum_max_len`` tokens long (failures oversampled as in the full stream); after that
the full stream follows from its start, the early kind still in it.

The kind of each record is its sample's ``label.issues``, read from the build's input file (the
shards' manifest names it and its hash, which must still match). The early set is a pure function
of the data and the config, and the loader's order stays a function of (seed, position), so a
resumed run continues the same stream.
"""

from __future__ import annotations

import dataclasses
import json

import grain
import numpy as np

from rm_jax.data import records
from rm_jax.run_config import TrainSection
from rm_jax.utils import file_sha256


@dataclasses.dataclass(frozen=True)
class Curriculum:
    kind: str           # teacher issue code of the early failures
    steps: int          # optimizer steps drawn from the early set
    max_len: int        # longest early input in tokens; 0 = any length

    @classmethod
    def from_config(cls, t: TrainSection) -> "Curriculum | None":
        return cls(t.curriculum_kind, t.curriculum_steps, t.curriculum_max_len) if t.curriculum_kind else None


def record_issues(data_dir: str, split: str) -> list[tuple[str, ...]]:
    """The teacher issues of each record of ``split``, in the loader's record order."""
    manifest_path = f"{data_dir}/manifest.json"
    with open(manifest_path) as f:
        manifest = json.load(f)
    input_path = manifest["input"]
    if file_sha256(input_path) != manifest["input_sha256"]:
        raise ValueError(f"train.curriculum_kind: {input_path} changed since the shards in {data_dir} were built "
                         "(its hash differs from the manifest's); rebuild them with launch.build_data")
    issues: dict[str, tuple[str, ...]] = {}
    with open(input_path) as f:
        for line in f:
            if line.strip():
                sample = json.loads(line)
                issues[sample["id"]] = tuple(sample["label"]["issues"] or ())
    source = grain.sources.ArrayRecordDataSource(records.shard_paths(data_dir, split))
    return [issues[records.decode(source[i])["id"]] for i in range(len(source))]


def early_records(data_dir: str, curriculum: Curriculum) -> tuple[int, ...]:
    """Training records of the early set: passes and ``kind`` failures, at most ``max_len`` long."""
    index = records.load_index(data_dir, "train")
    issues = record_issues(data_dir, "train")
    short = index["length"] <= curriculum.max_len if curriculum.max_len else np.ones(len(issues), bool)
    wanted = np.array([label == 0 or curriculum.kind in found for label, found in zip(index["label"], issues)])
    early = np.flatnonzero(short & wanted)
    n_fail = int((index["label"][early] == 1).sum())
    if n_fail == 0:
        kinds = sorted({k for found in issues for k in found})
        raise ValueError(f"train.curriculum_kind={curriculum.kind!r}: no training failure of that kind"
                         f"{f' within {curriculum.max_len} tokens' if curriculum.max_len else ''}; "
                         f"the data's kinds: {kinds}")
    return tuple(int(i) for i in early)
