"""The contracts the teacher reads, each with a stable id and the sha256 of its text.

The verdict contract is routed exactly as the training renderer routes it (render.route_of):
the tool-call contract only when the judged response calls tools. The field report's first
teacher got the tool-call contract for every sample and invented tool calls for text answers to
fill its format. label_meta records the id and hash, so a later contract edit is visible in the
labels (and a relabel can be scoped to the rows labelled under the old text).
"""

from __future__ import annotations

import dataclasses
import hashlib

from configs import judge_contracts
from rm_jax.data.render import ROUTE_TEXT_ONLY, ROUTE_TOOL_CALL, RenderConfig

IMAGE_CONTRACT_ID = "image_consistency"


@dataclasses.dataclass(frozen=True)
class Contract:
    id: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


# The full texts: a teacher is a real model that reads instructions (the compact ones exist only
# for the tiny CPU judge).
TEACHER_RENDER = RenderConfig(tool_contract=judge_contracts.TOOL_CALL_CONTRACT,
                              text_contract=judge_contracts.TEXT_ONLY_CONTRACT)

VERDICT_CONTRACTS = {
    ROUTE_TOOL_CALL: Contract(ROUTE_TOOL_CALL, TEACHER_RENDER.tool_contract),
    ROUTE_TEXT_ONLY: Contract(ROUTE_TEXT_ONLY, TEACHER_RENDER.text_contract),
}
IMAGE_CONTRACT = Contract(IMAGE_CONTRACT_ID, judge_contracts.IMAGE_CONSISTENCY_CONTRACT)
