"""Score the held-out split at every saved checkpoint and choose one for RL use.

  python -m launch.sweep --workdir=W --data=DIR [--decode=true] [--max_samples=0]
      [--calibration=none|prior|temperature] [--robustness_gate=MAX_FLIP] [--robustness_samples=N]

Writes W/sweep.json, W/sweep.md and W/plots/*.png; prints the table, the chosen step and why.
The calibration table (NLL / Brier / ECE of none, prior and temperature on an evaluation half of
the held-out split, T fitted on the other half) is always reported; --calibration=temperature
applies T to the sweep's P(pass) and freezes the chosen step's T in W/calibration.json (what
score/serve --calibration=temperature read). --robustness_samples audits every step's attacks on
that many failing held-out samples (a robustness column); --robustness_gate excludes a step whose
worst attack flips more than MAX_FLIP of the caught failures (off by default).
"""

from __future__ import annotations

from absl import app, flags

from launch.common import define_cluster_flags, define_reward_flags, quiet_library_info, refuse_multi_process

DEFAULT_GATE_SAMPLES = 160

_WORKDIR = flags.DEFINE_string("workdir", None, "training workdir (holds checkpoints/)", required=True)
_DATA = flags.DEFINE_string("data", None, "built shard directory (launch.build_data --out)", required=True)
_DECODE = flags.DEFINE_bool("decode", True, "decode reason/issues/img after the verdict (img corr)")
_MAX = flags.DEFINE_integer("max_samples", 0, "score only the first N held-out samples (0 = all)")
_BATCH = flags.DEFINE_integer("batch_size", 16, "scoring batch")
_AUC_TOL = flags.DEFINE_float("auc_tolerance", 0.015, "selection: AUC within this of the best")
_MIN_MZ = flags.DEFINE_float("min_middle_zone", 0.05, "selection: minimum middle-zone share")
_OBJECTIVE = flags.DEFINE_enum("objective", "fail_f1", ["fail_f1", "auc", "val_loss"], "selection objective")
_CALIBRATION = flags.DEFINE_enum("calibration", "none", ["none", "prior", "temperature"],
                                 "P(pass) calibration applied to the sweep's metrics (temperature: fitted "
                                 "per step on a calibration half of held-out, the chosen one frozen)")
_GATE = flags.DEFINE_float("robustness_gate", None, "exclude steps whose worst attack flip rate exceeds this "
                           "(a fraction, e.g. 0.02; default: no gate)")
_ROB_N = flags.DEFINE_integer("robustness_samples", 0, "failing held-out samples the robustness audit attacks "
                              "per step (0: no audit, or 160 with --robustness_gate)")
_CLUSTER = define_cluster_flags()   # refused: this job runs in one process
_REWARD = define_reward_flags()   # the reward validation of the chosen step


def main(argv):
    del argv
    refuse_multi_process("sweep", _CLUSTER())
    quiet_library_info()
    from rm_jax.eval.selection import SelectionRule
    from rm_jax.eval.sweep import Robustness, run_sweep

    rule = SelectionRule(auc_tolerance=_AUC_TOL.value, min_middle_zone=_MIN_MZ.value, objective=_OBJECTIVE.value)
    n_audit = _ROB_N.value or (DEFAULT_GATE_SAMPLES if _GATE.value is not None else 0)
    out = run_sweep(_WORKDIR.value, _DATA.value, rule=rule, decode=_DECODE.value, max_samples=_MAX.value,
                    batch_size=_BATCH.value, progress=True, reward=_REWARD(), calibration=_CALIBRATION.value,
                    robustness=Robustness(samples=n_audit, gate=_GATE.value))
    with open(f"{_WORKDIR.value}/sweep.md") as f:
        print(f.read())
    print(f"chosen step {out['chosen']['step']}: {out['chosen']['reason']}")


if __name__ == "__main__":
    app.run(main)
