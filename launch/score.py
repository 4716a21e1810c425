"""Score samples with a trained judge: P(pass) at the verdict slot, decoded reason/issues/img,
rule checks and the composite reward.

  python -m launch.score --workdir=W [--step=N] --input=FILE --out=FILE [--calibration=none|prior|temperature]

One JSONL line per input row: id, p_pass, verdict, reason, issues, img, parse_ok, rule_score,
components, reward — or {id, error} for a row that cannot be scored (the rest are scored).
Without --step the sweep's chosen step is used (else the latest checkpoint).
"""

from __future__ import annotations

from absl import app, flags

from launch.common import define_cluster_flags, define_reward_flags, quiet_library_info, refuse_multi_process

_WORKDIR = flags.DEFINE_string("workdir", None, "training workdir", required=True)
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default: the sweep's choice, else latest)")
_INPUT = flags.DEFINE_string("input", None, "samples JSONL (labels optional)", required=True)
_OUT = flags.DEFINE_string("out", None, "output JSONL", required=True)
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "tokenizer dir (default: the one the training data used)")
_BATCH = flags.DEFINE_integer("batch_size", 16, "scoring batch")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "decoding budget after the verdict")
_CALIBRATION = flags.DEFINE_enum("calibration", "none", ["none", "prior", "temperature"],
                                 "P(pass) calibration: none (the field report's reward), prior (undo the training "
                                 "stream's failure oversampling), temperature (fitted by launch.sweep)")
_CLUSTER = define_cluster_flags()   # refused: this job runs in one process
_REWARD = define_reward_flags()


def main(argv):
    del argv
    refuse_multi_process("score", _CLUSTER())
    quiet_library_info()
    from rm_jax.score.calibration_files import load_calibration
    from rm_jax.score.run import score_file

    summary = score_file(_WORKDIR.value, _INPUT.value, _OUT.value, step=_STEP.value, tokenizer=_TOKENIZER.value,
                         batch_size=_BATCH.value, max_new_tokens=_MAX_NEW.value, reward=_REWARD(),
                         calibration=load_calibration(_WORKDIR.value, _CALIBRATION.value))
    print(summary)


if __name__ == "__main__":
    app.run(main)
