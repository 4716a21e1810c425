"""The policy's raw text -> the judged response ``{"content", "tool_calls"}`` (OpenRLHF, verl, TRL, slime).

RL frameworks hand the reward model the policy's decoded text, not a structured message. Qwen
policies write tool calls in one of two bodies inside ``<tool_call>`` blocks:

* **Hermes JSON** (Qwen2.5, Qwen3, Qwen3-VL)::

      <tool_call>
      {"name": "search", "arguments": {"q": "..."}}
      </tool_call>

* **Qwen3-Coder XML** (Qwen3-Coder, Qwen3.5)::

      <tool_call>
      <function=search>
      <parameter=q>
      ...
      </parameter>
      </function>
      </tool_call>

  XML values are text; they are typed by the tool's JSON schema as vLLM's ``qwen3_coder`` parser
  types them: ``string`` stays a string; ``integer`` / ``number`` / ``boolean`` are parsed;
  ``object`` / ``array`` are JSON-decoded; ``null`` (any case) is None; a value that does not
  parse, or a parameter the schema does not name, stays the raw string. One newline after the
  opening tag and one before the closing tag belong to the template, not to the value.

Decisions:

* **The format** comes from the served model's chat template when it names one
  (``format_of_template``); otherwise from the response itself: its first block decides, and a
  block in the other format is malformed. A policy whose calls its own serving stack could not
  parse earns the gate, not a judge reward.
* **A value ends at ``</parameter>`` followed by the next ``<parameter=`` or the end of the
  function**, so a value holding ``<`` or even ``</parameter`` inside its text is kept whole.
* **Reasoning** (``<think>...</think>``) is not judged: it is removed from the content, and a
  call written inside it is not a call. A ``</think>`` with no opener closes the block that the
  generation prompt opened (Qwen3.5's thinking template ends its prompt with ``<think>``).
  ``keep_think=True`` keeps the reasoning text in the content (calls in it are still not calls).
* **Malformed is kept, never dropped.** An unclosed block (the policy ran out of tokens), a body
  that is not a call in the expected format, or an unclosed ``<think>`` becomes a call named
  ``""`` whose arguments are the raw text. No sample offers a tool named ``""``, so the rule
  checks gate it (-2.0) whatever the judge says: dropping it would let a policy earn a judge
  reward for output the environment cannot execute.
* **Multiply-encoded JSON is decoded** like the sample parser does (up to 4 ``json.loads``).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from typing import Any, Sequence

from rm_jax.data.schema import decode_arguments

OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
FUNCTION_OPEN = "<function="
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_THINK = re.compile(re.escape(THINK_OPEN) + r"(.*?)" + re.escape(THINK_CLOSE), re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.DOTALL)
_PARAM_OPEN = re.compile(r"<parameter=([^>\n]+)>")
# The end of a value: its closing tag where the next parameter or the function's end follows.
_PARAM_CLOSE = re.compile(r"</parameter>\s*(?=<parameter=[^>\n]+>|\Z)")
# End-of-turn markers a framework may leave on the decoded text.
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>")


class CallFormat(enum.Enum):
    HERMES = "hermes"       # JSON body
    XML = "xml"             # <function=..><parameter=..>
    AUTO = "auto"           # decided per response


def format_of_template(chat_template: str | None) -> CallFormat:
    """The call format a chat template tells its model to write (AUTO when it names neither)."""
    text = (chat_template or "").replace('\\"', '"')      # quotes escaped inside Jinja string literals
    if "<function=" in text:
        return CallFormat.XML
    if '"name": <function-name>' in text or '<tool_call>\\n{"name"' in text:
        return CallFormat.HERMES
    return CallFormat.AUTO


@dataclasses.dataclass(frozen=True)
class ParsedResponse:
    content: str | None
    tool_calls: tuple[dict, ...]      # OpenAI shape: {"id", "type": "function", "function": {"name", "arguments"}}
    malformed: int                    # blocks (or an unclosed think) that could not be read as a call
    reasoning: str | None = None      # the <think> text, not judged

    def to_json(self) -> dict:
        return {"content": self.content, "tool_calls": list(self.tool_calls)}


def _call(index: int, name: str, arguments) -> dict:
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


def strip_end_markers(text: str) -> str:
    text = text.rstrip()
    changed = True
    while changed:
        changed = False
        for m in END_MARKERS:
            if text.endswith(m):
                text, changed = text[: -len(m)].rstrip(), True
    return text


# ---------------------------------------------------------------- schema types (XML values)


def parameter_types(tools: Sequence[Any] | None) -> dict[str, dict[str, Any]]:
    """{tool name: {parameter: its JSON-schema type}} of OpenAI function schemas (``{"type":
    "function", "function": {...}}`` or the bare function object)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        if not isinstance(tool, dict):
            continue
        fn = tool["function"] if isinstance(tool.get("function"), dict) else tool
        name, params = fn.get("name"), fn.get("parameters")
        if not isinstance(name, str):
            continue
        props = params.get("properties") if isinstance(params, dict) else None
        out[name] = {k: _schema_type(v) for k, v in props.items()} if isinstance(props, dict) else {}
    return out


def _schema_type(prop: Any) -> str:
    """A property's type name; the first non-null one of a union; "string" when unstated."""
    if not isinstance(prop, dict):
        return "string"
    t = prop.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "string")
    if t is None:
        for key in ("anyOf", "oneOf"):
            if isinstance(prop.get(key), list):
                t = next((_schema_type(x) for x in prop[key] if _schema_type(x) != "null"), None)
                if t is not None:
                    break
    if t is None and "enum" in prop:
        t = "string"
    return str(t or "string").strip().lower()


def convert_value(raw: str, schema_type: str | None) -> Any:
    """One XML parameter value typed by its schema type (see the module docstring)."""
    if schema_type is None:                      # a parameter the schema does not know
        return raw
    if raw.lower() == "null":
        return None
    t = schema_type
    if t in ("string", "str", "text", "varchar", "char", "enum"):
        return raw
    if t.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(raw)
        except ValueError:
            return raw
    if t.startswith(("num", "float", "double")):
        try:
            x = float(raw)
        except ValueError:
            return raw
        return int(x) if x.is_integer() else x
    if t in ("boolean", "bool", "binary"):
        low = raw.strip().lower()
        return {"true": True, "false": False}.get(low, raw)
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


# ---------------------------------------------------------------- one block


def _read_hermes(body: str):
    """(name, arguments) of a JSON body, or None when it is not a call object."""
    value, _, ok = decode_arguments(body.strip())
    if not ok or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return value["name"], args


def _read_xml(body: str, types: dict[str, dict[str, Any]]):
    """(name, arguments) of an XML body, or None when it is not one well-formed function."""
    m = _FUNCTION.fullmatch(body.strip())
    if m is None:
        return None
    name, inner = m.group(1).strip(), m.group(2)
    if not name:
        return None
    known = types.get(name, {})
    args: dict[str, Any] = {}
    pos = 0
    while True:
        gap_end = len(inner) - len(inner[pos:].lstrip())
        if gap_end == len(inner):
            return name, args
        opened = _PARAM_OPEN.match(inner, gap_end)
        if opened is None:                        # text between parameters: not the format
            return None
        closed = _PARAM_CLOSE.search(inner, opened.end())
        if closed is None:
            return None
        raw = inner[opened.end():closed.start()]
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        key = opened.group(1).strip()
        args[key] = convert_value(raw, known.get(key))
        pos = closed.end()


def _block_format(body: str) -> CallFormat:
    return CallFormat.XML if body.lstrip().startswith(FUNCTION_OPEN) else CallFormat.HERMES


# ---------------------------------------------------------------- the response


def _split_reasoning(text: str) -> tuple[list[tuple[bool, str]], bool]:
    """Segments (is_reasoning, text) in order, and whether a <think> was left open."""
    segments: list[tuple[bool, str]] = []
    close_at, open_at = text.find(THINK_CLOSE), text.find(THINK_OPEN)
    if close_at >= 0 and (open_at < 0 or close_at < open_at):     # the prompt opened it
        segments.append((True, text[:close_at]))
        text = text[close_at + len(THINK_CLOSE):]
    pos = 0
    for m in _THINK.finditer(text):
        segments.append((False, text[pos:m.start()]))
        segments.append((True, m.group(1)))
        pos = m.end()
    rest = text[pos:]
    if THINK_OPEN in rest:
        head, _, tail = rest.partition(THINK_OPEN)
        segments.append((False, head))
        segments.append((True, tail))
        return segments, True
    segments.append((False, rest))
    return segments, False


def parse_raw_response(text: str, *, tools: Sequence[Any] | None = None, call_format: CallFormat = CallFormat.AUTO,
                       keep_think: bool = False) -> ParsedResponse:
    """Split raw policy text into content, tool calls and reasoning (see the module docstring).

    ``tools``: the sample's function schemas (types XML values); ``call_format``: the format the
    served template names, or AUTO."""
    text = strip_end_markers(text)
    segments, think_unclosed = _split_reasoning(text)
    types = parameter_types(tools)
    calls: list[dict] = []
    content: list[str] = []
    reasoning: list[str] = []
    malformed = 0
    expected = call_format

    def bad(raw: str) -> None:
        nonlocal malformed
        calls.append(_call(len(calls), "", raw.strip()))
        malformed += 1

    for is_reasoning, seg in segments:
        if is_reasoning:
            reasoning.append(seg.strip())
            if keep_think:
                content.append(THINK_OPEN + seg + THINK_CLOSE)
            continue
        pos = 0
        for m in _BLOCK.finditer(seg):
            content.append(seg[pos:m.start()])
            pos = m.end()
            body = m.group(1)
            fmt = _block_format(body)
            if expected is CallFormat.AUTO:
                expected = fmt
            got = None
            if fmt is expected:
                got = _read_xml(body, types) if fmt is CallFormat.XML else _read_hermes(body)
            if got is None:
                bad(body)
            else:
                calls.append(_call(len(calls), *got))
        rest = seg[pos:]
        if OPEN in rest:   # an unclosed block: whatever follows is the truncated call
            head, _, body = rest.partition(OPEN)
            content.append(head)
            bad(body)
        else:
            content.append(rest)
    if think_unclosed:     # the policy never finished thinking: nothing it wrote is an answer
        bad(THINK_OPEN + segments[-1][1])
    joined = "".join(content).strip()
    thought = "\n".join(r for r in reasoning if r) or None
    return ParsedResponse(content=joined or None, tool_calls=tuple(calls), malformed=malformed, reasoning=thought)
