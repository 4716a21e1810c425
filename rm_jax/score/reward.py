"""The composite reward for GRPO (docs/contracts.md, "Choosing, scoring and serving"; field report §2.4 and §8).

    reward = rule_score
           + w_p      * (2 * P(pass) - 1)      # judge's P(pass) mapped to [-1, +1]
           - w_issues * n_issues               # fatal issues the judge listed
           + w_img    * (img - 5) / 5          # 0..10 image score mapped to [-1, +1]

with w_p = 1.0, w_issues = 0.5, w_img = 0.5 by default (`RewardWeights`).

* P(pass) is the continuous part: it is why the judge writes the verdict first. Without it a
  GRPO group of responses that the judge all calls "pass" ties, and a tied group contributes no
  gradient (advantages are group-normalized).
* **Image guard.** The image term is 0 when the sample has no image, whatever the judge wrote
  (and when it wrote null). The report's judge still emitted numbers like 2 on image-less samples,
  which would have been a constant -0.3 penalty on every text-only prompt.
* **Hard gate.** A malformed or unknown tool call makes the reward exactly
  `RulePenalties.gate_reward` (-2.0). The judge terms are still computed and reported in
  `components` (useful to see whether the judge *noticed*), but not added.

`compute_reward` takes a parsed `Sample`; `compute_reward_for` takes the pieces (a raw response
dict is accepted) for callers that score outside the JSONL contract.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple, Sequence

from rm_jax.data.schema import Response
from rm_jax.score.rules import RulePenalties, RuleResult, check_response


@dataclasses.dataclass(frozen=True)
class RewardWeights:
    p_pass: float = 1.0
    issues: float = 0.5
    img: float = 0.5


class RewardSettings(NamedTuple):
    """The reward's configuration as the CLIs pass it on (``compute_reward(..., *settings)``)."""
    weights: RewardWeights = RewardWeights()
    penalties: RulePenalties = RulePenalties()

    def to_json(self) -> dict:
        return {"weights": dataclasses.asdict(self.weights), "penalties": dataclasses.asdict(self.penalties)}


@dataclasses.dataclass(frozen=True)
class RewardResult:
    reward: float
    rule_score: float
    components: dict   # p_pass_term, issues_term, img_term, rule_violations (list of dicts), gated

    def to_json(self) -> dict:
        return {"reward": self.reward, "rule_score": self.rule_score, "components": self.components}


def sample_has_image(sample) -> bool:
    """Whether the judge saw any image: message parts, or image fields inside tool results."""
    if sample.images:
        return True
    from rm_jax.data.tool_content import parse_tool_content   # local: keeps this module light
    return any(p.text is not None and parse_tool_content(p.text).images
               for m in sample.messages if m.role == "tool" for p in m.parts)


def _count_issues(n_issues: int | Sequence[str]) -> int:
    if isinstance(n_issues, (list, tuple)):
        return len(n_issues)
    if isinstance(n_issues, bool) or int(n_issues) != n_issues or n_issues < 0:
        raise ValueError(f"n_issues must be a non-negative integer or a list of issues, got {n_issues!r}")
    return int(n_issues)


def judge_terms(p_pass: float, n_issues: int | Sequence[str], img: float | None, has_image: bool,
                weights: RewardWeights = RewardWeights()) -> dict[str, float]:
    """The three judge terms, each already weighted and signed as it enters the reward."""
    p = float(p_pass)
    if not (0.0 <= p <= 1.0):   # also rejects NaN
        raise ValueError(f"p_pass must be in [0, 1], got {p_pass!r}")
    issues = _count_issues(n_issues)
    img_term = 0.0
    if has_image and img is not None and not math.isnan(float(img)):
        if not 0 <= img <= 10:
            raise ValueError(f"img must be in 0..10 or None, got {img!r}")
        img_term = weights.img * (float(img) - 5.0) / 5.0
    return {"p_pass_term": weights.p_pass * (2.0 * p - 1.0),
            "issues_term": -weights.issues * issues,
            "img_term": img_term}


def combine(rules: RuleResult, terms: Mapping[str, float], penalties: RulePenalties) -> RewardResult:
    components = {**terms,
                  "rule_violations": [dataclasses.asdict(v) for v in rules.violations],
                  "gated": rules.gated}
    if rules.gated:
        # Exactly the gate value: no float arithmetic on it, whatever the judge said.
        return RewardResult(reward=float(penalties.gate_reward), rule_score=rules.rule_score, components=components)
    reward = rules.rule_score + terms["p_pass_term"] + terms["issues_term"] + terms["img_term"]
    return RewardResult(reward=float(reward), rule_score=rules.rule_score, components=components)


def compute_reward_for(response: Response | Mapping[str, Any], tools: Sequence[Mapping[str, Any]], *,
                       has_image: bool, p_pass: float, n_issues: int | Sequence[str], img: float | None,
                       weights: RewardWeights = RewardWeights(),
                       penalties: RulePenalties = RulePenalties()) -> RewardResult:
    """Reward from the pieces: a Response (or raw {"content", "tool_calls"} dict) and its tools."""
    rules = check_response(response, tools, penalties)
    return combine(rules, judge_terms(p_pass, n_issues, img, has_image, weights), penalties)


def compute_reward(sample, p_pass: float, n_issues: int | Sequence[str], img: float | None,
                   weights: RewardWeights = RewardWeights(), penalties: RulePenalties = RulePenalties(), *,
                   has_image: bool | None = None) -> RewardResult:
    """Reward of a `Sample`'s response given the judge's P(pass), issue count (or list) and img.

    has_image defaults to what the sample shows (message or tool-result images)."""
    if has_image is None:
        has_image = sample_has_image(sample)
    return compute_reward_for(sample.response, sample.tools, has_image=has_image, p_pass=p_pass,
                              n_issues=n_issues, img=img, weights=weights, penalties=penalties)
