"""TRL GRPO reward function backed by the judge server.

    from rm_jax.rl.trl_reward import JudgeReward
    trainer = GRPOTrainer(..., reward_funcs=[JudgeReward("http://127.0.0.1:8000")], train_dataset=ds)

TRL calls each reward function with keyword arguments ``prompts``, ``completions`` and every
other dataset column (one list entry per completion), and reads back one float per completion,
``None`` meaning "this function does not apply to this sample". The sample context travels in a
dataset column (``sample`` by default: the sample JSON without ``response``). Completions are raw
text, or conversational (``[{"role": "assistant", "content": ..., "tool_calls": [...]}]``), whose
structured tool calls are written back as the ``<tool_call>`` blocks the server parses.

Requests go through ``rm_jax.rl.client`` (batched, bounded in flight, retried after the server's
``Retry-After``; a request that still fails gives its samples the gate reward, logged and
counted in ``stats``). ``last_records`` holds the full records of the last call.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rm_jax.rl.client import ClientSettings, ClientStats, SyncRewardClient


def completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        parts = []
        for msg in completion:
            if msg.get("content"):
                parts.append(msg["content"] if isinstance(msg["content"], str) else
                             "".join(p.get("text", "") for p in msg["content"] if isinstance(p, dict)))
            for call in msg.get("tool_calls") or []:
                fn = call.get("function", call)
                parts.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")},
                                                          ensure_ascii=False) + "\n</tool_call>")
        return "\n".join(parts)
    raise TypeError(f"completion must be a string or a list of messages, got {type(completion).__name__}")


class JudgeReward:
    """``reward_funcs`` entry: ``__call__(prompts, completions, **kwargs) -> list[float | None]``."""

    def __init__(self, url: str | None = None, *, sample_column: str = "sample", api_key: str | None = None,
                 settings: ClientSettings | None = None):
        settings = settings if settings is not None else ClientSettings()
        self.client = SyncRewardClient(dataclasses.replace(settings, url=url or settings.url,
                                                           api_key=api_key or settings.api_key))
        self.sample_column = sample_column
        self.__name__ = "rm_jax_judge"          # TRL names the logged reward after the function
        self.last_records = []

    @property
    def stats(self) -> ClientStats:
        return self.client.stats

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float | None]:
        del prompts
        contexts = kwargs.get(self.sample_column) or [None] * len(completions)
        todo = [i for i, c in enumerate(contexts) if c is not None]
        out: list[float | None] = [None] * len(completions)
        if not todo:
            return out
        self.last_records = self.client.score([completion_text(completions[i]) for i in todo],
                                              [contexts[i] for i in todo])
        for i, rec in zip(todo, self.last_records):
            out[i] = rec.score
        return out
