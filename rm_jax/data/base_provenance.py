"""Where a pretrained tiny base came from, and the check that it still matches the generator.

A base LM is trained once (launch.pretrain_base) on the synthetic generator's conversations and
committed with ``base.json``. If the generator changes afterwards, the base has learned another
distribution (other value pools, other phrasings) and every figure measured on top of it would
silently mix the two, so consumers (launch.demo) refuse a base whose recorded generator hash
differs from the generator's source today.
"""

from __future__ import annotations

import dataclasses
import json
import os

from rm_jax.utils import file_sha256

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The generator of every synthetic conversation (its pools, templates and failure kinds).
GENERATOR_SOURCE = os.path.join(PACKAGE_ROOT, "data", "synth.py")
PROVENANCE_FILE = "base.json"
PRETRAIN_COMMAND = "python -m launch.pretrain_base"


def generator_sha256() -> str:
    return file_sha256(GENERATOR_SOURCE)


@dataclasses.dataclass(frozen=True)
class BaseProvenance:
    generator_sha256: str        # rm_jax/data/synth.py when the base's data was generated
    data_seed: int               # launch.synth seed of the base's corpus
    samples: int                 # samples generated
    excluded_heldout: int        # of those, dropped for sharing a request with the demo's held-out prompts
    examples: dict               # build stats of the LM examples: read, kept, rejected_by_reason, splits
    steps: int                   # next-token training steps
    train_loss: float            # mean token loss of the last logged step
    heldout_loss: float | None   # mean token loss on the corpus's own held-out prompts
    train_seconds: float
    config_overrides: tuple      # the --config.* flags of the training run

    def write(self, base_dir: str) -> None:
        with open(os.path.join(base_dir, PROVENANCE_FILE), "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=2)
            f.write("\n")

    @classmethod
    def read(cls, base_dir: str) -> "BaseProvenance":
        path = os.path.join(base_dir, PROVENANCE_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: not a pretrained base (no {PROVENANCE_FILE}; {PRETRAIN_COMMAND} "
                                    "writes one)")
        with open(path) as f:
            raw = json.load(f)
        return cls(**{**raw, "config_overrides": tuple(raw["config_overrides"])})


class StaleBaseError(ValueError):
    pass


def check_base(base_dir: str) -> BaseProvenance:
    """The base's provenance, or StaleBaseError when the generator changed since it was trained."""
    prov = BaseProvenance.read(base_dir)
    now = generator_sha256()
    if prov.generator_sha256 != now:
        raise StaleBaseError(
            f"{base_dir} was pretrained on data from another version of the generator "
            f"({os.path.relpath(GENERATOR_SOURCE, os.path.dirname(PACKAGE_ROOT))} sha256 {prov.generator_sha256[:12]} "
            f"then, {now[:12]} now): retrain it with `{PRETRAIN_COMMAND} --out={base_dir}` (or run without it, "
            "--base='')")
    if not os.path.isfile(os.path.join(base_dir, "hf", "config.json")):
        raise FileNotFoundError(f"{base_dir}/hf/config.json: missing (a base holds its HF checkpoint in hf/)")
    return prov
