"""The sample contract (docs/contracts.md): JSONL lines -> typed, validated records.

Every later stage (build, scoring, labelling) reads samples through `read_samples`, so a bad
row is rejected once, here, with a reason that names the line, the id when known, and the
field. Nothing is dropped silently: each line ends up either as a `Sample` or as a `Reject`.

Two decisions worth knowing:

* Tool-call arguments encoded more than once (the field report's inference server
  ``json.dumps``-ed an already-encoded string, and the teacher judged escaped garbage) are
  decoded up to `MAX_ARG_DECODES` times until an object results. If none results, the raw string
  is kept and the sample is *flagged* (``args_undecodable``), not rejected: the judged response
  really did contain that string, and the judge must learn to see it.
* Image references are resolved at parse time against the JSONL file's folder, so a sample
  means the same thing wherever it is read from; a missing file rejects the sample here, a
  corrupt one when the image is decoded (rm_jax.data.images).
* A remote image reference (``https://...``, ``gs://...``, ``s3://...``: any ``scheme://``
  but ``file://``) is neither fetched nor rejected: it stays in the transcript as the text
  ``[image: URL]``. The judge sees only what it can see; fetching at build or score time would
  make a sample's meaning depend on the network. Such a sample counts as having no image (its
  label's ``img`` is nulled), unless it also holds a real one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterator

from rm_jax.data.string_values import MAX_ARG_DECODES, decode_repeated, is_remote_image_ref, remote_image_text
from rm_jax.data.tool_content import parse_tool_content

ROLES = ("system", "user", "assistant", "tool")
VERDICTS = ("pass", "fail")


class SampleError(ValueError):
    """A row that breaks the contract. `reason` is a short stable code for stats."""

    def __init__(self, reason: str, field: str, detail: str):
        super().__init__(f"{field}: {detail}")
        self.reason, self.field, self.detail = reason, field, detail


@dataclasses.dataclass(frozen=True)
class ImageRef:
    """A reference image: a resolved file path or a data URI, and the sample field it came from
    (named in errors when the file cannot be decoded)."""
    source: str
    field: str = dataclasses.field(default="image", compare=False)

    @property
    def is_data_uri(self) -> bool:
        return self.source.startswith("data:")


@dataclasses.dataclass(frozen=True)
class Part:
    """One piece of message content: text, or an image in place."""
    text: str | None = None
    image: ImageRef | None = None


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str | None
    name: str
    arguments: Any             # decoded object, or the raw string when undecodable
    encode_depth: int          # how many string decodes produced `arguments` (0 = given as object)
    decoded: bool              # False when `arguments` is the raw undecodable string


@dataclasses.dataclass(frozen=True)
class Message:
    role: str
    parts: tuple[Part, ...]
    tool_call_id: str | None = None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()   # only off the online shape; kept when present


@dataclasses.dataclass(frozen=True)
class Response:
    content: str | None
    tool_calls: tuple[ToolCall, ...]

    @property
    def calls_tools(self) -> bool:
        return bool(self.tool_calls)


@dataclasses.dataclass(frozen=True)
class Label:
    l3: str
    reason: str
    issues: tuple[str, ...]
    img: int | None


@dataclasses.dataclass(frozen=True)
class Sample:
    id: str
    prompt_id: str
    messages: tuple[Message, ...]
    tools: tuple[dict, ...]
    response: Response
    reference_reply: str | None
    label: Label | None
    line: int                  # 1-based line in the source file
    base_dir: str              # folder the image paths were resolved against
    flags: tuple[str, ...] = ()

    @property
    def images(self) -> tuple[ImageRef, ...]:
        """Images that appear in message parts, in order (tool-content images come from render)."""
        return tuple(p.image for m in self.messages for p in m.parts if p.image is not None)


@dataclasses.dataclass(frozen=True)
class Reject:
    line: int
    id: str | None
    reason: str
    detail: str

    def to_json(self) -> dict:
        return {"line": self.line, "id": self.id, "reason": self.reason, "detail": self.detail}


# ---------------------------------------------------------------- parsing helpers


def _require(obj: dict, key: str, field: str):
    if key not in obj:
        raise SampleError("missing_field", f"{field}.{key}" if field else key, "required field is missing")
    return obj[key]


def render_error(e: Exception) -> str:
    """The recorded reason for a sample that failed to render: SampleError's own reason, or any
    other exception's type and message (one bad row is rejected with its reason, never fatal)."""
    if isinstance(e, SampleError):
        return f"{e.reason}: {e}"
    return f"render_error: {type(e).__name__}: {e}"


def _expect_type(value, types, field: str, what: str):
    if not isinstance(value, types):
        raise SampleError("bad_type", field, f"expected {what}, got {type(value).__name__}")
    return value


def resolve_image(source: Any, base_dir: str, field: str) -> ImageRef:
    _expect_type(source, str, field, "an image path or data URI")
    if source.lower().startswith("file://"):
        source = source[len("file://"):]
    if source.startswith("data:"):
        if not source.startswith("data:image/") or ";base64," not in source:
            raise SampleError("bad_image_uri", field, "data URI must be data:image/...;base64,...")
        return ImageRef(source, field)
    path = source if os.path.isabs(source) else os.path.join(base_dir, source)
    if not os.path.isfile(path):
        raise SampleError("missing_image", field, f"image file not found: {source}")
    return ImageRef(os.path.normpath(path), field)


def _parse_parts(content: Any, base_dir: str, field: str) -> tuple[Part, ...]:
    if content is None:
        return ()
    if isinstance(content, str):
        return (Part(text=content),)
    _expect_type(content, list, field, "a string or a list of content parts")
    parts = []
    for i, part in enumerate(content):
        pf = f"{field}[{i}]"
        _expect_type(part, dict, pf, "a content part object")
        kind = _require(part, "type", pf)
        if kind == "text":
            parts.append(Part(text=_expect_type(_require(part, "text", pf), str, pf + ".text", "a string")))
        elif kind in ("image", "image_url"):
            src = part.get("image")
            if src is None and kind == "image_url":  # OpenAI shape {"image_url": {"url": ...}}
                url = part.get("image_url")
                src = url.get("url") if isinstance(url, dict) else url
            if src is None:
                raise SampleError("missing_field", pf + ".image", "image part without an image")
            if is_remote_image_ref(src):
                parts.append(Part(text=remote_image_text(src)))
            else:
                parts.append(Part(image=resolve_image(src, base_dir, pf + ".image")))
        else:
            raise SampleError("bad_content_part", pf + ".type", f"unknown content part type {kind!r}")
    return tuple(parts)


def decode_arguments(arguments: Any, max_decodes: int = MAX_ARG_DECODES) -> tuple[Any, int, bool]:
    """Decode possibly multiply-encoded tool-call arguments.

    Returns (value, decodes_used, decoded). A string is json-decoded repeatedly, at most
    `max_decodes` times, until an object (dict) results; otherwise the raw string is returned
    with decoded=False.
    """
    if isinstance(arguments, dict):
        return arguments, 0, True
    if not isinstance(arguments, str):
        return arguments, 0, False
    value, depth = decode_repeated(arguments, max_decodes)
    return (value, depth, True) if isinstance(value, dict) else (arguments, depth, False)


def _parse_tool_calls(calls: Any, field: str) -> tuple[ToolCall, ...]:
    if calls is None:
        return ()
    _expect_type(calls, list, field, "a list of tool calls")
    out = []
    for i, call in enumerate(calls):
        cf = f"{field}[{i}]"
        _expect_type(call, dict, cf, "a tool call object")
        fn = _expect_type(_require(call, "function", cf), dict, cf + ".function", "an object")
        name = _expect_type(_require(fn, "name", cf + ".function"), str, cf + ".function.name", "a string")
        args, depth, ok = decode_arguments(fn.get("arguments", {}))
        out.append(ToolCall(id=_optional_str(call, "id", cf), name=name, arguments=args, encode_depth=depth,
                            decoded=ok))
    return tuple(out)


def _parse_message(msg: Any, base_dir: str, field: str) -> Message:
    _expect_type(msg, dict, field, "a message object")
    role = _require(msg, "role", field)
    if role not in ROLES:
        raise SampleError("unknown_role", field + ".role", f"role {role!r} is not one of {ROLES}")
    parts = _parse_parts(msg.get("content"), base_dir, field + ".content")
    tool_calls = _parse_tool_calls(msg.get("tool_calls"), field + ".tool_calls") if role == "assistant" else ()
    if role == "tool" and not parts:
        raise SampleError("missing_field", field + ".content", "tool message without content")
    return Message(role=role, parts=parts, tool_call_id=_optional_str(msg, "tool_call_id", field),
                   name=_optional_str(msg, "name", field), tool_calls=tool_calls)


def _optional_str(obj: dict, key: str, field: str) -> str | None:
    """An optional string field (ids, names): absent/null -> None, anything but a string is refused."""
    value = obj.get(key)
    if value is not None:
        _expect_type(value, str, f"{field}.{key}", "a string or null")
    return value


def _parse_label(label: Any, has_image: bool) -> Label:
    _expect_type(label, dict, "label", "an object")
    l3 = _require(label, "l3", "label")
    if l3 not in VERDICTS:
        raise SampleError("invalid_label", "label.l3", f"verdict {l3!r} is not 'pass' or 'fail'")
    reason = label.get("reason", "")
    _expect_type(reason, str, "label.reason", "a string")
    issues = label.get("issues")
    issues = [] if issues is None else issues
    _expect_type(issues, list, "label.issues", "a list of strings")
    if not all(isinstance(x, str) for x in issues):
        raise SampleError("invalid_label", "label.issues", "every issue must be a string")
    img = label.get("img")
    if img is not None:
        # isfinite first: json.loads accepts NaN and Infinity, on which int() raises.
        if (isinstance(img, bool) or not isinstance(img, (int, float)) or not math.isfinite(img)
                or img != int(img) or not 0 <= img <= 10):
            raise SampleError("invalid_label", "label.img", f"img {img!r} is not an integer in 0..10 or null")
        img = int(img)
    # The image term means nothing without an image: null it whatever the teacher wrote.
    return Label(l3=l3, reason=reason, issues=tuple(issues), img=img if has_image else None)


def _key_string(value: Any, field: str) -> str:
    """An id-like key: a non-empty string (an integer is taken as its decimal string)."""
    if not isinstance(value, (str, int)) or isinstance(value, bool) or str(value) == "":
        raise SampleError("bad_type", field, f"{field} must be a non-empty string, got {value!r}")
    return str(value)


def parse_sample(obj: Any, *, line: int, base_dir: str, require_label: bool = True) -> Sample:
    """Validate one decoded JSON object. Raises SampleError naming the field."""
    _expect_type(obj, dict, "<root>", "a JSON object")
    sid = _key_string(_require(obj, "id", ""), "id")
    prompt_id = obj.get("prompt_id")
    prompt_id = sid if prompt_id is None else _key_string(prompt_id, "prompt_id")
    msgs = _expect_type(_require(obj, "messages", ""), list, "messages", "a list of messages")
    messages = tuple(_parse_message(m, base_dir, f"messages[{i}]") for i, m in enumerate(msgs))
    if not messages:
        raise SampleError("missing_field", "messages", "at least one message is required")
    tools = obj.get("tools") or []
    _expect_type(tools, list, "tools", "a list of function schemas")
    for i, t in enumerate(tools):
        _expect_type(t, dict, f"tools[{i}]", "a function schema object")
    resp = _expect_type(_require(obj, "response", ""), dict, "response", "an object")
    content = resp.get("content")
    if content is not None:
        _expect_type(content, str, "response.content", "a string or null")
    calls = _parse_tool_calls(resp.get("tool_calls"), "response.tool_calls")
    if not calls and not (content or "").strip():
        raise SampleError("empty_response", "response", "the judged response has neither content nor tool calls")
    ref = obj.get("reference_reply")
    if ref is not None:
        _expect_type(ref, str, "reference_reply", "a string")
    flags = tuple(sorted({"args_undecodable" for c in calls if not c.decoded}))
    has_image = any(p.image is not None for m in messages for p in m.parts) or _tool_content_has_image(messages)
    label = obj.get("label")
    if label is None and require_label:
        raise SampleError("missing_field", "label", "required field is missing")
    return Sample(id=sid, prompt_id=prompt_id, messages=messages, tools=tuple(tools),
                  response=Response(content=content, tool_calls=calls), reference_reply=ref,
                  label=None if label is None else _parse_label(label, has_image), line=line,
                  base_dir=base_dir, flags=flags)


def _tool_content_has_image(messages: tuple[Message, ...]) -> bool:
    for m in messages:
        if m.role == "tool":
            for p in m.parts:
                if p.text is not None and parse_tool_content(p.text).images:
                    return True
    return False


def iter_jsonl(path: str) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            # A UTF-8 byte-order mark (some Windows tools write one) is not part of the first row.
            yield i, (raw[3:] if i == 1 and raw.startswith(b"\xef\xbb\xbf") else raw)


def parse_line(raw: bytes, *, line: int, base_dir: str, require_label: bool = True) -> Sample | Reject | None:
    """One JSONL line -> Sample, Reject, or None for a blank line (blank lines are not rows)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Reject(line, None, "non_utf8", f"line {line}: invalid UTF-8 at byte {e.start}")
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Reject(line, None, "malformed_json", f"line {line}: {e.msg} at column {e.colno}")
    except RecursionError:
        return Reject(line, None, "malformed_json", f"line {line}: JSON nested too deeply to parse")
    sid = obj.get("id") if isinstance(obj, dict) else None
    sid = str(sid) if isinstance(sid, (str, int)) and not isinstance(sid, bool) else None
    try:
        return parse_sample(obj, line=line, base_dir=base_dir, require_label=require_label)
    except SampleError as e:
        return Reject(line, sid, e.reason, f"line {line}, id {sid or '?'}, field {e.field}: {e.detail}")


def read_samples(path: str, *, require_label: bool = True) -> Iterator[Sample | Reject]:
    """Every non-blank line of a JSONL file as a Sample or a Reject; duplicate ids are rejected."""
    for item, _ in read_rows(path, require_label=require_label):
        yield item


def read_rows(path: str, *, require_label: bool = True) -> Iterator[tuple[Sample | Reject, bytes]]:
    """`read_samples` with each row's raw line (the labeller writes the input row back as it was)."""
    base_dir = os.path.dirname(os.path.abspath(path))
    seen: set[str] = set()
    for line, raw in iter_jsonl(path):
        item = parse_line(raw, line=line, base_dir=base_dir, require_label=require_label)
        if item is None:
            continue
        if isinstance(item, Sample):
            if item.id in seen:
                item = Reject(line, item.id, "duplicate_id", f"line {line}, id {item.id}, field id: duplicate id")
            else:
                seen.add(item.id)
        yield item, raw
