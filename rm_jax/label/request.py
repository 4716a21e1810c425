"""A Sample -> the teacher's OpenAI chat requests (verdict head, image head).

The transcript is the training renderer's own (render.judge_chat): history assistant turns as
they are, orphan tool results as their own entries, JSON tool content compacted with its images
in place, tool-call arguments decoded up to 4 times. So the teacher judges what the student will
read. Differences, each because the teacher is reached over the OpenAI API:

* Tool schemas go into the user message as text (the student reads them from its chat
  template). Passing them as the request's ``tools`` would offer them to the teacher to call.
* Images go as ``image_url`` data URIs of thumbnails (``thumbnail_edge`` px on the long edge,
  never upscaled): three concurrent full-resolution multi-image requests saturated the field
  report's image teacher; 512-px thumbnails at concurrency 2 held.
* The policy's text is guarded against the Qwen chat control tokens (the teacher's server
  applies its template to our text; a response holding ``<|im_end|>`` must not end the turn).

A remote image URL (``https://``, ``gs://``, ...) reaches the teacher as the text ``[image: URL]``,
exactly as build and scoring show it to the judge, and is never fetched: a teacher that looked at
the picture would label evidence the student never sees, and the labels would depend on the
network. Such a sample counts as having no image (``img`` null), as in the build.

The image head gets every image, in order: the conversation's (message parts and tool results)
and then those the judged response's tool-call arguments name. The report's first image head
sent only the first 4 and misjudged samples whose evidence was in images 5-8.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rm_jax.data import images as images_lib
from rm_jax.data.render import SpecialTokenGuard, judge_chat, route_of
from rm_jax.data.schema import ImageRef, Sample, SampleError, resolve_image
from rm_jax.data.string_values import is_remote_image_ref, looks_like_image_ref
from rm_jax.label.contracts import IMAGE_CONTRACT, TEACHER_RENDER, VERDICT_CONTRACTS, Contract

HEAD_VERDICT = "verdict"
HEAD_IMAGE = "image"
# Qwen's chat control tokens (the teachers are Qwen-family or serve a Qwen template). Named here,
# not taken from a model config: a labeller needs no model code (importing one costs ~200 MB and
# seconds per run). The tiny judge's tokenizer registers no token outside this list (tested).
QWEN_CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<tool_response>",
                       "</tool_response>")
TEACHER_GUARD = SpecialTokenGuard(tokens=QWEN_CONTROL_TOKENS)


@dataclasses.dataclass(frozen=True)
class TeacherRequest:
    head: str
    contract: Contract
    messages: list[dict]
    n_images: int


@dataclasses.dataclass(frozen=True)
class SampleRequests:
    route: str
    has_image: bool               # the conversation holds an image: img is scored, else null
    verdict: TeacherRequest
    image: TeacherRequest | None  # None without images or without an image endpoint


class Thumbnails:
    """Thumbnail data URIs of one sample's images, each encoded once (both heads send them)."""

    def __init__(self, edge: int):
        self.edge = edge
        self._cache: dict[str, str] = {}

    def uri(self, ref: ImageRef) -> str:
        """Raises SampleError (missing/corrupt image) with the sample field that named it."""
        if ref.source not in self._cache:
            img = images_lib.thumbnail(images_lib.load_image(ref.source, ref.field), self.edge)
            # JPEG: a 512-px photo is ~50 KB instead of ~400 KB as PNG (load_image gives RGB).
            self._cache[ref.source] = images_lib.to_data_uri(img, "JPEG")
        return self._cache[ref.source]


def _image_part(uri: str) -> dict:
    return {"type": "image_url", "image_url": {"url": uri}}


def _openai_content(parts: list[dict], refs: list[ImageRef], thumbs: Thumbnails) -> list[dict]:
    out: list[dict] = []
    k = 0
    for part in parts:
        if part["type"] == "image":
            out.append(_image_part(thumbs.uri(refs[k])))
            k += 1
        else:
            out.append({"type": "text", "text": part["text"]})
    return out


def _tools_text(sample: Sample) -> str:
    if not sample.tools:
        return ""
    lines = [json.dumps(TEACHER_GUARD.json(t), ensure_ascii=False) for t in sample.tools]
    return "## Tools the assistant could call\n" + "\n".join(lines) + "\n"


def _prepend_text(content: list[dict], text: str) -> list[dict]:
    if not text:
        return content
    if content and content[0]["type"] == "text":
        return [{"type": "text", "text": text + content[0]["text"]}] + content[1:]
    return [{"type": "text", "text": text}] + content


def _image_strings(value: Any, key: str = "") -> list[tuple[str, str]]:
    """(argument key, image string) for every image reference inside decoded arguments."""
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _image_strings(v, k)]
    if isinstance(value, list):
        return [x for v in value for x in _image_strings(v, key)]
    return [(key, value)] if looks_like_image_ref(value) else []


def response_images(sample: Sample) -> list[tuple[str, str, ImageRef | None]]:
    """(call name.argument, as written, resolved ref or None when there is no file to send), in
    order. A missing file is not bad input: the response really named it (a hallucinated
    reference); the teacher is told it does not exist. A remote URL is never read as a path."""
    out = []
    for call in sample.response.tool_calls:
        for key, src in _image_strings(call.arguments):
            if is_remote_image_ref(src):
                out.append((f"{call.name}.{key}", src, None))
                continue
            try:
                ref = resolve_image(src, sample.base_dir, f"response.tool_calls[{call.name}].{key}")
            except SampleError:
                ref = None
            out.append((f"{call.name}.{key}", src, ref))
    return out


def build_requests(sample: Sample, thumbnail_edge: int, image_head: bool) -> SampleRequests:
    """Both heads' requests. Raises SampleError when a conversation image is missing or corrupt
    (the sample is rejected with that reason, as the build would)."""
    thumbs = Thumbnails(thumbnail_edge)
    chat, refs = judge_chat(sample, TEACHER_RENDER, TEACHER_GUARD)
    route = route_of(sample)
    content = _prepend_text(_openai_content(chat[1]["content"], refs, thumbs), _tools_text(sample))
    contract = VERDICT_CONTRACTS[route]
    verdict = TeacherRequest(HEAD_VERDICT, contract,
                             [{"role": "system", "content": contract.text}, {"role": "user", "content": content}],
                             len(refs))
    has_image = bool(refs)
    image = None
    if image_head and has_image:
        extra: list[dict] = []
        n = len(refs)
        named = response_images(sample)
        if named:
            extra.append({"type": "text", "text": "\n## Images the response refers to\n"})
        for where, src, ref in named:
            label = TEACHER_GUARD(f"[{where}: {src if not src.startswith('data:') else 'inline image'}]")
            uri = None
            if ref is not None:
                try:
                    uri = thumbs.uri(ref)
                except SampleError:
                    uri = None
            if uri is None:
                missing = " (remote image, not fetched)" if is_remote_image_ref(src) else " (no such image)"
                extra.append({"type": "text", "text": label + missing + "\n"})
            else:
                extra.append({"type": "text", "text": label + "\n"})
                extra.append(_image_part(uri))
                n += 1
        image = TeacherRequest(HEAD_IMAGE, IMAGE_CONTRACT,
                               [{"role": "system", "content": IMAGE_CONTRACT.text},
                                {"role": "user", "content": content + extra}], n)
    return SampleRequests(route, has_image, verdict, image)


def request_images(messages: list[dict]) -> list[str]:
    """The image data URIs of a chat request, in order (tests and the proxy check what arrived)."""
    out = []
    for m in messages:
        if isinstance(m.get("content"), list):
            out += [p["image_url"]["url"] for p in m["content"] if p.get("type") == "image_url"]
    return out
