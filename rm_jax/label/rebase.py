"""Image paths of a row moved from the input's folder to the output's.

Sample image paths are relative to their JSONL's folder. OUT may be written in any folder, so
each relative path is rewritten to name the same file from OUT's folder (``images/a.png`` read
from ``data/`` and written to ``labels/`` becomes ``../data/images/a.png``); the labelled file
then builds and scores wherever it is.

One function rewrites every reference the pipeline resolves as a file: image content parts,
image fields inside tool results (JSON strings, re-encoded as many times as they were encoded),
and image arguments of tool calls (the judged response's and history turns'). The same path
gets the same new name everywhere, so a call that names the file a tool returned still names it.
Free text (message text, the response's content, ``reference_reply``) is not touched: a path
there is prose. Data URIs, absolute paths and remote URLs (``https://``, ``gs://``, ...) are
kept as written: they mean the same from any folder, and a URL is never a path.

With OUT in the input's folder the rewrite is the identity and rows are written back as read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

from rm_jax.data.string_values import MAX_ARG_DECODES, is_remote_image_ref, looks_like_image_ref

_FILE_SCHEME = "file://"


@dataclasses.dataclass(frozen=True)
class ImageRebase:
    src_dir: str     # absolute: the input JSONL's folder
    dst_dir: str     # absolute: OUT's folder

    @property
    def identity(self) -> bool:
        return os.path.normpath(self.src_dir) == os.path.normpath(self.dst_dir)

    def path(self, ref: Any) -> Any:
        """One image reference, as OUT must write it."""
        if not isinstance(ref, str) or ref.startswith("data:") or is_remote_image_ref(ref):
            return ref
        scheme = ref[:len(_FILE_SCHEME)] if ref.lower().startswith(_FILE_SCHEME) else ""
        body = ref[len(scheme):]
        if os.path.isabs(body):
            return ref
        return scheme + os.path.relpath(os.path.join(self.src_dir, body), self.dst_dir)

    def row(self, obj: dict) -> dict:
        """A copy of one input row with its image references rewritten (the input row itself
        when the folders are the same)."""
        if self.identity:
            return obj
        out = dict(obj)
        if isinstance(obj.get("messages"), list):
            out["messages"] = [self._message(m) for m in obj["messages"]]
        if isinstance(obj.get("response"), dict):
            out["response"] = self._with_calls(obj["response"])
        return out

    # ------------------------------------------------------------ the fields

    def _message(self, msg: Any) -> Any:
        if not isinstance(msg, dict):
            return msg
        out = self._with_calls(msg)
        content = msg.get("content")
        is_tool = msg.get("role") == "tool"
        if isinstance(content, str) and is_tool:
            out["content"] = _rewrite_json_text(content, self.path)
        elif isinstance(content, list):
            out["content"] = [self._part(p, is_tool) for p in content]
        return out

    def _part(self, part: Any, is_tool: bool) -> Any:
        if not isinstance(part, dict):
            return part
        kind = part.get("type")
        out = dict(part)
        if kind in ("image", "image_url") and part.get("image") is not None:
            out["image"] = self.path(part["image"])
        elif kind == "image_url":   # the OpenAI shape, {"image_url": {"url": ...}} or a bare string
            url = part.get("image_url")
            out["image_url"] = dict(url, url=self.path(url.get("url"))) if isinstance(url, dict) else self.path(url)
        elif kind == "text" and is_tool and isinstance(part.get("text"), str):
            out["text"] = _rewrite_json_text(part["text"], self.path)
        return out

    def _with_calls(self, holder: dict) -> dict:
        out = dict(holder)
        calls = holder.get("tool_calls")
        if isinstance(calls, list):
            out["tool_calls"] = [self._call(c) for c in calls]
        return out

    def _call(self, call: Any) -> Any:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            return call
        fn = call["function"]
        args = fn.get("arguments")
        if isinstance(args, str):   # decoded only to an object, as schema.decode_arguments does
            new_args = _rewrite_json_text(args, self.path, containers=(dict,))
        elif isinstance(args, dict):
            new_args = _rewrite_values(args, self.path)
        else:
            return call
        return dict(call, function=dict(fn, arguments=new_args))


def _rewrite_values(value: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(value, dict):
        return {k: _rewrite_values(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_rewrite_values(v, fn) for v in value]
    return fn(value) if looks_like_image_ref(value) else value


def _rewrite_json_text(text: str, fn: Callable[[str], str], containers: tuple[type, ...] = (dict, list)) -> str:
    """Image strings inside JSON text encoded up to MAX_ARG_DECODES times (as the renderer and
    the argument decoder read it); re-encoded as many times. Not JSON, or nothing to rewrite:
    the text as it was."""
    value: Any = text
    depth = 0
    while isinstance(value, str) and depth < MAX_ARG_DECODES:
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, TypeError):
            break
        depth += 1
    if not isinstance(value, containers):
        return text
    new = _rewrite_values(value, fn)
    if new == value:
        return text
    encoded: Any = new
    for _ in range(depth):
        encoded = json.dumps(encoded, ensure_ascii=False)
    return encoded
