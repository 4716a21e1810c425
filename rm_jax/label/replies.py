"""Teacher replies -> typed values. The verdict goes through the training target's tolerant
parser (strict JSON, code fences, the first balanced object, an unclosed object, the l3 slot),
so a teacher's reply is read exactly as a judge's output is."""

from __future__ import annotations

import dataclasses
import json
import re

from rm_jax.data import target as target_lib
from rm_jax.label.client import UnusableReply


@dataclasses.dataclass(frozen=True)
class VerdictReply:
    l3: str
    reason: str
    issues: tuple[str, ...]
    img: int | None          # what the verdict teacher wrote (used only without an image head)
    status: str              # target.parse_output's "ok" | "recovered"


def parse_verdict(text: str) -> VerdictReply:
    got = target_lib.parse_output(text)
    if got.l3 is None:
        raise UnusableReply(f"no verdict in the reply: {text[:120]!r}")
    return VerdictReply(got.l3, got.reason or "", got.issues, got.img, got.status)


def _score(value) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if value == int(value) and 0 <= value <= 10 else None


def parse_image_score(text: str) -> int | None:
    """The 0-10 consistency score: a JSON object's "img", else the last `img": N` in the text.
    None when the teacher's object says ``"img": null`` (it declined to score: asking again at
    temperature 0 gets the same answer); the caller records that, it does not pass for a score."""
    start = text.find("{")
    obj = None
    if start >= 0:
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[start:])
        except json.JSONDecodeError:
            obj = None
    if isinstance(obj, dict) and "img" in obj:
        if _score(obj["img"]) is not None:
            return _score(obj["img"])
        if obj["img"] is None:
            return None
    # A damaged object (a small teacher wrote '"img":img": 8}'): the last `img": N` in the text.
    found = re.findall(r'img"?\s*:\s*(\d+(?:\.0)?)(?![\d.])', text)
    if found and _score(float(found[-1])) is not None:
        return int(float(found[-1]))
    raise UnusableReply(f"no 0-10 img score in the reply: {text[:120]!r}")
