"""Reward validation: is the composite reward usable for GRPO? (field report §8–9)

A good judge is not yet a usable reward. Before RL, the whole reward function runs on a labelled
set and three questions are answered:

1. **Does it separate?** Mean total reward, rule part, P(pass) and issue count by teacher label,
   and the separation AUC of the total reward (fail positive, score = -reward). The same AUC for
   the rule part alone shows how much the judge adds (report: rules alone barely separate,
   +0.883 vs +0.633).
2. **Is it continuous?** The number of distinct reward values (report: 102 of 120).
3. **Does every GRPO group get a gradient?** GRPO normalizes rewards within the group of
   responses to one prompt: A = (r - mean) / (std + eps). A group whose rewards are all equal has
   all-zero advantages and contributes nothing. Reported per group: reward span (max - min) and
   advantage span; the count and share of zero-span groups. Groups of one response cannot have
   spread and are counted apart (`singleton_groups`), not as failures.

Input records carry id, prompt_id, label ("pass"/"fail" or 0/1, 1 = fail), reward, rule_score,
p_pass, n_issues, and optionally `slice` (e.g. "tool_call" / "text_only") for a per-slice split.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Mapping, Sequence

import numpy as np

from rm_jax.metrics import fail_indicator, safe_auc, to_jsonable

ADVANTAGE_EPS = 1e-6      # the GRPO normalizer's epsilon
ZERO_SPAN = 1e-9          # spans below this are ties (float noise in equal rewards)
DISTINCT_DECIMALS = 9     # rewards equal to 9 decimals count as one value
REQUIRED = ("id", "prompt_id", "label", "reward", "rule_score", "p_pass", "n_issues")


def _columns(records: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    for i, r in enumerate(records):
        missing = [k for k in REQUIRED if k not in r]
        if missing:
            raise ValueError(f"record {i} (id {r.get('id', '?')}) lacks {missing}")
    cols = {k: np.array([float(r[k]) for r in records], dtype=np.float64)
            for k in ("reward", "rule_score", "p_pass", "n_issues")}
    for k, v in cols.items():
        if not np.isfinite(v).all():
            i = int(np.flatnonzero(~np.isfinite(v))[0])
            raise ValueError(f"record {i} (id {records[i]['id']}): {k} is not finite")
    cols["y_fail"] = fail_indicator([r["label"] for r in records])
    return cols


def _by_label(cols: Mapping[str, np.ndarray], mask: np.ndarray) -> dict:
    out = {}
    for name, value in (("pass", 0), ("fail", 1)):
        m = mask & (cols["y_fail"] == value)
        n = int(m.sum())
        out[name] = {"n": n, **{k: float(cols[k][m].mean()) if n else math.nan
                                for k in ("reward", "rule_score", "p_pass", "n_issues")}}
    return out


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """GRPO's group-normalized advantages (population std, as in the GRPO objective)."""
    return (rewards - rewards.mean()) / (rewards.std() + ADVANTAGE_EPS)


def group_diagnostics(prompt_ids: Sequence[str], rewards: np.ndarray) -> dict:
    groups: dict[str, list[float]] = defaultdict(list)
    for pid, r in zip(prompt_ids, rewards):
        groups[str(pid)].append(float(r))
    reward_spans, adv_spans, zero_span_ids = [], [], []
    singletons = 0
    for pid, values in groups.items():
        if len(values) < 2:
            singletons += 1
            continue
        r = np.asarray(values)
        span = float(r.max() - r.min())
        reward_spans.append(span)
        adv = group_advantages(r)
        adv_spans.append(float(adv.max() - adv.min()))
        if span <= ZERO_SPAN:
            zero_span_ids.append(pid)
    n_multi = len(reward_spans)
    return {
        "n_groups": len(groups),
        "singleton_groups": singletons,
        "groups_with_spread_possible": n_multi,
        "zero_span_groups": len(zero_span_ids),
        "zero_span_share": len(zero_span_ids) / n_multi if n_multi else math.nan,
        "zero_span_prompt_ids": sorted(zero_span_ids)[:20],   # a sample to look at, not all
        "mean_reward_span": float(np.mean(reward_spans)) if n_multi else math.nan,
        "min_reward_span": float(np.min(reward_spans)) if n_multi else math.nan,
        "mean_advantage_span": float(np.mean(adv_spans)) if n_multi else math.nan,
        "min_advantage_span": float(np.min(adv_spans)) if n_multi else math.nan,
    }


def reward_report(records: Sequence[Mapping[str, Any]]) -> dict:
    """The validation report as a JSON-safe dict (NaN -> None)."""
    if not records:
        raise ValueError("reward_report needs at least one record")
    cols = _columns(records)
    everything = np.ones(len(records), dtype=bool)
    report: dict[str, Any] = {
        "n": len(records),
        "n_pass": int((cols["y_fail"] == 0).sum()),
        "n_fail": int(cols["y_fail"].sum()),
        "mean_reward": float(cols["reward"].mean()),
        "min_reward": float(cols["reward"].min()),
        "max_reward": float(cols["reward"].max()),
        "by_label": _by_label(cols, everything),
        # Fail is the positive class, so a good reward ranks fails low: score = -reward.
        "separation_auc_reward": safe_auc(cols["y_fail"], -cols["reward"]),
        "separation_auc_rule": safe_auc(cols["y_fail"], -cols["rule_score"]),
        "distinct_rewards": int(np.unique(np.round(cols["reward"], DISTINCT_DECIMALS)).size),
        "groups": group_diagnostics([r["prompt_id"] for r in records], cols["reward"]),
        "rules": _rule_counts(records, cols),
    }
    slice_names = sorted({str(r["slice"]) for r in records if r.get("slice") is not None})
    if slice_names:
        report["slices"] = {}
        for name in slice_names:
            m = np.array([str(r.get("slice")) == name for r in records])
            report["slices"][name] = {"n": int(m.sum()), "by_label": _by_label(cols, m),
                                      "separation_auc_reward": safe_auc(cols["y_fail"][m], -cols["reward"][m])}
    return to_jsonable(report)


# ---------------------------------------------------------------- markdown


def _rule_counts(records: Sequence[Mapping[str, Any]], cols: Mapping[str, np.ndarray]) -> dict:
    """How often the rules acted, by teacher label: gated (the whole reward is the gate value) or
    penalized (a negative rule part added to the judge terms)."""
    gated = np.array([bool(r.get("gated", False)) for r in records])
    penalized = ~gated & (cols["rule_score"] < 0)
    out = {}
    for name, value in (("pass", 0), ("fail", 1)):
        m = cols["y_fail"] == value
        out[name] = {"gated": int((gated & m).sum()), "penalized": int((penalized & m).sum())}
    out["gated_rewards"] = sorted({float(x) for x in cols["reward"][gated]})
    return out


def _f(x: Any, fmt: str = "{:+.3f}") -> str:
    return "—" if x is None else fmt.format(x)


def _rule_lines(rules: Mapping[str, Any] | None) -> list[str]:
    if not rules:
        return []
    p, f = rules["pass"], rules["fail"]
    return [f"- rules: gated {p['gated']} pass / {f['gated']} fail (reward {rules['gated_rewards'] or '—'}), "
            f"penalized {p['penalized']} pass / {f['penalized']} fail"]


def format_markdown(report: Mapping[str, Any]) -> str:
    """Tables in the shape of the field report's §8 and §9."""
    bl = report["by_label"]
    lines = [f"Reward validation on {report['n']} records ({report['n_pass']} pass, {report['n_fail']} fail)", "",
             "| | teacher pass | teacher fail |", "|---|---|---|"]
    for key, title, fmt in (("reward", "total reward", "{:+.3f}"), ("rule_score", "rule part", "{:+.3f}"),
                            ("p_pass", "judge P(pass)", "{:.3f}"), ("n_issues", "issues listed", "{:.2f}")):
        lines.append(f"| {title} | {_f(bl['pass'][key], fmt)} | {_f(bl['fail'][key], fmt)} |")
    lines += ["",
              f"- separation AUC, total reward: {_f(report['separation_auc_reward'], '{:.3f}')}",
              f"- separation AUC, rule part alone: {_f(report['separation_auc_rule'], '{:.3f}')}",
              f"- distinct reward values: {report['distinct_rewards']} of {report['n']}",
              *_rule_lines(report.get("rules")),
              f"- reward mean {_f(report['mean_reward'])} (range {_f(report['min_reward'])} "
              f"to {_f(report['max_reward'])})"]
    for name, s in (report.get("slices") or {}).items():
        lines.append(f"- {name}: pass {_f(s['by_label']['pass']['reward'])} vs fail "
                     f"{_f(s['by_label']['fail']['reward'])}, separation AUC "
                     f"{_f(s['separation_auc_reward'], '{:.3f}')} (n={s['n']})")
    g = report["groups"]
    share = g["zero_span_share"]
    lines += ["", "| GRPO groups | value |", "|---|---|",
              f"| groups (prompt_id) | {g['n_groups']} ({g['singleton_groups']} with one response) |",
              f"| reward span mean / min | {_f(g['mean_reward_span'], '{:.3f}')} / {_f(g['min_reward_span'], '{:.3f}')} |",
              f"| advantage span mean / min | {_f(g['mean_advantage_span'], '{:.3f}')} / "
              f"{_f(g['min_advantage_span'], '{:.3f}')} |",
              f"| zero-span groups | {g['zero_span_groups']} / {g['groups_with_spread_possible']}"
              f" ({_f(share, '{:.1%}')}) |"]
    return "\n".join(lines)
