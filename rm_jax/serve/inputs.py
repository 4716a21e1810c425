"""Request samples -> ``Sample`` records, with image paths confined to ``--image_root``.

A request's image is a data URI, a path relative to the server's image root, or a remote URL,
which stays ``[image: URL]`` text as in build and ``launch.score`` (nothing is fetched). Paths are checked
on the raw JSON *before* the sample parser touches the file system: a path that resolves (after
``..`` and symlinks) outside the root is refused without revealing whether the file exists.
Tool results are checked too, since their image fields are opened at render time.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from rm_jax.data.schema import Sample, SampleError, is_remote_image_ref, parse_sample


@dataclasses.dataclass(frozen=True)
class BadSample:
    """A request sample that cannot be scored: its row is ``{"id", "error"}``."""
    id: str | None
    error: str

    def row(self) -> dict:
        return {"id": self.id, "error": self.error}


def _image_sources(obj: dict):
    """(field, source) of every image path a sample names: message parts and tool-result fields."""
    from rm_jax.data.tool_content import parse_tool_content
    messages = obj.get("messages")
    if not isinstance(messages, list):
        return
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            continue
        content = msg.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    continue
                src = part.get("image")
                if src is None and isinstance(part.get("image_url"), dict):
                    src = part["image_url"].get("url")
                if isinstance(src, str):
                    yield f"messages[{i}].content[{j}].image", src
        if msg.get("role") == "tool" and isinstance(content, str):
            for src in parse_tool_content(content).images:
                yield f"messages[{i}].content<image field>", src


def check_image_paths(obj: dict, image_root: str | None) -> None:
    """Raises SampleError naming the field of a path image outside ``image_root`` (or of any path
    image when the server has no image root)."""
    root = os.path.realpath(image_root) if image_root else None
    for field, src in _image_sources(obj):
        if src.startswith("data:") or is_remote_image_ref(src):    # a URL is shown as [image: URL] text
            continue
        if root is None:
            raise SampleError("image_path_refused", field,
                              "image paths need the server's --image_root; send the image as a data URI")
        if os.path.isabs(src):
            raise SampleError("image_path_refused", field, f"absolute path {src!r}: paths are relative to --image_root")
        resolved = os.path.realpath(os.path.join(root, src))
        if os.path.commonpath([resolved, root]) != root:
            raise SampleError("image_path_refused", field, f"path {src!r} resolves outside --image_root")


def parse_request_sample(obj: Any, index: int, image_root: str | None) -> Sample | BadSample:
    sid = obj.get("id") if isinstance(obj, dict) else None
    sid = str(sid) if isinstance(sid, (str, int)) and not isinstance(sid, bool) else None
    try:
        if not isinstance(obj, dict):
            raise SampleError("bad_type", f"samples[{index}]", f"expected a sample object, got {type(obj).__name__}")
        check_image_paths(obj, image_root)
        return parse_sample(obj, line=index + 1, base_dir=os.path.realpath(image_root) if image_root else os.getcwd(),
                            require_label=False)
    except SampleError as e:
        return BadSample(sid, f"{e.reason}: samples[{index}].{e.field}: {e.detail}")
