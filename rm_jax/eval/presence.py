"""The presence rule: how far a pure copy-match detector gets on a synthetic data set.

score = the share of the judged response's pool values (colour, shape, resolution, aspect ratio,
count) that also occur in the conversation before it; a value absent from the conversation is the
simplest evidence of a failure a judge can use. A judge below this rule on a failure kind has not
learned even the lookup. Fails rank first: AUC 0.5 is no signal.
"""

from __future__ import annotations

import collections
import json
import re
from typing import Iterable

import numpy as np

from rm_jax.data import synth
from rm_jax.metrics import safe_auc

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


def presence_aucs(samples: Iterable[dict]) -> dict:
    """The rule's AUC over the samples and per first teacher issue (that kind's fails against every
    pass), against the conversation alone and with the listed tool schemas (what the judge reads):
    {"n", "conversation", "with_schemas", "by_issue": {kind: {"n", "conversation", "with_schemas"}}}."""
    rows = []
    for s in samples:
        lab = s["label"]
        rows.append((lab["l3"] == "fail", (lab["issues"] or ["pass"])[0], *copy_match(s)))
    y = np.array([r[0] for r in rows])
    kind = np.array([r[1] for r in rows])
    conv, listed = (np.array([r[i] for r in rows]) for i in (2, 3))
    out = {"n": len(rows), "conversation": safe_auc(y, -conv), "with_schemas": safe_auc(y, -listed), "by_issue": {}}
    for k, n in collections.Counter(kind.tolist()).most_common():
        if k == "pass":
            continue
        m = (kind == k) | (kind == "pass")
        out["by_issue"][k] = {"n": n, "conversation": safe_auc(y[m], -conv[m]),
                              "with_schemas": safe_auc(y[m], -listed[m])}
    return out


def read_presence_aucs(samples_path: str) -> dict:
    """``presence_aucs`` of a samples JSONL (launch.synth --out=DIR: DIR/samples.jsonl)."""
    with open(samples_path) as f:
        return presence_aucs(json.loads(line) for line in f if line.strip())
