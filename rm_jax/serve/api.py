"""Request and response bodies of the HTTP API (docs/contracts.md), as pydantic models.

FastAPI validates requests against these and answers 422 with the failing field's location when
a body does not match. Samples stay plain JSON objects here: the sample contract has its own
validator (``rm_jax.data.schema.parse_sample``), which reports a bad sample as that sample's
``{id, error}`` row instead of failing the whole request.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rm_jax.score.scorer import ScoreMode


class Health(BaseModel):
    status: str
    step: int
    model_type: str
    queue: int


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    samples: list[dict[str, Any]]
    mode: ScoreMode = ScoreMode.FULL


class ScoreResponse(BaseModel):
    results: list[dict[str, Any]]     # launch.score rows, or {id, error}


class GetRewardRequest(BaseModel):
    """OpenRLHF's remote reward request: ``labels[i]`` is the sample JSON without ``response``."""
    query: list[str]
    prompts: list[str] = Field(default_factory=list)
    labels: list[str] = Field(default_factory=list)


class GetRewardResponse(BaseModel):
    rewards: list[float]              # the composite reward (the gate value when gated)
    scores: list[float]               # P(pass) in [0, 1] (0 when gated): what OpenRLHF's filter reads
    extra_logs: dict[str, list[float]]
    errors: list[str | None]          # not read by OpenRLHF; why a sample took the gate reward


class SlimeRewardRequest(BaseModel):
    """slime's remote reward request: one sample; ``response`` is the bare completion."""
    model_config = ConfigDict(extra="allow")
    prompt: str | list[Any] | None = None
    response: str
    label: str | dict[str, Any]


class SlimeRewardResponse(BaseModel):
    """One sample's reward (slime: ``--reward-key reward``) and its parts."""
    reward: float
    score: float                      # P(pass), as ``scores`` above
    p_pass: float
    rule_score: float
    n_issues: float
    img: float
    gated: float
    error: str | None


# ---------------------------------------------------------------- OpenAI chat


class ImageURL(BaseModel):
    url: str


class ChatContentPart(BaseModel):
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ChatContentPart] | None = None


class ChatRequest(BaseModel):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    n: int = Field(default=1, ge=1, le=1)
    seed: int | None = None
    stream: Literal[False] = False


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: ChoiceLogprobs | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rm_jax"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
