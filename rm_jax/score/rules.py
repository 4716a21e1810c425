"""Deterministic rule checks on the judged response (the "rule score" part of the reward).

Rules see only what can be checked without a model: the response's tool calls against the
sample's tool schemas. They exist for two reasons:

* **Hard gate.** A tool call whose arguments do not decode to a closed JSON object, or that names
  a tool the sample does not offer, cannot be executed. Its reward is a fixed -2.0 whatever the
  judge says — otherwise RL can find "malformed output that fools the judge" (field report §2.4).
  Arguments encoded more than once are not malformed: the online server double-encodes, and
  `rm_jax.data.schema.decode_arguments` undoes up to 4 levels; what stays undecodable
  (`ToolCall.decoded is False`: unclosed, truncated, not an object) is malformed.
* **Soft penalties.** A missing required argument or an exact duplicate call (same name and same
  decoded arguments) is executable but wrong; each occurrence costs `RulePenalties` (default
  -1.0 each) in the rule score, and the judge terms still count.

A clean response — and a text-only response, which has no calls to check — has rule score 0.
Everything that is not a plain, checkable property (was a tool *needed*, is the value sensible)
is the judge's job: the report's §8 shows the rule part alone barely separates pass from fail.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

from rm_jax.data.schema import Response, ToolCall, decode_arguments

# Violation codes. Gating codes make the whole reward `RulePenalties.gate_reward`.
MALFORMED_ARGUMENTS = "malformed_arguments"
UNKNOWN_TOOL = "unknown_tool"
MISSING_REQUIRED = "missing_required_argument"
DUPLICATE_CALL = "duplicate_call"
GATING = frozenset({MALFORMED_ARGUMENTS, UNKNOWN_TOOL})


@dataclasses.dataclass(frozen=True)
class RulePenalties:
    gate_reward: float = -2.0          # the total reward of a gated response, judge ignored
    missing_required: float = -1.0     # per missing required argument
    duplicate_call: float = -1.0       # per repeated identical call (the first one is fine)


@dataclasses.dataclass(frozen=True)
class RuleViolation:
    code: str
    call_index: int
    tool: str
    detail: str


@dataclasses.dataclass(frozen=True)
class RuleResult:
    rule_score: float                  # penalties summed; the gate value when gated
    violations: tuple[RuleViolation, ...]
    gated: bool

    @property
    def codes(self) -> list[str]:
        return [v.code for v in self.violations]


def tool_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """name -> function schema; accepts OpenAI {"type":"function","function":{...}} and flat {name,...}."""
    out = {}
    for t in tools:
        fn = t.get("function", t) if isinstance(t, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn
    return out


def required_arguments(schema: Mapping[str, Any]) -> list[str]:
    params = schema.get("parameters")
    req = params.get("required") if isinstance(params, Mapping) else None
    return [r for r in req if isinstance(r, str)] if isinstance(req, list) else []


def response_from_dict(response: Mapping[str, Any]) -> Response:
    """A raw response object ({"content", "tool_calls"}) -> schema.Response, decoding arguments the
    same way the sample parser does (so a raw dict and a parsed Sample are checked identically)."""
    calls = []
    for call in response.get("tool_calls") or []:
        fn = call.get("function", {}) if isinstance(call, Mapping) else {}
        name = fn.get("name") if isinstance(fn, Mapping) else None
        args, depth, ok = decode_arguments(fn.get("arguments", {}) if isinstance(fn, Mapping) else None)
        calls.append(ToolCall(id=call.get("id") if isinstance(call, Mapping) else None,
                              name=name if isinstance(name, str) else "", arguments=args,
                              encode_depth=depth, decoded=ok and isinstance(args, dict)))
    return Response(content=response.get("content"), tool_calls=tuple(calls))


def _call_key(call: ToolCall) -> str:
    # Canonical JSON: {"a":1,"b":2} and {"b":2,"a":1} are the same call.
    return call.name + "\x00" + json.dumps(call.arguments, sort_keys=True, ensure_ascii=False, default=str)


def check_response(response: Response | Mapping[str, Any], tools: Sequence[Mapping[str, Any]],
                   penalties: RulePenalties = RulePenalties()) -> RuleResult:
    """Check one judged response against the offered tools. All violations are listed, gated or not."""
    if isinstance(response, Mapping):
        response = response_from_dict(response)
    schemas = tool_schemas(tools)
    violations: list[RuleViolation] = []
    seen: set[str] = set()
    for i, call in enumerate(response.tool_calls):
        well_formed = call.decoded and isinstance(call.arguments, dict)
        if not well_formed:
            violations.append(RuleViolation(MALFORMED_ARGUMENTS, i, call.name,
                                            "arguments do not decode to a closed JSON object"))
        schema = schemas.get(call.name)
        if schema is None:
            # With no tools offered at all, any call is to a tool that does not exist for this prompt.
            violations.append(RuleViolation(UNKNOWN_TOOL, i, call.name,
                                            f"tool {call.name!r} is not among {sorted(schemas)}"))
        if not well_formed:
            continue   # nothing more can be read from undecoded arguments
        if schema is not None:
            for arg in required_arguments(schema):
                if arg not in call.arguments:
                    violations.append(RuleViolation(MISSING_REQUIRED, i, call.name,
                                                    f"required argument {arg!r} is missing"))
        key = _call_key(call)
        if key in seen:
            violations.append(RuleViolation(DUPLICATE_CALL, i, call.name,
                                            "same tool and arguments as an earlier call"))
        seen.add(key)

    gated = any(v.code in GATING for v in violations)
    if gated:
        return RuleResult(rule_score=penalties.gate_reward, violations=tuple(violations), gated=True)
    per_code = {MISSING_REQUIRED: penalties.missing_required, DUPLICATE_CALL: penalties.duplicate_call}
    score = float(sum(per_code[v.code] for v in violations))
    return RuleResult(rule_score=score, violations=tuple(violations), gated=False)


def rule_check(sample, penalties: RulePenalties = RulePenalties()) -> RuleResult:
    """Rule checks of a `rm_jax.data.schema.Sample` (its response against its `tools`)."""
    return check_response(sample.response, sample.tools, penalties)
