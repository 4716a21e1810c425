"""The shortcut baseline: can labels be predicted from surface form alone?

A logistic regression sees only length and format features of the judged response — never its
meaning, the conversation, the tools or the images — and is scored by ROC-AUC for "fail" on a
held-out split. On sound data it should sit near 0.5: whether a tool call is right depends on
the request, not on how long or how escaped it is. A clearly higher AUC means the labels leak
through form (e.g. every failing response is a double-encoded JSON string, or longer), and the
judge would learn the shortcut instead of the task — its own AUC would then be inflated by the
same amount. `feature_auc` names the leaking feature: each single feature's held-out AUC.

The split must be grouped by prompt_id by the caller (docs/contracts.md, prompt_id) — the build step's split is.
"""

from __future__ import annotations

import json
import math
import string
from typing import Sequence

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from rm_jax.metrics import fail_indicator, safe_auc

FEATURES = ("chars", "words", "n_tool_calls", "has_text", "digits", "punctuation",
            "max_encode_depth", "newlines")
_PUNCT = frozenset(string.punctuation)


def response_surface_text(response) -> str:
    """Everything the response writes, as one string: its text, then each call's name and arguments
    (as they were decoded — the encoding depth is its own feature)."""
    pieces = [response.content or ""]
    for call in response.tool_calls:
        args = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments, ensure_ascii=False)
        pieces.append(f"{call.name} {args}")
    return "\n".join(p for p in pieces if p)


def surface_features(response) -> list[float]:
    """The FEATURES of one `schema.Response`, in order."""
    text = response_surface_text(response)
    return [
        float(len(text)),
        float(len(text.split())),
        float(len(response.tool_calls)),
        float(bool((response.content or "").strip())),
        float(sum(c.isdigit() for c in text)),
        float(sum(c in _PUNCT for c in text)),
        float(max((c.encode_depth for c in response.tool_calls), default=0)),
        float(text.count("\n")),
    ]


def _matrix(samples: Sequence, split: str) -> tuple[np.ndarray, np.ndarray]:
    unlabelled = [s.id for s in samples if s.label is None]
    if unlabelled:
        raise ValueError(f"{split} split: samples without a label: {unlabelled[:5]}")
    x = np.array([surface_features(s.response) for s in samples], dtype=np.float64).reshape(-1, len(FEATURES))
    y = fail_indicator([s.label.l3 for s in samples])
    return x, y


def without_rule_violations(samples: Sequence) -> tuple[list, int]:
    """The samples whose response breaks no reward rule, and how many were set aside. A malformed
    or duplicate call is a form the rules catch without a judge, so it is no shortcut the judge
    could learn instead of the task; the baseline asks about the rest."""
    from rm_jax.score.rules import rule_check
    kept = [s for s in samples if not rule_check(s).violations]
    return kept, len(samples) - len(kept)


def shortcut_baseline(train_samples: Sequence, heldout_samples: Sequence, *, seed: int = 0) -> dict:
    """Fit on train, ROC-AUC (fail positive) on held-out, over the samples without rule
    violations. NaN AUC when a split has one class."""
    train_samples, n_rule_train = without_rule_violations(train_samples)
    heldout_samples, n_rule_held = without_rule_violations(heldout_samples)
    x_train, y_train = _matrix(train_samples, "train")
    x_held, y_held = _matrix(heldout_samples, "heldout")
    result = {"auc": math.nan, "n_train": int(len(y_train)), "n_heldout": int(len(y_held)),
              "n_fail_train": int(y_train.sum()), "n_fail_heldout": int(y_held.sum()),
              "features": list(FEATURES), "coefficients": None, "feature_auc": None,
              "excluded_rule_violations": {"train": n_rule_train, "heldout": n_rule_held}}
    if len(np.unique(y_train)) < 2 or len(y_held) == 0:
        result["note"] = "not fitted: train split has one class or held-out split is empty"
        return result
    # Scaled so the coefficients are comparable; balanced because fails are rare (~8 %).
    model = make_pipeline(StandardScaler(), LogisticRegression(class_weight="balanced", max_iter=1000,
                                                               random_state=seed))
    model.fit(x_train, y_train)
    fail_col = list(model.classes_).index(1)
    result["auc"] = safe_auc(y_held, model.predict_proba(x_held)[:, fail_col])
    result["coefficients"] = dict(zip(FEATURES, map(float, model[-1].coef_[0])))
    result["feature_auc"] = {name: safe_auc(y_held, x_held[:, j]) for j, name in enumerate(FEATURES)}
    return result
