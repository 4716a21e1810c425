"""What the RL clients share: the server's address, the sample context, the reward record.

Every client posts to ``/get_reward`` (OpenRLHF's shape), so the raw-text tool-call parsing and
the gate for unscorable samples happen in one place, the server. The sample context -- the
conversation, tools and images the policy saw, i.e. the sample JSON without ``response`` --
travels with each rollout as a string (a dataset column, verl's ``ground_truth``, OpenRLHF's
label); ``sample_context`` accepts it as a JSON string or an already-decoded object.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV, KEY_ENV = "RM_JAX_REWARD_URL", "RM_JAX_API_KEY"


def server_url(url: str | None = None) -> str:
    return (url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    key = api_key if api_key is not None else os.environ.get(KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


def sample_context(value: Any) -> str:
    """The label string ``/get_reward`` expects: the sample JSON without ``response``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps({k: v for k, v in value.items() if k != "response"}, ensure_ascii=False)
    raise TypeError(f"sample context must be a JSON string or an object, got {type(value).__name__}")


@dataclasses.dataclass(frozen=True)
class RewardRecord:
    """One scored rollout, as the clients hand it to their framework."""
    score: float           # the composite reward (the gate value when gated or unscorable)
    p_pass: float
    rule_score: float
    n_issues: float
    img: float             # -1 when the judge gave none / the sample has no image
    gated: float           # 1.0 when the reward is the gate value
    error: str | None

    def to_verl(self) -> dict:
        return {"score": self.score, "p_pass": self.p_pass, "rule_score": self.rule_score,
                "n_issues": self.n_issues, "img": self.img, "gated": self.gated}


def records(body: dict) -> list[RewardRecord]:
    logs, errors = body["extra_logs"], body.get("errors") or [None] * len(body["rewards"])
    return [RewardRecord(score=float(r), p_pass=logs["p_pass"][i], rule_score=logs["rule_score"][i],
                         n_issues=logs["n_issues"][i], img=logs["img"][i], gated=logs["gated"][i], error=errors[i])
            for i, r in enumerate(body["rewards"])]


def reward_request(completions: list[str], contexts: list[Any]) -> dict:
    return {"query": list(completions), "prompts": [""] * len(completions),
            "labels": [sample_context(c) for c in contexts]}
