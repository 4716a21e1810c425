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

import collections
import json
import re

import numpy as np
from absl import app, flags

from rm_jax.data import synth
from rm_jax.eval.metrics import safe_auc

_INPUT = flags.DEFINE_string("input", None, "samples JSONL (launch.synth --out=DIR: DIR/samples.jsonl)", required=True)

POOL_VALUES = (set(synth.COLOURS) | set(synth.SHAPES) | set(synth.RESOLUTIONS) | set(synth.ASPECTS)
               | {str(c) for c in synth.COUNTS})
_WORD = re.compile(r"\d+:\d+|\d+K|[a-z]+|\d+")


def _words(value) -> list[str]:
    return _WORD.findall(json.dumps(value).lower().replace('\\"', '"'))


def copy_match(sample: dict) -> tuple[float, float]:
    """(share of response values seen in the conversation, ... in the conversation or schemas)."""
    # Every turn but a system prompt: the user's request carries the values a call must copy.
    conv = set(_words([m["content"] for m in sample["messages"] if m["role"] != "system"]))
    listed = conv | set(_words(sample["tools"]))
    resp = sample["response"]
    values = [w for w in _words([resp["content"], [c["function"]["arguments"] for c in resp["tool_calls"]]])
              if w in POOL_VALUES]
    if not values:
        return 1.0, 1.0
    return float(np.mean([w in conv for w in values])), float(np.mean([w in listed for w in values]))


def main(argv):
    del argv
    rows = []
    with open(_INPUT.value) as f:
        for line in f:
            s = json.loads(line)
            lab = s["label"]
            rows.append((lab["l3"] == "fail", (lab["issues"] or ["pass"])[0], *copy_match(s)))
    y = np.array([r[0] for r in rows])
    conv, listed = (np.array([r[i] for r in rows]) for i in (2, 3))
    print(f"all ({len(rows)}): AUC conversation {safe_auc(y, -conv):.3f}  conversation+schemas {safe_auc(y, -listed):.3f}")
    for kind, n in collections.Counter(r[1] for r in rows).most_common():
        if kind == "pass":
            continue
        m = np.array([r[1] in (kind, "pass") for r in rows])
        print(f"  {kind:36s} n={n:5d}  conversation {safe_auc(y[m], -conv[m]):.3f}  "
              f"conversation+schemas {safe_auc(y[m], -listed[m]):.3f}")


if __name__ == "__main__":
    app.run(main)
