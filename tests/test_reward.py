"""Composite reward: rules, hard gate, image guard, formula; reward validation report."""

import json

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from rm_jax.data.schema import parse_sample
from rm_jax.eval.reward_report import format_markdown, reward_report
from rm_jax.score.reward import RewardWeights, compute_reward, compute_reward_for, sample_has_image
from rm_jax.score.rules import (DUPLICATE_CALL, MALFORMED_ARGUMENTS, MISSING_REQUIRED, UNKNOWN_TOOL,
                                RulePenalties, rule_check)

TOOLS = [
    {"type": "function", "function": {"name": "generate_image", "parameters": {
        "type": "object", "properties": {"prompt": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["prompt", "count"]}}},
    {"type": "function", "function": {"name": "edit_image", "parameters": {
        "type": "object", "properties": {"image": {"type": "string"}}, "required": ["image"]}}},
]
PNG_URI = "data:image/png;base64,iVBORw0KGgo="


def _call(name, arguments, i=0):
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _sample(calls=None, content=None, image=False, tools=TOOLS):
    user = [{"type": "text", "text": "draw a red cat"}]
    if image:
        user.append({"type": "image", "image": PNG_URI})
    obj = {"id": "s1", "messages": [{"role": "user", "content": user}], "tools": tools,
           "response": {"content": content, "tool_calls": calls or []}}
    return parse_sample(obj, line=1, base_dir="/nonexistent", require_label=False)


GOOD = {"prompt": "a red cat", "count": 2}


# ---------------------------------------------------------------- rules


def test_clean_call_has_rule_score_zero_for_every_argument_encoding():
    for args in (GOOD, json.dumps(GOOD), json.dumps(json.dumps(GOOD))):
        r = rule_check(_sample([_call("generate_image", args)]))
        assert r.rule_score == 0.0 and not r.violations and not r.gated


def test_text_only_response_rule_zero():
    r = rule_check(_sample(content="Here is what I can do for you."))
    assert r.rule_score == 0.0 and not r.violations and not r.gated


@pytest.mark.parametrize("args", ['{"prompt": "a red cat", "count": 2', "not json", '["a", 1]', '"just a string"'])
def test_malformed_arguments_gate(args):
    sample = _sample([_call("generate_image", args)])
    assert MALFORMED_ARGUMENTS in rule_check(sample).codes
    for p in (0.0, 0.37, 1.0):
        res = compute_reward(sample, p_pass=p, n_issues=0, img=10)
        assert res.reward == -2.0 and res.components["gated"]


def test_unknown_tool_gate_reports_but_ignores_judge_terms():
    sample = _sample([_call("delete_everything", {"x": 1})], image=True)
    res = compute_reward(sample, p_pass=1.0, n_issues=0, img=10)
    assert res.reward == -2.0 and res.rule_score == -2.0
    assert res.components["gated"] and res.components["rule_violations"][0]["code"] == UNKNOWN_TOOL
    # Judge terms are still there to read.
    assert res.components["p_pass_term"] == 1.0 and res.components["img_term"] == 0.5


def test_call_without_offered_tools_is_unknown():
    res = compute_reward(_sample([_call("generate_image", GOOD)], tools=[]), p_pass=0.9, n_issues=0, img=None)
    assert res.reward == -2.0


def test_missing_required_argument_penalty():
    sample = _sample([_call("generate_image", {"prompt": "a red cat"})])
    rules = rule_check(sample)
    assert rules.codes == [MISSING_REQUIRED] and rules.rule_score == -1.0 and not rules.gated
    res = compute_reward(sample, p_pass=0.75, n_issues=1, img=None)
    assert res.reward == pytest.approx(-1.0 + 0.5 - 0.5)
    # Configurable, one penalty per missing argument.
    two_missing = _sample([_call("generate_image", {})])
    assert rule_check(two_missing, RulePenalties(missing_required=-0.25)).rule_score == -0.5


def test_duplicate_call_penalty_key_order_insensitive():
    sample = _sample([_call("generate_image", GOOD, 0),
                      _call("generate_image", json.dumps({"count": 2, "prompt": "a red cat"}), 1),
                      _call("generate_image", {"prompt": "a blue cat", "count": 2}, 2)])
    rules = rule_check(sample)
    assert rules.codes == [DUPLICATE_CALL] and rules.violations[0].call_index == 1
    assert rules.rule_score == -1.0


# ---------------------------------------------------------------- formula and image guard


def test_formula_by_hand():
    with_image = _sample([_call("generate_image", GOOD)], image=True)
    assert sample_has_image(with_image)
    res = compute_reward(with_image, p_pass=0.9, n_issues=1, img=8)
    # 0 + 1.0*(1.8-1) - 0.5*1 + 0.5*(8-5)/5 = 0.8 - 0.5 + 0.3
    assert res.reward == pytest.approx(0.6)
    assert res.components["p_pass_term"] == pytest.approx(0.8)
    assert res.components["issues_term"] == pytest.approx(-0.5)
    assert res.components["img_term"] == pytest.approx(0.3)
    w = RewardWeights(p_pass=2.0, issues=0.25, img=1.0)
    res = compute_reward(with_image, p_pass=0.25, n_issues=["a", "b"], img=0, weights=w)
    # 2*(0.5-1) - 0.25*2 + 1*(0-5)/5 = -1 - 0.5 - 1
    assert res.reward == pytest.approx(-2.5) and not res.components["gated"]


def test_image_guard():
    no_image = _sample([_call("generate_image", GOOD)])
    assert not sample_has_image(no_image)
    for img in (10, 2, 0):
        res = compute_reward(no_image, p_pass=1.0, n_issues=0, img=img)
        assert res.components["img_term"] == 0.0 and res.reward == pytest.approx(1.0)
    with_image = _sample([_call("generate_image", GOOD)], image=True)
    assert compute_reward(with_image, p_pass=1.0, n_issues=0, img=None).components["img_term"] == 0.0
    assert compute_reward(with_image, p_pass=1.0, n_issues=0, img=10).reward == pytest.approx(1.5)


def test_image_in_tool_result_counts_as_image():
    obj = {"id": "s2", "messages": [
        {"role": "user", "content": "edit it"},
        {"role": "tool", "content": json.dumps({"status": "ok", "images": [{"image": "out/a.png"}]})}],
        "tools": TOOLS, "response": {"content": None, "tool_calls": [_call("edit_image", {"image": "out/a.png"})]}}
    sample = parse_sample(obj, line=1, base_dir="/nonexistent", require_label=False)
    assert sample_has_image(sample)
    assert compute_reward(sample, 0.5, 0, 10).components["img_term"] == pytest.approx(0.5)


def test_raw_response_dict_matches_sample():
    calls = [_call("generate_image", '{"prompt": "x"'), _call("generate_image", {"prompt": "x"})]
    raw = compute_reward_for({"content": None, "tool_calls": calls}, TOOLS, has_image=False,
                             p_pass=0.5, n_issues=0, img=None)
    parsed = compute_reward(_sample(calls), 0.5, 0, None)
    assert raw == parsed and raw.reward == -2.0


@pytest.mark.parametrize("kwargs", [dict(p_pass=1.5), dict(p_pass=float("nan")), dict(n_issues=-1), dict(img=11)])
def test_invalid_judge_outputs(kwargs):
    args = dict(p_pass=0.5, n_issues=0, img=5) | kwargs
    with pytest.raises(ValueError):
        compute_reward(_sample([_call("generate_image", GOOD)], image=True), **args)


# ---------------------------------------------------------------- reward report


def _records():
    rng = np.random.default_rng(0)
    recs = []
    for g in range(12):
        for k in range(4):
            label = "fail" if (g + k) % 3 == 0 else "pass"
            p = float(np.clip((0.85 if label == "pass" else 0.3) + rng.normal(0, 0.1), 0, 1))
            n_issues = 0 if label == "pass" else 1
            rule = -1.0 if (label == "fail" and k == 0) else 0.0
            recs.append({"id": f"g{g}-{k}", "prompt_id": f"g{g}", "label": label, "p_pass": p,
                         "n_issues": n_issues, "rule_score": rule,
                         "reward": rule + (2 * p - 1) - 0.5 * n_issues,
                         "slice": "tool_call" if g % 2 else "text_only"})
    # One group where every response gets the same reward (zero span), and one singleton group.
    for k in range(3):
        recs.append({"id": f"tie-{k}", "prompt_id": "tie", "label": "pass", "p_pass": 0.9, "n_issues": 0,
                     "rule_score": 0.0, "reward": 0.8})
    recs.append({"id": "solo", "prompt_id": "solo", "label": "fail", "p_pass": 0.2, "n_issues": 2,
                 "rule_score": -2.0, "reward": -2.0})
    return recs


def test_reward_report():
    recs = _records()
    rep = reward_report(recs)
    json.dumps(rep, allow_nan=False)
    y_fail = np.array([r["label"] == "fail" for r in recs], int)
    rewards = np.array([r["reward"] for r in recs])
    rules = np.array([r["rule_score"] for r in recs])
    assert rep["separation_auc_reward"] == pytest.approx(roc_auc_score(y_fail, -rewards))
    assert rep["separation_auc_rule"] == pytest.approx(roc_auc_score(y_fail, -rules))
    assert rep["n"] == len(recs) and rep["n_fail"] == int(y_fail.sum())
    assert rep["by_label"]["fail"]["reward"] == pytest.approx(rewards[y_fail == 1].mean())
    assert rep["by_label"]["pass"]["n_issues"] == 0.0
    assert rep["distinct_rewards"] == len(np.unique(rewards.round(9)))

    g = rep["groups"]
    assert g["n_groups"] == 14 and g["singleton_groups"] == 1 and g["groups_with_spread_possible"] == 13
    assert g["zero_span_groups"] == 1 and g["zero_span_prompt_ids"] == ["tie"]
    assert g["zero_span_share"] == pytest.approx(1 / 13)
    spans = [np.ptp([r["reward"] for r in recs if r["prompt_id"] == f"g{i}"]) for i in range(12)] + [0.0]
    assert g["mean_reward_span"] == pytest.approx(np.mean(spans)) and g["min_reward_span"] == 0.0
    assert g["min_advantage_span"] == 0.0
    # Groups with spread: normalized advantages of 4 values always span well above 0.
    assert g["mean_advantage_span"] > 2.0
    assert set(rep["slices"]) == {"text_only", "tool_call"}

    md = format_markdown(rep)
    assert "separation AUC, total reward" in md and "zero-span groups | 1 / 13" in md


def test_reward_report_rejects_missing_fields():
    with pytest.raises(ValueError, match="lacks"):
        reward_report([{"id": "a", "label": "pass"}])
