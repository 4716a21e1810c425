"""Tool results as the judge reads them: compact text with images in place.

Online, tool results arrive as JSON *strings* (``{"status":"ok","images":[{"image":...}]}``).
Shown raw, they cost tokens on quotes and escapes and hide the images they point to. We decode
them (up to the same 4 levels as tool-call arguments), print a compact ``key: value`` form, and
cut the text at every image field so the image itself goes to the vision input at that spot,
right after the file name (``image: images/g.png <image>``; a data URI shows only the image).
A remote reference (``https://...``, ``gs://...``) is only text, ``[image: URL]``: it is never
fetched (string_values.is_remote_image_ref).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rm_jax.data.string_values import decode_repeated, is_remote_image_ref, looks_like_image_ref, remote_image_text


@dataclasses.dataclass(frozen=True)
class ToolContent:
    """Alternating text and image references, in reading order."""
    segments: tuple[str | "ImageField", ...]

    @property
    def images(self) -> tuple[str, ...]:
        return tuple(s.source for s in self.segments if isinstance(s, ImageField))


@dataclasses.dataclass(frozen=True)
class ImageField:
    source: str   # as written in the tool result (relative path or data URI)


def _scalar(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return " ".join(v.split())   # collapse newlines: one result stays one block
    return json.dumps(v)


def _emit(value: Any, out: list, top: bool = False) -> None:
    def text(s: str) -> None:
        if out and isinstance(out[-1], str):
            out[-1] += s
        else:
            out.append(s)

    if isinstance(value, dict):
        if not top:
            text("{")
        for i, (k, v) in enumerate(value.items()):
            text(("" if i == 0 else ", ") + f"{k}: ")
            _emit(v, out)
        if not top:
            text("}")
    elif isinstance(value, list):
        text("[")
        for i, v in enumerate(value):
            if i:
                text(", ")
            _emit(v, out)
        text("]")
    elif is_remote_image_ref(value) and looks_like_image_ref(value):
        text(remote_image_text(value))
    elif looks_like_image_ref(value):
        # A file reference keeps its name in the text: a response that cites or edits a file
        # is checked against the names the tool returned (the policy saw them too). Inline
        # data URIs are only the image.
        if not value.startswith("data:"):
            text(_scalar(value) + " ")
        out.append(ImageField(value))
    else:
        text(_scalar(value))


def parse_tool_content(text: str) -> ToolContent:
    """Compact a tool result; non-JSON content is kept verbatim (it is what the policy saw)."""
    value, _ = decode_repeated(text)
    if not isinstance(value, (dict, list)):
        return ToolContent((text,))
    out: list = []
    _emit(value, out, top=True)
    return ToolContent(tuple(s for s in out if not (isinstance(s, str) and s == "")))
