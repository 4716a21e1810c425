"""Verdict-first serialization, the verdict slot, and the tolerant output parser."""

import json

import pytest

from rm_jax.data import target as target_lib
from rm_jax.data.schema import Label

REASON_WITH_PASS = 'the call should pass "2K" but says fail-safe "1K"'


@pytest.mark.parametrize("order", [("l3", "reason", "issues", "img"), ("reason", "issues", "img", "l3")])
@pytest.mark.parametrize("verdict", ["pass", "fail"])
def test_round_trip_and_slot(order, verdict):
    label = Label(verdict, REASON_WITH_PASS, ("wrong_param",), 7)
    text = target_lib.serialize_label(label, order)
    assert list(json.loads(text)) == list(order)
    parsed = target_lib.parse_output(text)
    assert (parsed.l3, parsed.reason, parsed.issues, parsed.img, parsed.status) == \
        (verdict, REASON_WITH_PASS, ("wrong_param",), 7, "ok")
    pieces = target_lib.split_at_verdict(text, verdict)
    assert pieces.prefix + pieces.verdict + pieces.rest == text
    assert pieces.prefix.endswith('"l3": "')
    # the slot is the l3 key's value, not the "pass"/"fail" inside the reason
    assert REASON_WITH_PASS not in pieces.prefix or order[0] != "l3"
    if order[0] == "l3":
        assert pieces.prefix == '{"l3": "' == target_lib.verdict_prefix(order)
    else:
        assert target_lib.verdict_prefix(order) is None
        assert REASON_WITH_PASS.replace('"', '\\"') in pieces.prefix


def test_verdict_first_text_exact():
    text = target_lib.serialize_label(Label("pass", "ok", (), 9))
    assert text == '{"l3": "pass", "reason": "ok", "issues": [], "img": 9}'


def test_img_null_without_image():
    text = target_lib.serialize_label(Label("pass", "ok", (), 9), has_image=False)
    assert json.loads(text)["img"] is None


def test_bad_field_order():
    with pytest.raises(ValueError, match="permutation"):
        target_lib.serialize_label(Label("pass", "", (), None), ("l3", "reason"))


@pytest.mark.parametrize("text,l3,status", [
    ('```json\n{"l3": "fail", "reason": "x", "issues": ["a"], "img": null}\n```', "fail", "recovered"),
    ('{"l3": "pass", "reason": "x", "issues": [], "img": 3} trailing words', "pass", "recovered"),
    ('{"l3": "fail", "reason": "cut off at the bud', "fail", "recovered"),
    ('the answer would pass but {"reason": "r", "l3": "fail"}', "fail", "recovered"),
    ("pass", None, "failed"),
    ('{"l3": "maybe"}', None, "failed"),
])
def test_tolerant_parser(text, l3, status):
    got = target_lib.parse_output(text)
    assert got.l3 == l3 and got.status == status
