"""The policy's raw text -> the judged response ``{"content", "tool_calls"}`` (OpenRLHF, verl, TRL).

RL frameworks hand the reward model the policy's decoded text, not a structured message. Qwen
and Hermes-style chat templates write tool calls as

    <tool_call>
    {"name": "search", "arguments": {"q": "..."}}
    </tool_call>

blocks; everything outside the blocks is the message content.

* **Malformed calls are kept, never dropped.** An unclosed block (the policy ran out of tokens,
  or never closed it) or a body that is not a JSON object with a string ``name`` becomes a call
  named ``""`` whose arguments are the raw body text. No sample offers a tool named ``""``, so the
  rule checks gate it (-2.0) whatever the judge says: dropping it would let a policy earn a judge
  reward for output the environment cannot execute.
* **Multiply-encoded text is decoded** like the sample parser does (up to 4 ``json.loads``):
  the block body when it arrives as a JSON string, and its ``arguments`` (via the sample parser).
"""

from __future__ import annotations

import dataclasses
import re

from rm_jax.data.schema import decode_arguments

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
# End-of-turn markers a framework may leave on the decoded text.
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>")


@dataclasses.dataclass(frozen=True)
class ParsedResponse:
    content: str | None
    tool_calls: tuple[dict, ...]      # OpenAI shape: {"id", "type": "function", "function": {"name", "arguments"}}
    malformed: int                    # blocks that could not be read as a call

    def to_json(self) -> dict:
        return {"content": self.content, "tool_calls": list(self.tool_calls)}


def _call(index: int, name: str, arguments) -> dict:
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _read_block(body: str):
    """(name, arguments) of a closed block's body, or None when it is not a call object."""
    value, _, ok = decode_arguments(body.strip())
    if not ok or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return value["name"], args


def strip_end_markers(text: str) -> str:
    text = text.rstrip()
    changed = True
    while changed:
        changed = False
        for m in END_MARKERS:
            if text.endswith(m):
                text, changed = text[: -len(m)].rstrip(), True
    return text


def parse_raw_response(text: str) -> ParsedResponse:
    """Split raw policy text into content and tool calls (see the module docstring)."""
    text = strip_end_markers(text)
    calls: list[dict] = []
    content: list[str] = []
    malformed, pos = 0, 0
    for m in _BLOCK.finditer(text):
        content.append(text[pos:m.start()])
        got = _read_block(m.group(1))
        if got is None:
            calls.append(_call(len(calls), "", m.group(1).strip()))
            malformed += 1
        else:
            calls.append(_call(len(calls), *got))
        pos = m.end()
    rest = text[pos:]
    if OPEN in rest:   # an unclosed block: whatever follows is the truncated call
        head, _, body = rest.partition(OPEN)
        content.append(head)
        calls.append(_call(len(calls), "", body.strip()))
        malformed += 1
    else:
        content.append(rest)
    joined = "".join(content).strip()
    return ParsedResponse(content=joined or None, tool_calls=tuple(calls), malformed=malformed)
