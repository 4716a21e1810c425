"""The judge's output: verdict JSON serialization, the verdict slot, and a tolerant parser.

Why the verdict comes first: P(pass) is read from the logits at the verdict slot after one
prefill. If the reason is written first, the verdict token is conditioned on a reason that
already argues for it, and its probability collapses to 0/1 (field report: AUC 0.61
reason-first vs 0.91 verdict-first). Field order is still a config option for that ablation.

The target is tokenized in three pieces — the text before the verdict word, the verdict word,
the rest — and concatenated. That pins the slot to a token boundary for any tokenizer (a BPE
would otherwise happily merge ``"pass`` into one token) and makes the scorer's prefix
(`verdict_prefix`) tokenize to exactly the tokens the model was trained on.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

from rm_jax.data.schema import Label

FIELDS = ("l3", "reason", "issues", "img")
VERDICT_FIRST = FIELDS
SLOT_MARK = "\x00VERDICT\x00"


def _check_order(field_order: Sequence[str]) -> tuple[str, ...]:
    order = tuple(field_order)
    if sorted(order) != sorted(FIELDS):
        raise ValueError(f"field_order {order} must be a permutation of {FIELDS}")
    return order


def serialize_label(label: Label, field_order: Sequence[str] = VERDICT_FIRST, *, has_image: bool = True) -> str:
    """The target text, e.g. {"l3": "pass", "reason": "...", "issues": [], "img": 9}."""
    values = {"l3": label.l3, "reason": label.reason, "issues": list(label.issues),
              "img": label.img if has_image else None}
    return "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(values[k], ensure_ascii=False)}"
                           for k in _check_order(field_order)) + "}"


@dataclasses.dataclass(frozen=True)
class TargetPieces:
    prefix: str      # everything before the verdict word, ending in '"l3": "'
    verdict: str     # "pass" | "fail"
    rest: str        # closing quote onward


def split_at_verdict(target: str, verdict: str) -> TargetPieces:
    key = '"l3": "'
    i = target.index(key) + len(key)   # the key itself, never a "pass" inside the reason
    if not target.startswith(verdict, i):
        raise ValueError(f"target does not carry verdict {verdict!r} at the l3 slot: {target!r}")
    return TargetPieces(target[:i], verdict, target[i + len(verdict):])


def verdict_prefix(field_order: Sequence[str] = VERDICT_FIRST) -> str | None:
    """Text the scorer appends before reading the slot, or None when it must be decoded
    (fields before l3 depend on the sample, i.e. the reason-first ablation)."""
    order = _check_order(field_order)
    return '{"l3": "' if order[0] == "l3" else None


@dataclasses.dataclass(frozen=True)
class VerdictTokens:
    """First token ids of each verdict word at the slot (must differ) and their full ids."""
    pass_id: int
    fail_id: int
    pass_ids: tuple[int, ...]
    fail_ids: tuple[int, ...]


def encode_piece(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def verdict_tokens(tokenizer) -> VerdictTokens:
    p, f = encode_piece(tokenizer, "pass"), encode_piece(tokenizer, "fail")
    if not p or not f or p[0] == f[0]:
        raise ValueError(f"'pass' and 'fail' must start with distinct tokens; got {p} and {f}")
    return VerdictTokens(p[0], f[0], tuple(p), tuple(f))


# ---------------------------------------------------------------- parsing model output


@dataclasses.dataclass(frozen=True)
class ParsedVerdict:
    l3: str | None
    reason: str | None
    issues: tuple[str, ...]
    img: int | None
    status: str      # "ok" (strict JSON), "recovered" (tolerant), "failed"


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)


def _from_obj(obj: Any, status: str) -> ParsedVerdict | None:
    if not isinstance(obj, dict):
        return None
    l3 = obj.get("l3")
    l3 = l3 if l3 in ("pass", "fail") else None
    issues = obj.get("issues")
    issues = tuple(str(x) for x in issues) if isinstance(issues, list) else ()
    img = obj.get("img")
    img = int(img) if isinstance(img, (int, float)) and not isinstance(img, bool) and 0 <= img <= 10 else None
    reason = obj.get("reason")
    return ParsedVerdict(l3, reason if isinstance(reason, str) else None, issues, img,
                         status if l3 is not None else "failed")


def parse_output(text: str) -> ParsedVerdict:
    """Strict JSON first; then code fences, then the first balanced {...} with trailing text."""
    try:
        got = _from_obj(json.loads(text), "ok")
        if got is not None:
            return got
    except json.JSONDecodeError:
        pass
    candidates = [m.group(1) for m in _FENCE.finditer(text)]
    start = text.find("{")
    if start >= 0:
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[start:])
            candidates.insert(0, json.dumps(obj))
        except json.JSONDecodeError:
            # An unclosed object (decoding stopped at the token budget): close it and retry.
            candidates.append(text[start:].rstrip().rstrip(",") + ('"' if text.count('"') % 2 else "") + "}")
    for cand in candidates:
        try:
            got = _from_obj(json.loads(cand), "recovered")
        except json.JSONDecodeError:
            continue
        if got is not None and got.l3 is not None:
            return got
    # Last resort: the slot itself, never the first "pass" in free text.
    m = re.search(r'"l3"\s*:\s*"(pass|fail)"', text)
    if m:
        return ParsedVerdict(m.group(1), None, (), None, "recovered")
    return ParsedVerdict(None, None, (), None, "failed")
