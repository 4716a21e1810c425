"""An RL rollout as a framework sends it -> the sample the judge scores.

OpenRLHF posts ``query`` = the whole decoded sequence (prompt + response, special tokens kept),
``prompts`` = the prompt text as the dataset held it, ``labels`` = the sample JSON without
``response``. The query's prompt part is *not* the prompt text: a VLM processor expanded each
image placeholder into many ``<|image_pad|>`` tokens, a long prompt was left-truncated, a system
prompt was added by the template. So the response is found by the chat template's own
generation prompt (``<|im_start|>assistant\\n`` for Qwen): it is the text after the **last**
assistant-turn start in the query. A query with no such start is the response itself when the
client sent no prompt (rm_jax's TRL / verl clients post bare completions), and otherwise cannot
be placed: that row says why and takes the gate reward.

slime posts one sample per request, ``{"prompt", "response", "label"}``; its response is already
the bare completion.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rm_jax.serve.toolcalls import THINK_OPEN, CallFormat, parse_raw_response


def assistant_turn_start(tokenizer) -> str:
    """The text a chat template writes to open the assistant's turn (its generation prompt,
    without a ``<think>`` it may open: that belongs to the response)."""
    probe = [{"role": "user", "content": "x"}]
    with_turn = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    without = tokenizer.apply_chat_template(probe, add_generation_prompt=False, tokenize=False)
    if not with_turn.startswith(without) or len(with_turn) == len(without):
        raise ValueError("the chat template writes no generation prompt: the assistant turn cannot be found")
    start = with_turn[len(without):]
    return start.split(THINK_OPEN)[0]


@dataclasses.dataclass(frozen=True)
class RolloutParser:
    assistant_start: str            # from the served template (assistant_turn_start)
    call_format: CallFormat         # the format the served template names, or AUTO
    keep_think: bool = False

    def response_text(self, query: str, prompt: str) -> str:
        """The response part of an OpenRLHF query (see the module docstring); ValueError why not."""
        at = query.rfind(self.assistant_start)
        if at >= 0:
            return query[at + len(self.assistant_start):]
        if not prompt:
            return query
        if query.startswith(prompt):
            return query[len(prompt):]
        raise ValueError(f"no assistant-turn start {self.assistant_start!r} in the query, and the query does "
                         f"not start with its prompt")

    def sample(self, label: Any, response_text: str, default_id: str, field: str) -> dict:
        """The sample JSON to score: the label's context plus the parsed response. ValueError why not."""
        if isinstance(label, str):
            try:
                label = json.loads(label)
            except json.JSONDecodeError as e:
                raise ValueError(f"{field}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(label, dict):
            raise ValueError(f"{field}: expected a sample object without response, got {type(label).__name__}")
        obj = dict(label)
        obj.setdefault("id", default_id)
        tools = obj.get("tools") if isinstance(obj.get("tools"), list) else None
        obj["response"] = parse_raw_response(response_text, tools=tools, call_format=self.call_format,
                                             keep_think=self.keep_think).to_json()
        return obj
