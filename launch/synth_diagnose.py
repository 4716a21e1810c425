"""How far a pure copy-match detector gets on a synthetic data set, per teacher issue.

    python -m launch.synth_diagnose --input=DIR/samples.jsonl

score = the share of the response's pool values (colour, shape, resolution, aspect ratio, count)
that also occur in the conversation before it; a value absent from the conversation is the
simplest evidence of a failure a judge can use. Printed twice: against the conversation alone,
and against the conversation plus the listed tool schemas (what the judge reads). A gap between
the two means the schemas hand the judge distractors (an enum naming every value of its pool).
Fails rank first: AUC 0.5 is no signal.
"""

from __future__ import annotations

from absl import app, flags

from rm_jax.eval.presence import read_presence_aucs

_INPUT = flags.DEFINE_string("input", None, "samples JSONL (launch.synth --out=DIR: DIR/samples.jsonl)", required=True)


def main(argv):
    del argv
    r = read_presence_aucs(_INPUT.value)
    print(f"all ({r['n']}): AUC conversation {r['conversation']:.3f}  conversation+schemas {r['with_schemas']:.3f}")
    for kind, k in r["by_issue"].items():
        print(f"  {kind:36s} n={k['n']:5d}  conversation {k['conversation']:.3f}  "
              f"conversation+schemas {k['with_schemas']:.3f}")


if __name__ == "__main__":
    app.run(main)
