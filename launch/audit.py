"""Robustness audit of a trained judge on labelled (held-out) samples.

  python -m launch.audit --workdir=W [--step=N] --input=FILE --out=DIR [--max_samples=0 --seed=0]

Applies every transform of rm_jax.data.attacks (attacks on failing responses, fact edits of
passing ones, invariance rewrites) and writes DIR/audit.json and DIR/audit.md: per transform n,
mean ΔP(pass) and the flip rate at 0.5 with bootstrap 95% intervals, and the invariance maxima
(batch companions / position, key order, JSON whitespace). Without --step the sweep's chosen step
is audited (else the latest checkpoint).
"""

from __future__ import annotations

from absl import app, flags

from launch.common import define_cluster_flags, quiet_library_info, refuse_multi_process

_WORKDIR = flags.DEFINE_string("workdir", None, "training workdir", required=True)
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default: the sweep's choice, else latest)")
_INPUT = flags.DEFINE_string("input", None, "labelled samples JSONL (held-out)", required=True)
_OUT = flags.DEFINE_string("out", None, "output directory (audit.json, audit.md)", required=True)
_MAX = flags.DEFINE_integer("max_samples", 0, "audit only the first N valid samples (0 = all)")
_BATCH = flags.DEFINE_integer("batch_size", 16, "scoring batch")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the transforms' random choices and of the bootstrap")
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "tokenizer dir (default: the one the training data used)")
_CLUSTER = define_cluster_flags()   # refused: this job runs in one process


def main(argv):
    del argv
    refuse_multi_process("audit", _CLUSTER())
    quiet_library_info()
    from rm_jax.eval.audit import audit_file, format_markdown

    record = audit_file(_WORKDIR.value, _INPUT.value, _OUT.value, step=_STEP.value, max_samples=_MAX.value,
                        batch_size=_BATCH.value, seed=_SEED.value, tokenizer=_TOKENIZER.value)
    print(format_markdown(record))
    print(f"wrote {record['paths']['json']} and {record['paths']['md']}")


if __name__ == "__main__":
    app.run(main)
