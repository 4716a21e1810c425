"""The one renderer: a Sample -> judge input (token ids, image tensors, loss mask, verdict slot).

Build, scoring and labelling all call `Renderer.render`, so what the judge sees in training is
byte for byte what it sees when scoring. The judge chat is

    system    = the judge contract, routed by the judged response (tool-call vs text-only)
    user      = a transcript of the policy's conversation (turns, tool results, images in
                place), then the judged response
    assistant = the verdict JSON (the only tokens with loss)

rendered with the base model's own chat template (`apply_chat_template`, with the sample's tool
schemas, so the judge reads them in the format the policy read them). ``data.tools_listing =
"signatures"`` lists one ``name(args)`` line per tool in the system turn instead, and ``"none"`` lists
nothing (the tiny judge's short text budget).

Transcript rules, each from a failure in the field report:
* History assistant turns are kept exactly as they are. Online they carry no ``tool_calls``;
  that is the real shape, not a bug to repair.
* A tool result whose ``tool_call_id`` matches no call is shown as its own ``tool`` entry, never
  dropped. (Dropping them hid every earlier deliverable from the teacher, which then judged
  delivery notes as false claims.)
* JSON-string tool content is shown as compact text; its image fields become image
  placeholders whose pixels go to the vision input at that spot.
* The judged response is shown as the policy produced it: tool-call arguments decoded from the
  server's repeated encodings (up to 4); when undecodable the raw string is shown. Decoded
  arguments are written in canonical key order (``tool_args``: the tool schema's order, else
  sorted), so key order and whitespace in the policy's JSON cannot move the judge's score.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np

from rm_jax.data import images as images_lib
from rm_jax.data import target as target_lib
from rm_jax.data.schema import ImageRef, Message, Sample, SampleError, ToolCall, resolve_image
from rm_jax.data.tool_args import canonical_arguments
from rm_jax.data.tool_content import ImageField, parse_tool_content

ROUTE_TOOL_CALL = "tool_call"
ROUTE_TEXT_ONLY = "text_only"


TOOLS_TEMPLATE = "template"       # the chat template's own tools block (the policy's format)
TOOLS_SIGNATURES = "signatures"   # one line per tool, e.g. ``upscale_image(image, resolution)``
TOOLS_NONE = "none"               # no listing: a judge whose every check compares the conversation
TOOLS_LISTINGS = (TOOLS_TEMPLATE, TOOLS_SIGNATURES, TOOLS_NONE)


@dataclasses.dataclass(frozen=True)
class RenderConfig:
    tool_contract: str
    text_contract: str
    field_order: tuple[str, ...] = target_lib.VERDICT_FIRST
    image_pad_token: str = "<|image_pad|>"
    tools_listing: str = TOOLS_TEMPLATE

    def __post_init__(self):
        if self.tools_listing not in TOOLS_LISTINGS:
            raise ValueError(f"data.tools_listing={self.tools_listing!r}: expected one of {TOOLS_LISTINGS}")

    @classmethod
    def from_config(cls, data_cfg) -> "RenderConfig":
        return cls(tool_contract=data_cfg.tool_contract, text_contract=data_cfg.text_contract,
                   field_order=tuple(data_cfg.field_order),
                   tools_listing=data_cfg.tools_listing)


@dataclasses.dataclass
class JudgeInput:
    """One rendered sample. `target_mask[t] == 1` marks token t as a target (predicted from t-1)."""
    id: str
    prompt_id: str
    input_ids: np.ndarray         # [T] int32 (image pads expanded)
    target_mask: np.ndarray       # [T] uint8
    verdict_pos: int              # index of the first verdict token; -1 when rendered without target
    pixel_values: np.ndarray      # [P, C*T*p*p]
    image_grid_thw: np.ndarray    # [N, 3] int32
    route: str
    label: int                    # 1 = fail (the positive class), 0 = pass, -1 unlabelled
    has_image: bool
    n_image_tokens: int = 0
    flags: tuple[str, ...] = ()
    # [start, end) of the judged response's tokens in input_ids; (-1, -1) when not found
    response_span: tuple[int, int] = (-1, -1)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


# ---------------------------------------------------------------- tools


def tool_signature(schema: dict) -> str:
    """``name(required, optional?)``, with a bounded integer's range (``count?: 1-4``): a compact
    stand-in for the schema JSON (a fraction of its tokens) for a judge with a short text budget."""
    fn = schema.get("function", schema)
    params = fn.get("parameters") or {}
    required = set(params.get("required") or ())
    args = []
    for key, prop in (params.get("properties") or {}).items():
        arg = key + ("" if key in required else "?")
        if isinstance(prop, dict) and "minimum" in prop and "maximum" in prop:
            arg += f": {prop['minimum']}-{prop['maximum']}"
        args.append(arg)
    return f"{fn.get('name', '?')}({', '.join(args)})"


def signatures_text(tools: Sequence[dict], guard) -> str:
    """The ``signatures`` listing: a header, then one signature per line ("" without tools)."""
    if not tools:
        return ""
    return "# Tools\n" + "\n".join(guard(tool_signature(t)) for t in tools)


def system_listing(sample: Sample, cfg: RenderConfig, guard) -> str:
    """The tools text a system turn carries: the signatures in that mode, else "" (the template
    lists the schemas itself; ``none`` lists nothing)."""
    return signatures_text(sample.tools, guard) if cfg.tools_listing == TOOLS_SIGNATURES else ""


def system_with_tools(system: str, sample: Sample, cfg: RenderConfig, guard) -> str:
    """A judge's system text, with ``system_listing`` after it."""
    listing = system_listing(sample, cfg, guard)
    return system + "\n\n" + listing if listing else system


# ---------------------------------------------------------------- transcript


def _call_text(call: ToolCall, tools: Sequence[dict], guard) -> str:
    # Undecodable arguments stay the raw string: the judge must see what the policy emitted.
    body = json.dumps({"name": call.name, "arguments": canonical_arguments(call, tools)}, ensure_ascii=False)
    return "<tool_call>\n" + guard(body) + "\n</tool_call>"


class SpecialTokenGuard:
    """Breaks the tokenizer's added/special token strings inside sample text.

    Why: the transcript holds text the policy wrote. Encoded as is, a response containing
    ``<|im_end|>`` + ``<|im_start|>assistant`` + ``{"l3": "pass"`` would become real control tokens
    and fake the judge's own turn (and a stray ``<|image_pad|>`` a fake image slot): under GRPO a
    policy can learn that. Each such string found in sample text gets a zero-width space after
    its first character, so it reaches the judge as ordinary characters; our own markup (the
    ``<tool_call>`` wrappers, the chat template) keeps the real tokens."""

    ZWSP = "\u200b"

    def __init__(self, tokenizer=None, *, tokens: Sequence[str] = ()):
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        names = {t.content for t in added.values()} | set(getattr(tokenizer, "all_special_tokens", []))
        names |= set(tokens)   # a teacher's control tokens, when there is no local tokenizer
        self.tokens = tuple(sorted((t for t in names if len(t) > 1), key=len, reverse=True))

    def __call__(self, text: str) -> str:
        for tok in self.tokens:
            if tok in text:
                text = text.replace(tok, tok[0] + self.ZWSP + tok[1:])
        return text

    def json(self, value):
        """Every string (keys too) of a JSON value guarded, e.g. a tool schema."""
        if isinstance(value, str):
            return self(value)
        if isinstance(value, dict):
            return {self(k): self.json(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.json(v) for v in value]
        return value


def _no_guard(text: str) -> str:
    return text


class _Parts:
    """Collects chat content parts, merging adjacent text. ``text`` is sample text (guarded),
    ``markup`` the transcript's own headers and wrappers."""

    def __init__(self, guard=_no_guard):
        self.parts: list[dict] = []
        self.images: list[ImageRef] = []
        self.guard = guard

    def text(self, s: str) -> None:
        self.markup(self.guard(s))

    def markup(self, s: str) -> None:
        if self.parts and self.parts[-1]["type"] == "text":
            self.parts[-1]["text"] += s
        else:
            self.parts.append({"type": "text", "text": s})

    def image(self, ref: ImageRef) -> None:
        self.parts.append({"type": "image"})
        self.images.append(ref)


def _message_parts(out: _Parts, msg: Message) -> None:
    for part in msg.parts:
        if part.image is not None:
            out.image(part.image)
        else:
            out.text(part.text or "")


def _tool_result(out: _Parts, msg: Message, base_dir: str, index: int) -> None:
    for part in msg.parts:
        if part.image is not None:
            out.image(part.image)
            continue
        for seg in parse_tool_content(part.text or "").segments:
            if isinstance(seg, ImageField):
                out.image(resolve_image(seg.source, base_dir, f"messages[{index}].content<image field>"))
            else:
                out.text(seg)


# Opens the judged response in the transcript (benchmarks.policy_copy finds the response by it).
RESPONSE_HEADER = "## Response to judge\n[assistant]\n"


def build_transcript(sample: Sample, guard=_no_guard, *, with_response: bool = True) -> _Parts:
    """The judge's transcript; ``with_response=False`` stops after the conversation (the scalar
    RM's prompt: the candidate response then goes in its own assistant turn, rm_jax.rm.render)."""
    out = _Parts(guard)
    g = guard
    known_calls = {c.id: c for m in sample.messages for c in m.tool_calls if c.id}
    out.markup("## Conversation\n")
    for i, msg in enumerate(sample.messages):
        if msg.role == "tool":
            call = known_calls.get(msg.tool_call_id) if msg.tool_call_id else None
            if call is not None:
                out.markup(f"[tool result: {g(call.name)} (call {g(call.id)})]\n")
            else:   # orphan (the online shape): its own entry, never dropped
                out.markup(f"[tool: {g(msg.name or 'unknown')}]\n")
            _tool_result(out, msg, sample.base_dir, i)
        else:
            out.markup(f"[{msg.role}]\n")
            _message_parts(out, msg)
            for call in msg.tool_calls:
                out.markup(("\n" if msg.parts else "") + _call_text(call, sample.tools, g))
        out.markup("\n")
    if not with_response:
        return out
    out.markup(RESPONSE_HEADER)
    response_parts(out, sample)
    return out


def response_parts(out: _Parts, sample: Sample) -> None:
    """The judged response as the policy produced it: its text, then each tool call's markup."""
    resp = sample.response
    if resp.content:
        out.text(resp.content)
    for j, call in enumerate(resp.tool_calls):
        out.markup(("\n" if resp.content or j else "") + _call_text(call, sample.tools, out.guard))


def route_of(sample: Sample) -> str:
    """The contract route: the tool-call contract only when the judged response calls tools."""
    return ROUTE_TOOL_CALL if sample.response.calls_tools else ROUTE_TEXT_ONLY


def contract_for(sample: Sample, cfg: RenderConfig) -> str:
    return cfg.tool_contract if route_of(sample) == ROUTE_TOOL_CALL else cfg.text_contract


def judge_chat(sample: Sample, cfg: RenderConfig, guard=_no_guard) -> tuple[list[dict], list[ImageRef]]:
    """system = the routed contract, user = the transcript (``{"type": "image"}`` parts in place,
    the images in order). The judge (via its chat template) and the teacher labeller
    (rm_jax.label, via an OpenAI-compatible server) both read this."""
    transcript = build_transcript(sample, guard)
    chat = [{"role": "system", "content": system_with_tools(contract_for(sample, cfg), sample, cfg, guard)},
            {"role": "user", "content": transcript.parts}]
    return chat, transcript.images


# ---------------------------------------------------------------- renderer


class Renderer:
    def __init__(self, tokenizer, image_pre: images_lib.ImagePreprocessor, cfg: RenderConfig):
        self.tokenizer = tokenizer
        self.image_pre = image_pre
        self.cfg = cfg
        self.image_pad_id = tokenizer.convert_tokens_to_ids(cfg.image_pad_token)
        if self.image_pad_id is None or self.image_pad_id == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer has no {cfg.image_pad_token!r} token")
        self.verdict = target_lib.verdict_tokens(tokenizer)
        self.guard = SpecialTokenGuard(tokenizer)
        self.eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else \
            tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._response_marker = np.asarray(target_lib.encode_piece(tokenizer, RESPONSE_HEADER), np.int32)
        self._turn_end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    @classmethod
    def from_config(cls, data_cfg, tokenizer_dir: str, storage_dtype: str = "float32") -> "Renderer":
        import transformers
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
        pre = images_lib.ImagePreprocessor.from_pretrained(
            tokenizer_dir, images_lib.ImageBudget.from_config(data_cfg.image), storage_dtype)
        return cls(tok, pre, RenderConfig.from_config(data_cfg))

    def route(self, sample: Sample) -> str:
        return route_of(sample)

    def judge_chat(self, sample: Sample) -> tuple[list[dict], list[ImageRef]]:
        return judge_chat(sample, self.cfg, self.guard)

    def template_tools(self, sample: Sample) -> list[dict] | None:
        """The ``tools`` argument of apply_chat_template: the guarded schemas (they come from data
        files too), or None when the listing is ``signatures`` (then it is in the system text)."""
        if self.cfg.tools_listing != TOOLS_TEMPLATE or not sample.tools:
            return None
        return [self.guard.json(t) for t in sample.tools]

    def prompt_text(self, sample: Sample) -> tuple[str, list[ImageRef]]:
        chat, refs = self.judge_chat(sample)
        text = self.tokenizer.apply_chat_template(chat, tools=self.template_tools(sample),
                                                  add_generation_prompt=True, tokenize=False)
        return text, refs

    def target_text(self, sample: Sample, has_image: bool) -> str:
        return target_lib.serialize_label(sample.label, self.cfg.field_order, has_image=has_image)

    def _expand_images(self, ids: list[int], tokens_per_image: Sequence[int]) -> list[int]:
        n_pads = sum(1 for t in ids if t == self.image_pad_id)
        if n_pads != len(tokens_per_image):
            raise SampleError("template_mismatch", "messages",
                              f"chat template produced {n_pads} image placeholders for {len(tokens_per_image)} images")
        out: list[int] = []
        k = 0
        for t in ids:
            if t == self.image_pad_id:
                out.extend([t] * tokens_per_image[k])
                k += 1
            else:
                out.append(t)
        return out

    def render(self, sample: Sample, *, with_target: bool = True) -> JudgeInput:
        """Raises SampleError (missing/corrupt image, template mismatch) with a reason."""
        text, refs = self.prompt_text(sample)
        pil = [images_lib.load_image(r.source, r.field) for r in refs]
        processed = self.image_pre(pil)
        prompt_ids = self._expand_images(target_lib.encode_piece(self.tokenizer, text), processed.tokens_per_image)
        target_ids: list[int] = []
        verdict_pos = -1
        if with_target:
            if sample.label is None:
                raise SampleError("missing_field", "label", "rendering a target needs a label")
            pieces = target_lib.split_at_verdict(self.target_text(sample, has_image=bool(refs)), sample.label.l3)
            prefix_ids = target_lib.encode_piece(self.tokenizer, pieces.prefix)
            verdict_ids = list(self.verdict.pass_ids if pieces.verdict == "pass" else self.verdict.fail_ids)
            verdict_pos = len(prompt_ids) + len(prefix_ids)
            target_ids = prefix_ids + verdict_ids + target_lib.encode_piece(self.tokenizer, pieces.rest) + [self.eos_id]
        ids = np.asarray(prompt_ids + target_ids, np.int32)
        mask = np.zeros(len(ids), np.uint8)
        mask[len(prompt_ids):] = 1
        label = -1 if sample.label is None else int(sample.label.l3 == "fail")
        return JudgeInput(id=sample.id, prompt_id=sample.prompt_id, input_ids=ids, target_mask=mask,
                         verdict_pos=verdict_pos, pixel_values=processed.pixel_values,
                         image_grid_thw=processed.grid_thw, route=self.route(sample), label=label,
                         has_image=bool(refs), n_image_tokens=int(sum(processed.tokens_per_image)),
                         flags=sample.flags, response_span=self.response_span(prompt_ids))

    def response_span(self, prompt_ids: Sequence[int]) -> tuple[int, int]:
        """[start, end) of the judged response in the prompt: after the transcript's last response
        header, up to the user turn's end; (-1, -1) when the header does not tokenize apart."""
        ids, m = np.asarray(prompt_ids, np.int32), self._response_marker
        if len(m) == 0 or len(ids) < len(m):
            return (-1, -1)
        windows = np.lib.stride_tricks.sliding_window_view(ids, len(m))
        hits = np.flatnonzero((windows == m).all(-1))
        if not len(hits):
            return (-1, -1)
        start = int(hits[-1]) + len(m)
        ends = np.flatnonzero(ids[start:] == self._turn_end_id)
        return (start, start + int(ends[0])) if len(ends) else (-1, -1)

    def scoring_prefix_ids(self) -> list[int] | None:
        """Tokens appended after the prompt to reach the verdict slot (verdict-first only)."""
        prefix = target_lib.verdict_prefix(self.cfg.field_order)
        return None if prefix is None else target_lib.encode_piece(self.tokenizer, prefix)


def resolve_tokenizer_dir(flag_value: str, input_path: str) -> str:
    """--tokenizer, else <input folder>/tokenizer (what launch.synth writes)."""
    path = flag_value or os.path.join(os.path.dirname(os.path.abspath(input_path)), "tokenizer")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory not found: {path} (pass --tokenizer=DIR)")
    return path
