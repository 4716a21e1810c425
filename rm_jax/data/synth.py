"""The embedded default data set: synthetic judge samples for an image-creation agent.

What it imitates (the field report, sections 2-5): an agent with 13 image tools answers requests
such as "3 images of a red star, 2K, 16:9" with reference images, and sometimes answers in text
(delivery notes, clarifying questions, refusals with an alternative). The policy is sampled
several times per prompt (temperature 0.8 in the report), a teacher labels each response, and the
reward's GRPO diagnostics group responses by ``prompt_id``. History has the *online shape*: past
assistant turns carry no ``tool_calls``; tool results are ``role=tool`` messages whose content is
a JSON string, with a ``tool_call_id`` that matches nothing or none at all.

Design choices
--------------
* **Scenarios, then responses.** A prompt (conversation, tools, reference/generated images) is
  built once per group; each of its responses is then drawn as correct or, with probability
  ``fail_rate``, corrupted in exactly one slot. Groups therefore mix pass and fail sometimes, as
  real temperature samples do. One scenario (refusals over the per-request count limit) decides
  its label from the request itself, so its whole group shares it.
* **No shortcut to the label.** A judge that can tell pass from fail by looking at the response
  alone learns nothing useful for RL, so:
    - the verdict is drawn *independently* of the scenario, the phrasing variant, the argument
      encoding (object / JSON string / double-encoded string) and the tool-result shape, so
      P(fail | any of those) = fail_rate;
    - a failure replaces one value by another value *from the same pool*. Correct values are
      uniform over their pool and wrong values uniform over the pool minus the truth, so the
      marginal of every slot (and hence length, digits, words, punctuation) is the same in both
      classes; no word or format appears in only one class;
    - responses stay internally consistent (a wrong resolution in a delivery note comes with
      the matching wrong pixel size; image tool results state their ``count``), so the error is
      visible only by comparing the response
      with the request, the tool results or the images: request says 2K, the call says 1K; the
      note claims 2 images, the tool result lists 1; the reference is a red circle, the prompt
      says blue circle; the generated image came out purple, "more like this one" asks for red.
  Two structural failures (a requested parameter left out, an unrequested extra call) change
  the call's shape; their passing twins (a parameter the user never asked for is omitted; two
  requested edits give two calls) keep the shape statistics close. tests/test_synth.py checks
  that a logistic regression on surface features stays near AUC 0.5.
* **Learnable by a tiny judge.** The contradicting value is one token (``2K``, ``16:9``, ``3``,
  ``red``, ``star``, a file stem such as ``leaf``) that also appears in the request or the tool
  result. Conversations are short (the judge input's median is ~160 tokens with images): no policy
  system prompt, terse requests, tool results that state only status, count and images, and no
  value a later call could take by mistake (a follow-up's first request states no resolution or
  aspect ratio unless a call reuses it). Image folders are letters (``images/bm/leaf.png``), so no
  digit in a path reads as a count, and each edit request names its tool's word ("upscale it to
  4K" -> ``upscale_image``), so a wrong tool differs from the request as a value does.
* **Images are real.** Reference images and every image a tool result names are PNGs drawn with
  PIL (known colour and shape on a plain background; non-square reference sizes 48-96 px;
  generated images at the requested aspect ratio, scaled down). What a tool "produced" can
  differ from what was asked, which is the evidence for image mismatch.
* **img.** An image-consistency score 0-10 whenever the conversation holds an image (high when
  the response agrees with the images, low when its colour/shape/image reference contradicts
  them, mid-high when it does not depend on them), null when there is no image.
* **Deterministic.** Each prompt has its own ``np.random.default_rng((seed, k))``; JSON is written
  with a fixed key order; PNG encoding carries no timestamps. Same seed, same bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Callable

import numpy as np
from PIL import Image, ImageDraw

from configs import judge_contracts
from rm_jax.data.render import tool_signature

# ---------------------------------------------------------------- value pools

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "blue": (40, 80, 220), "green": (40, 170, 60),
    "yellow": (235, 200, 40), "purple": (140, 60, 190), "orange": (245, 140, 30)}
SHAPES = ("circle", "square", "triangle", "star", "diamond")
RESOLUTIONS = ("1K", "2K", "4K")
ASPECTS = ("1:1", "16:9", "9:16", "4:3", "3:4")
COUNTS = (1, 2, 3, 4)
MAX_COUNT = 4              # generate_image's schema maximum: the refusal scenario's limit
BACKGROUNDS = ((255, 255, 255), (236, 236, 236), (250, 245, 230))
STYLES = ("watercolor", "pixel", "sketch", "oil")

# Generated files are images/<folder>/<stem>.png (_folder): the stem is one token, so a note citing a file no
# tool result returned differs from the right note in one token, like every other value.
FILE_STEMS = ("sun", "moon", "leaf", "wave", "rock", "bird", "lake", "hill")

TOOL_ISSUES = judge_contracts.TOOL_CALL_ISSUES
TEXT_ISSUES = judge_contracts.TEXT_ONLY_ISSUES


def _enum(values) -> dict:
    return {"type": "string", "enum": list(values)}


_IMG = {"type": "string"}


def _fn(name: str, desc: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": required}}}


# The catalogue: 13 tools, as OpenAI function schemas. Property descriptions are left out and
# each sample lists only 1-2 tools (a spare only where choosing the tool is judged), because the
# judge input lists them and the tiny judge has a
# ~400-token text budget; the enums, types, ranges and "required" lists (what a judge checks)
# stay.
TOOLS: dict[str, dict] = {t["function"]["name"]: t for t in (
    _fn("generate_image", "Create new images from a text prompt.", {
        "prompt": {"type": "string"}, "aspect_ratio": _enum(ASPECTS), "resolution": _enum(RESOLUTIONS),
        "count": {"type": "integer", "minimum": 1, "maximum": MAX_COUNT}, "reference_image": _IMG},
        ["prompt", "aspect_ratio"]),
    _fn("edit_image", "Edit an image by instruction.", {
        "image": _IMG, "instruction": {"type": "string"}}, ["image", "instruction"]),
    _fn("upscale_image", "Upscale an image.", {
        "image": _IMG, "resolution": _enum(RESOLUTIONS)}, ["image", "resolution"]),
    _fn("change_aspect_ratio", "Extend or crop to a new aspect ratio.", {
        "image": _IMG, "aspect_ratio": _enum(ASPECTS)}, ["image", "aspect_ratio"]),
    _fn("remove_background", "Make the background transparent.", {"image": _IMG}, ["image"]),
    _fn("recolor_image", "Change the main object's colour.", {
        "image": _IMG, "colour": _enum(COLOURS)}, ["image", "colour"]),
    _fn("change_shape", "Redraw the main object as another shape.", {
        "image": _IMG, "shape": _enum(SHAPES)}, ["image", "shape"]),
    _fn("style_transfer", "Restyle an image.", {
        "image": _IMG, "style": _enum(STYLES)}, ["image", "style"]),
    _fn("add_text", "Write text onto an image.", {
        "image": _IMG, "text": {"type": "string"}}, ["image", "text"]),
    _fn("crop_image", "Crop an image.", {
        "image": _IMG, "region": _enum(("center", "top", "bottom", "left", "right"))}, ["image", "region"]),
    _fn("blend_images", "Blend two images.", {
        "images": {"type": "array", "items": {"type": "string"}},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1}}, ["images"]),
    _fn("outpaint_image", "Extend an image beyond its border.", {
        "image": _IMG, "direction": _enum(("left", "right", "up", "down"))}, ["image", "direction"]),
    _fn("describe_image", "Describe an image in words.", {"image": _IMG}, ["image"]),
)}
assert len(TOOLS) == 13

# Follow-up edits: op -> (tool, argument key, value pool or None, request phrasings).
# Each phrasing names its tool's word (upscale, aspect ratio, recolor, shape, background), so a
# call to another tool is a comparison of the call's name with the request, as a value is.
OPS: dict[str, tuple[str, str | None, tuple | None, tuple[str, ...]]] = {
    "upscale": ("upscale_image", "resolution", RESOLUTIONS,
                ("upscale it to {v}", "please upscale to {v}")),
    "aspect": ("change_aspect_ratio", "aspect_ratio", ASPECTS,
               ("change the aspect ratio to {v}", "aspect ratio {v} please")),
    "recolor": ("recolor_image", "colour", tuple(COLOURS),
                ("recolor it {v}", "recolor the image to {v}")),
    "reshape": ("change_shape", "shape", SHAPES,
                ("change the shape to a {v}", "shape it as a {v}")),
    "nobg": ("remove_background", None, None,
             ("remove the background", "cut out the background")),
}

KINDS = ("generate", "followup", "delivery", "clarify", "refuse", "correction")
# generate+followup call tools (~55%); the rest answer in text (~45%).
KIND_WEIGHTS = (0.30, 0.25, 0.18, 0.10, 0.07, 0.10)

SLOT_WORDS = {"resolution": "resolution", "aspect": "aspect ratio", "count": "number of images",
              "colour": "colour", "shape": "shape"}


# ---------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class SynthConfig:
    n: int
    seed: int = 0
    fail_rate: float = 0.08
    responses_per_prompt: int = 3
    rule_violation_rate: float = 0.0   # share of all responses given a rule violation (RULE_VIOLATIONS)


@dataclasses.dataclass(frozen=True)
class Spec:
    """The checkable constraints of a request."""
    colour: str
    shape: str
    resolution: str
    aspect: str
    count: int


@dataclasses.dataclass(frozen=True)
class Drawn:
    """An image that exists as a PNG under DIR/images (path relative to the JSONL folder)."""
    path: str
    colour: str
    shape: str


@dataclasses.dataclass(frozen=True)
class Verdict:
    fail: bool
    issue: str | None
    reason: str
    consistency: str          # "ok" | "bad" | "neutral": drives the img score


@dataclasses.dataclass(frozen=True)
class Judged:
    response: dict
    verdict: Verdict
    reference_reply: str | None = None


@dataclasses.dataclass
class Prompt:
    """One conversation shared by a group of responses."""
    prompt_id: str
    messages: list[dict]
    tools: list[dict]
    images: list[Drawn]
    respond: Callable[[np.random.Generator, bool, int, int], Judged]
    fixed_fail: bool | None = None     # set when the request alone decides the verdict
    reference_reply: str | None = None


# ---------------------------------------------------------------- helpers


def _pick(rng: np.random.Generator, seq):
    return seq[int(rng.integers(len(seq)))]


def _other(rng: np.random.Generator, seq, value):
    """A different value from the same pool: keeps the marginal of wrong values uniform."""
    rest = [v for v in seq if v != value]
    return rest[int(rng.integers(len(rest)))]


def _stems(rng: np.random.Generator, n: int) -> list[str]:
    """n distinct file stems for one conversation's generated images."""
    return [FILE_STEMS[i] for i in rng.permutation(len(FILE_STEMS))[:n]]


def _folder(k: int) -> str:
    """A prompt's image folder, its number in letters (prompt 38 -> ``bm``): no digit in a path can be
    read as a count."""
    letters = ""
    while True:
        k, r = divmod(k, 26)
        letters = chr(ord("a") + r) + letters
        if not k:
            return letters


def _plural(n: int) -> str:
    return f"{n} image" if n == 1 else f"{n} images"


def _encode_args(rng: np.random.Generator, args: dict) -> Any:
    """Online argument shapes: plain object, JSON string, or double-encoded JSON string."""
    r = rng.random()
    if r < 0.4:
        return args
    if r < 0.8:
        return json.dumps(args, ensure_ascii=False)
    return json.dumps(json.dumps(args, ensure_ascii=False))


def _call(rng: np.random.Generator, call_id: str, name: str, args: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": _encode_args(rng, args)}}


def _tool_message(rng: np.random.Generator, name: str, payload: dict) -> dict:
    """A history tool result in the online shape: JSON-string content, orphan or missing id."""
    msg: dict[str, Any] = {"role": "tool"}
    if rng.random() < 0.6:
        msg["tool_call_id"] = "call_" + "".join(_pick(rng, "0123456789abcdef") for _ in range(8))
    if rng.random() < 0.5:
        msg["name"] = name
    msg["content"] = json.dumps(payload, separators=(",", ":"))
    return msg


def _tool_subset(rng: np.random.Generator, needed: list[str], n_total: int) -> list[dict]:
    names = list(dict.fromkeys(needed))
    pool = [t for t in TOOLS if t not in names]
    while len(names) < n_total:
        t = _pick(rng, pool)
        pool.remove(t)
        names.append(t)
    order = rng.permutation(len(names))
    return [listed_schema(TOOLS[names[i]]) for i in order]


def listed_schema(tool: dict) -> dict:
    """A catalogue schema as a sample lists it: the enums left out. An enum lists every value of
    its pool, so a wrong value always "appears in the context" too; without them the only earlier
    occurrences of a call's value are the request, the tool results and the history, which is
    what the judge must compare against (and ~30 tokens fewer per schema)."""
    fn = tool["function"]
    props = {k: {a: b for a, b in v.items() if a != "enum"} for k, v in fn["parameters"]["properties"].items()}
    return {"type": "function", "function": {**fn, "parameters": {**fn["parameters"], "properties": props}}}


class ImageWriter:
    """Draws the synthetic PNGs. Paths in samples are relative to the JSONL folder."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)

    def draw(self, name: str, colour: str, shape: str, width: int, height: int,
             background: tuple[int, int, int]) -> Drawn:
        img = Image.new("RGB", (width, height), background)
        d = ImageDraw.Draw(img)
        cx, cy = width / 2, height / 2
        r = 0.38 * min(width, height)
        fill = COLOURS[colour]
        if shape == "circle":
            d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        elif shape == "square":
            d.rectangle([cx - r * 0.85, cy - r * 0.85, cx + r * 0.85, cy + r * 0.85], fill=fill)
        elif shape == "triangle":
            d.polygon([(cx, cy - r), (cx + r * 0.95, cy + r * 0.75), (cx - r * 0.95, cy + r * 0.75)], fill=fill)
        elif shape == "diamond":
            d.polygon([(cx, cy - r), (cx + r * 0.75, cy), (cx, cy + r), (cx - r * 0.75, cy)], fill=fill)
        elif shape == "star":
            pts = []
            for i in range(10):
                rr = r if i % 2 == 0 else r * 0.42
                a = -math.pi / 2 + i * math.pi / 5
                pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
            d.polygon(pts, fill=fill)
        else:
            raise ValueError(f"unknown shape {shape!r}")
        rel = f"images/{name}.png"
        os.makedirs(os.path.dirname(os.path.join(self.out_dir, rel)), exist_ok=True)
        img.save(os.path.join(self.out_dir, rel), format="PNG")
        return Drawn(rel, colour, shape)

    def reference(self, rng: np.random.Generator, name: str, colour: str, shape: str) -> Drawn:
        # Non-square, varying sizes: the processor's resize path must see odd shapes.
        w = int(rng.integers(40, 65))
        h = int(rng.integers(40, 65))
        if h == w:
            h = w - 8 if w > 48 else w + 8
        return self.draw(name, colour, shape, w, h, _pick(rng, BACKGROUNDS))

    def generated(self, rng: np.random.Generator, name: str, colour: str, shape: str, aspect: str) -> Drawn:
        # The requested aspect ratio, scaled down to a long edge of 48-64 px (4-16 image tokens).
        a, b = (int(x) for x in aspect.split(":"))
        edge = int(rng.integers(48, 65))
        w, h = (edge, max(16, edge * b // a)) if a >= b else (max(16, edge * a // b), edge)
        return self.draw(name, colour, shape, w, h, _pick(rng, BACKGROUNDS))


def _spec(rng: np.random.Generator, counts=COUNTS) -> Spec:
    return Spec(_pick(rng, tuple(COLOURS)), _pick(rng, SHAPES), _pick(rng, RESOLUTIONS),
                _pick(rng, ASPECTS), int(_pick(rng, counts)))


def _choose_issue(rng: np.random.Generator, options: dict[str, float]) -> str:
    names = [k for k, w in options.items() if w > 0]
    w = np.array([options[k] for k in names], dtype=float)
    return names[int(rng.choice(len(names), p=w / w.sum()))]


def _subject(colour: str, shape: str, rng: np.random.Generator) -> str:
    return _pick(rng, ("a {c} {s}", "{c} {s}", "{c} {s} icon")).format(c=colour, s=shape)


# ---------------------------------------------------------------- scenarios: tool calls


def _build_generate(rng: np.random.Generator, k: int, images: ImageWriter) -> Prompt:
    """A fresh request; the judged turn calls generate_image."""
    spec = _spec(rng)
    has_ref = rng.random() < 0.4
    says_res = rng.random() < 0.6       # unmentioned resolution: passing calls omit it
    res_part = f", {spec.resolution}" if says_res else ""
    drawn: list[Drawn] = []
    if has_ref:
        ref = images.reference(rng, f"{_folder(k)}/ref", spec.colour, spec.shape)
        drawn.append(ref)
        text = _pick(rng, ("Make {n} like this{r}, {a}.", "{n} like this one{r}, {a}.")
                     ).format(n=_plural(spec.count), r=res_part, a=spec.aspect)
        user = {"role": "user", "content": [{"type": "image", "image": ref.path}, {"type": "text", "text": text}]}
    else:
        text = _pick(rng, ("Make {n} of a {c} {s}{r}, {a}.", "I need {n}: a {c} {s}{r}, {a}.")
                     ).format(n=_plural(spec.count), c=spec.colour, s=spec.shape, r=res_part, a=spec.aspect)
        user = {"role": "user", "content": text}
    messages = [user]
    tools = _tool_subset(rng, ["generate_image"], n_total=1)

    def respond(r: np.random.Generator, fail: bool, j: int, _n: int) -> Judged:
        vals = {"colour": spec.colour, "shape": spec.shape, "resolution": spec.resolution,
                "aspect": spec.aspect, "count": spec.count}
        issue, reason, consistency = None, "", "ok" if has_ref else "neutral"
        include_res = says_res
        if fail:
            issue = _choose_issue(r, {"wrong_param": 0.6, "missing_param": 0.2 if says_res else 0.0,
                                      "image_mismatch": 0.3 if has_ref else 0.0})
            if issue == "wrong_param":
                slots = ["aspect", "count"] + (["resolution"] if says_res else []) + \
                        ([] if has_ref else ["colour", "shape"])
                slot = _pick(r, slots)
                pool = {"aspect": ASPECTS, "count": COUNTS, "resolution": RESOLUTIONS,
                        "colour": tuple(COLOURS), "shape": SHAPES}[slot]
                vals[slot] = _other(r, pool, vals[slot])
                reason = f"{SLOT_WORDS[slot]} is {vals[slot]} but the request says {getattr(spec, slot)}"
            elif issue == "missing_param":
                include_res = False
                reason = f"resolution left out although the user asked for {spec.resolution}"
            else:
                slot = _pick(r, ("colour", "shape"))
                vals[slot] = _other(r, tuple(COLOURS) if slot == "colour" else SHAPES, vals[slot])
                reason = f"prompt says {vals[slot]} but the reference shows a {spec.colour} {spec.shape}"
                consistency = "bad"
        else:
            reason = _pick(r, ("call matches the request", "parameters complete and match the request"))
            reason += f": {_plural(spec.count)}, {spec.aspect}" + (f", {spec.resolution}" if says_res else "")
        args: dict[str, Any] = {"prompt": _subject(vals["colour"], vals["shape"], r), "aspect_ratio": vals["aspect"]}
        if include_res:
            args["resolution"] = vals["resolution"]
        args["count"] = vals["count"]
        if has_ref:
            args["reference_image"] = ref.path
        call = _call(r, f"call_{k}_{j}_0", "generate_image", args)
        return Judged({"content": None, "tool_calls": [call]}, Verdict(fail, issue, reason, consistency))

    return Prompt(f"p{k}", messages, tools, drawn, respond)


def _build_followup(rng: np.random.Generator, k: int, images: ImageWriter) -> Prompt:
    """Edits on an image an earlier (orphan) tool result produced; one or two requested ops."""
    spec = _spec(rng, counts=(1,))
    # What the tool actually drew may differ from what was asked ("more like this one" must
    # follow the image, not the text).
    produced_colour = spec.colour if rng.random() < 0.75 else _other(rng, tuple(COLOURS), spec.colour)
    produced_shape = spec.shape if rng.random() < 0.85 else _other(rng, SHAPES, spec.shape)
    stem, wrong_stem = _stems(rng, 2)
    gen = images.generated(rng, f"{_folder(k)}/{stem}", produced_colour, produced_shape, spec.aspect)
    variations = rng.random() < 0.25
    # The first request states only what a later call reuses (the aspect ratio of "same aspect
    # ratio"): its other values would be distractors for the edit's values.
    first = f"Make a {spec.colour} {spec.shape}" + (f", {spec.aspect}." if variations else ".")
    messages = [{"role": "user", "content": first},
                _tool_message(rng, "generate_image", {"status": "ok", "count": 1, "images": [{"image": gen.path}]})]
    n_ops = 1 if variations or rng.random() < 0.7 else 2
    op_names = list(OPS)
    chosen = [op_names[i] for i in rng.permutation(len(op_names))[:n_ops]] if not variations else []
    op_vals = {op: (_pick(rng, OPS[op][2]) if OPS[op][2] else None) for op in chosen}
    var_spec = Spec(produced_colour, produced_shape, _pick(rng, RESOLUTIONS), spec.aspect, int(_pick(rng, COUNTS)))
    if variations:
        req = f"Make {_plural(var_spec.count)} more like this one, {var_spec.resolution}, same aspect ratio."
    else:
        parts = [_pick(rng, OPS[op][3]).format(v=op_vals[op]) for op in chosen]
        req = (" and then ".join(parts) + ".")
        req = req[0].upper() + req[1:]
    messages.append({"role": "user", "content": req})
    spare_ops = [op for op in op_names if op not in chosen]
    # One unrequested edit tool is listed: what a wrong or extra call picks.
    listed_spares = [_pick(rng, spare_ops)]
    needed = (["generate_image"] if variations else []) + [OPS[op][0] for op in chosen + listed_spares]
    tools = _tool_subset(rng, needed, n_total=max(2, len(needed)))

    def op_args(op: str, value, image: str) -> dict:
        key = OPS[op][1]
        return {"image": image} if key is None else {"image": image, key: value}

    def respond(r: np.random.Generator, fail: bool, j: int, n_prompts: int) -> Judged:
        issue, consistency = None, "ok"
        if variations:
            vals = {"colour": var_spec.colour, "shape": var_spec.shape, "resolution": var_spec.resolution,
                    "count": var_spec.count}
            reason = f"follows the image: {var_spec.colour} {var_spec.shape}, {var_spec.resolution}"
            if fail:
                issue = _choose_issue(r, {"wrong_param": 0.5, "image_mismatch": 0.5})
                if issue == "wrong_param":
                    slot = _pick(r, ("resolution", "count"))
                    vals[slot] = _other(r, RESOLUTIONS if slot == "resolution" else COUNTS, vals[slot])
                    reason = f"{SLOT_WORDS[slot]} is {vals[slot]} but the user asked for {getattr(var_spec, slot)}"
                else:
                    slot = _pick(r, ("colour", "shape"))
                    truth = getattr(var_spec, slot)
                    asked = getattr(spec, slot)
                    # The realistic slip: copy the earlier text request instead of looking.
                    vals[slot] = asked if asked != truth else _other(r, tuple(COLOURS) if slot == "colour" else SHAPES, truth)
                    reason = f"prompt says {vals[slot]} but the image shows a {produced_colour} {produced_shape}"
                    consistency = "bad"
            args = {"prompt": _subject(vals["colour"], vals["shape"], r), "aspect_ratio": spec.aspect,
                    "resolution": vals["resolution"], "count": vals["count"], "reference_image": gen.path}
            calls = [("generate_image", args)]
        else:
            plan = [(op, op_vals[op]) for op in chosen]
            image = gen.path
            reason = "calls match the requested edits" if n_ops == 2 else "call matches the requested edit"
            if fail:
                valued = [i for i, (op, _) in enumerate(plan) if OPS[op][2]]
                issue = _choose_issue(r, {"wrong_param": 0.45, "wrong_tool": 0.3 if listed_spares else 0.0,
                                          "extra_call": 0.25 if n_ops == 1 and listed_spares else 0.0})
                if issue == "wrong_param":
                    if valued:
                        i = valued[int(r.integers(len(valued)))]
                        op, v = plan[i]
                        plan[i] = (op, _other(r, OPS[op][2], v))
                        reason = f"{OPS[op][1].replace('_', ' ')} is {plan[i][1]} but the user asked for {v}"
                    else:
                        image = f"images/{_folder(k)}/{wrong_stem}.png"
                        reason = f"edits {image}, which is not the image in this conversation"
                        consistency = "bad"
                elif issue == "wrong_tool":
                    i = int(r.integers(len(plan)))
                    wrong = _pick(r, listed_spares)
                    asked = plan[i][0]
                    plan[i] = (wrong, _pick(r, OPS[wrong][2]) if OPS[wrong][2] else None)
                    reason = f"calls {OPS[wrong][0]} but the user asked to {_asked_phrase(asked)}"
                else:
                    extra = _pick(r, listed_spares)
                    plan.append((extra, _pick(r, OPS[extra][2]) if OPS[extra][2] else None))
                    reason = f"extra {OPS[extra][0]} call the user did not ask for"
            calls = [(OPS[op][0], op_args(op, v, image)) for op, v in plan]
        tool_calls = [_call(r, f"call_{k}_{j}_{i}", name, a) for i, (name, a) in enumerate(calls)]
        return Judged({"content": None, "tool_calls": tool_calls}, Verdict(fail, issue, reason, consistency))

    return Prompt(f"p{k}", messages, tools, [gen], respond)


def _asked_phrase(op: str) -> str:
    return {"upscale": "upscale", "aspect": "change the aspect ratio", "recolor": "recolour",
            "reshape": "change the shape", "nobg": "remove the background"}[op]


# ---------------------------------------------------------------- scenarios: text replies


def _delivery_text(rng: np.random.Generator, n: int, colour: str, shape: str, res: str, fname: str) -> str:
    return _pick(rng, (
        "Done: {n} of a {c} {s} at {r}. File: {f}.",
        "Here you go: {n}, a {c} {s}, {r}. See {f}.",
    )).format(n=_plural(n), c=colour, s=shape, r=res, f=fname)


def _build_delivery(rng: np.random.Generator, k: int, images: ImageWriter) -> Prompt:
    """A delivery note after an orphan tool result; claims must match the result and images."""
    spec = _spec(rng, counts=(1, 2))
    # The tool sometimes returns fewer/more images than asked; k_real stays uniform on {1, 2}
    # so a claimed count is no cue by itself.
    k_real = spec.count if rng.random() < 0.9 else 3 - spec.count
    stems = _stems(rng, 3)
    gens = [images.generated(rng, f"{_folder(k)}/{stems[i]}", spec.colour, spec.shape, spec.aspect) for i in range(k_real)]
    messages = [{"role": "user", "content": f"Make {_plural(spec.count)} of a {spec.colour} {spec.shape}, "
                                            f"{spec.resolution}, {spec.aspect}."},
                _tool_message(rng, "generate_image", {"status": "ok", "count": k_real, "images": [
                    {"image": g.path} for g in gens]})]
    tools = _tool_subset(rng, ["generate_image"], n_total=1)
    own_file = f"{stems[0]}.png"

    def respond(r: np.random.Generator, fail: bool, j: int, n_prompts: int) -> Judged:
        claim = {"count": k_real, "colour": spec.colour, "shape": spec.shape, "resolution": spec.resolution,
                 "file": own_file}
        issue, consistency = None, "ok"
        reason = f"note matches the tool result: {_plural(k_real)}, {spec.resolution}"
        if fail:
            issue = _choose_issue(r, {"false_completion_claim": 0.3, "contradicts_request_or_tool_result": 0.45,
                                      "text_hallucination": 0.25})
            if issue == "false_completion_claim":
                claim["count"] = 3 - k_real
                reason = f"claims {_plural(claim['count'])} but the tool result shows {k_real}"
            elif issue == "contradicts_request_or_tool_result":
                slot = _pick(r, ("resolution", "colour", "shape"))
                pool = {"resolution": RESOLUTIONS, "colour": tuple(COLOURS), "shape": SHAPES}[slot]
                claim[slot] = _other(r, pool, claim[slot])
                reason = f"note says {claim[slot]} but the request and result say {getattr(spec, slot)}"
                if slot in ("colour", "shape"):
                    consistency = "bad"
            else:
                claim["file"] = f"{stems[2]}.png"   # never among the k_real <= 2 returned
                reason = f"cites {claim['file']}, which no tool result returned"
        text = _delivery_text(r, claim["count"], claim["colour"], claim["shape"], claim["resolution"], claim["file"])
        return Judged({"content": text, "tool_calls": []}, Verdict(fail, issue, reason, consistency))

    ref_reply = _delivery_text(rng, k_real, spec.colour, spec.shape, spec.resolution, own_file)
    return Prompt(f"p{k}", messages, tools, gens, respond, reference_reply=ref_reply)


def _clarify_text(rng: np.random.Generator, slot: str) -> str:
    return _pick(rng, (
        "Which {w} do you want?",
        "What {w} should I use?",
    )).format(w=SLOT_WORDS[slot])


def _build_clarify(rng: np.random.Generator, k: int, images: ImageWriter) -> Prompt:
    """A request missing one setting; the right reply asks for exactly that one."""
    spec = _spec(rng)
    missing = _pick(rng, ("resolution", "aspect", "count"))
    has_ref = rng.random() < 0.3
    n_part = "some images" if missing == "count" else _plural(spec.count)
    bits = [b for s, b in (("resolution", spec.resolution), ("aspect", f"aspect ratio {spec.aspect}")) if s != missing]
    drawn: list[Drawn] = []
    if has_ref:
        ref = images.reference(rng, f"{_folder(k)}/ref", spec.colour, spec.shape)
        drawn.append(ref)
        text = f"Make {n_part} like this, " + ", ".join(bits) + "."
        user = {"role": "user", "content": [{"type": "image", "image": ref.path}, {"type": "text", "text": text}]}
    else:
        user = {"role": "user", "content": f"Make {n_part} of a {spec.colour} {spec.shape}, " + ", ".join(bits) + "."}
    messages = [user]
    tools = _tool_subset(rng, ["generate_image"], n_total=1)

    def respond(r: np.random.Generator, fail: bool, j: int, _n: int) -> Judged:
        slot, issue = missing, None
        reason = f"the request gives no {SLOT_WORDS[missing]}; asking is right"
        if fail:
            slot = _other(r, ("resolution", "aspect", "count"), missing)
            issue = "contradicts_request_or_tool_result"
            value = {"resolution": spec.resolution, "aspect": spec.aspect, "count": spec.count}[slot]
            reason = f"asks for the {SLOT_WORDS[slot]}, which the user already gave ({value})"
        return Judged({"content": _clarify_text(r, slot), "tool_calls": []}, Verdict(fail, issue, reason, "neutral"))

    return Prompt(f"p{k}", messages, tools, drawn, respond, reference_reply=_clarify_text(rng, missing))


def _refuse_text(rng: np.random.Generator) -> str:
    return _pick(rng, (
        f"Sorry, one request makes at most {MAX_COUNT} images. I can make {MAX_COUNT} now and the rest next; OK?",
        f"That is over the limit of {MAX_COUNT} images. Shall I start with {MAX_COUNT} now?",
    ))


def _build_refuse(rng: np.random.Generator, k: int, images: ImageWriter, fail_rate: float) -> Prompt:
    """A refusal with an alternative. Only the request decides the verdict (count over the
    schema's maximum or not), so the response text is the same in both classes."""
    fail = bool(rng.random() < fail_rate)
    spec = _spec(rng)
    n = int(rng.integers(1, MAX_COUNT + 1)) if fail else int(rng.integers(MAX_COUNT + 1, 2 * MAX_COUNT + 1))
    has_ref = rng.random() < 0.3
    drawn: list[Drawn] = []
    tail = f"{spec.resolution}, {spec.aspect}."
    if has_ref:
        ref = images.reference(rng, f"{_folder(k)}/ref", spec.colour, spec.shape)
        drawn.append(ref)
        user = {"role": "user", "content": [{"type": "image", "image": ref.path},
                                            {"type": "text", "text": f"Make {_plural(n)} like this, {tail}"}]}
    else:
        user = {"role": "user", "content": f"Make {_plural(n)} of a {spec.colour} {spec.shape}, {tail}"}
    messages = [user]
    tools = _tool_subset(rng, ["generate_image"], n_total=1)

    def respond(r: np.random.Generator, _fail: bool, j: int, _n: int) -> Judged:
        if fail:
            v = Verdict(True, "should_have_called_tool",
                        f"{_plural(n)} is within the limit of {MAX_COUNT}; it should have called generate_image", "neutral")
        else:
            v = Verdict(False, None, f"{n} is over the limit of {MAX_COUNT}; refusing with an alternative is right", "neutral")
        return Judged({"content": _refuse_text(r), "tool_calls": []}, v)

    ref_reply = (f"Sure, generating {_plural(n)} of a {spec.colour} {spec.shape} now." if fail
                 else _refuse_text(rng))
    return Prompt(f"p{k}", messages, tools, drawn, respond, fixed_fail=fail, reference_reply=ref_reply)


def _correction_text(rng: np.random.Generator, slot: str, new, old) -> str:
    return _pick(rng, (
        "Sorry, I'll use {new} instead of {old} for the {w}. Redo it?",
        "Got it: {w} {new}, not {old}. Redo it now?",
    )).format(w=SLOT_WORDS[slot], new=new, old=old)


def _build_correction(rng: np.random.Generator, k: int, images: ImageWriter) -> Prompt:
    """The user corrects one setting the assistant got wrong; the reply must take the correction."""
    spec = _spec(rng, counts=(1,))
    slot = _pick(rng, ("colour", "shape", "resolution", "aspect"))
    pool = {"colour": tuple(COLOURS), "shape": SHAPES, "resolution": RESOLUTIONS, "aspect": ASPECTS}[slot]
    new = getattr(spec, slot)
    old = _other(rng, pool, new)
    done = dataclasses.replace(spec, **{slot: old})
    messages = [{"role": "user", "content": f"Make a {spec.colour} {spec.shape}, {spec.resolution}, {spec.aspect}."}]
    drawn: list[Drawn] = []
    if rng.random() < 0.5:
        g = images.generated(rng, f"{_folder(k)}/{_stems(rng, 1)[0]}", done.colour, done.shape, done.aspect)
        drawn.append(g)
        messages.append(_tool_message(rng, "generate_image", {"status": "ok", "count": 1, "images": [
            {"image": g.path}]}))
    else:
        messages.append(_tool_message(rng, "generate_image", {"status": "ok", "count": 1}))
    messages.append({"role": "assistant",
                     "content": f"Here is a {done.colour} {done.shape} at {done.resolution}, {done.aspect}."})
    messages.append({"role": "user", "content": _pick(rng, (
        "No, I asked for {new}, not {old}.", "That's {old}; I wanted {new}.")).format(new=new, old=old)})
    tools = _tool_subset(rng, ["generate_image"], n_total=1)

    def respond(r: np.random.Generator, fail: bool, j: int, _n: int) -> Judged:
        if fail:
            # Swapped values: the same tokens as the right reply, in the order the user rejected.
            text = _correction_text(r, slot, old, new)
            v = Verdict(True, "ignores_user_correction", f"keeps {old} although the user corrected it to {new}",
                        "bad" if drawn and slot in ("colour", "shape") else "neutral")
        else:
            text = _correction_text(r, slot, new, old)
            v = Verdict(False, None, f"takes the correction: {new} instead of {old}", "neutral")
        return Judged({"content": text, "tool_calls": []}, v)

    return Prompt(f"p{k}", messages, tools, drawn, respond, reference_reply=_correction_text(rng, slot, new, old))


# ---------------------------------------------------------------- assembly


def _img_score(rng: np.random.Generator, has_image: bool, consistency: str) -> int | None:
    if not has_image:
        return None
    lo, hi = {"ok": (8, 10), "neutral": (6, 9), "bad": (0, 3)}[consistency]
    return int(rng.integers(lo, hi + 1))


def _label(rng: np.random.Generator, v: Verdict, has_image: bool) -> dict:
    return {"l3": "fail" if v.fail else "pass", "reason": v.reason,
            "issues": [v.issue] if v.fail and v.issue else [], "img": _img_score(rng, has_image, v.consistency)}


def build_prompt(cfg: SynthConfig, k: int, n_prompts: int, images: ImageWriter) -> Prompt:
    rng = np.random.default_rng((cfg.seed, k))
    kind = KINDS[int(rng.choice(len(KINDS), p=np.array(KIND_WEIGHTS) / sum(KIND_WEIGHTS)))]
    if kind == "generate":
        return _build_generate(rng, k, images)
    if kind == "followup":
        return _build_followup(rng, k, images)
    if kind == "delivery":
        return _build_delivery(rng, k, images)
    if kind == "clarify":
        return _build_clarify(rng, k, images)
    if kind == "refuse":
        return _build_refuse(rng, k, images, cfg.fail_rate)
    return _build_correction(rng, k, images)


def generate(cfg: SynthConfig, out_dir: str) -> list[dict]:
    """Draws images under out_dir/images and returns the samples (not yet written)."""
    images = ImageWriter(out_dir)
    n_prompts = max(1, math.ceil(cfg.n / cfg.responses_per_prompt))
    samples: list[dict] = []
    for k in range(n_prompts):
        prompt = build_prompt(cfg, k, n_prompts, images)
        has_image = bool(prompt.images)
        rrng = np.random.default_rng((cfg.seed, k, 1))   # the "temperature" of the group
        for j in range(cfg.responses_per_prompt):
            if len(samples) >= cfg.n:
                break
            fail = prompt.fixed_fail if prompt.fixed_fail is not None else bool(rrng.random() < cfg.fail_rate)
            judged = prompt.respond(rrng, fail, j, n_prompts)
            sample = {"id": f"{prompt.prompt_id}-s{j}", "prompt_id": prompt.prompt_id,
                      "messages": prompt.messages, "tools": prompt.tools, "response": judged.response}
            if not judged.response["tool_calls"]:
                # Its own generator: the reference never shifts any other draw (same seed, same
                # samples as before apart from this field).
                ref_rng = np.random.default_rng((cfg.seed, k, 2, j))
                sample["reference_reply"] = online_reply(ref_rng, judged.response["content"],
                                                         prompt.reference_reply, fail)
            sample["label"] = _label(rrng, judged.verdict, has_image)
            if judged.response["tool_calls"] and cfg.rule_violation_rate > 0:
                # Its own generator, like the reference reply: no other draw shifts.
                vrng = np.random.default_rng((cfg.seed, k, 3, j))
                if vrng.random() < min(1.0, cfg.rule_violation_rate / TOOL_CALL_SHARE):
                    sample = violate_rules(vrng, sample, has_image)
            samples.append(_articles(sample))
    return samples


TOOL_CALL_SHARE = KIND_WEIGHTS[0] + KIND_WEIGHTS[1]   # generate + followup: the responses that call tools
# What the reward's rules catch (rm_jax.score.rules), each with the teacher issue it is labelled as.
RULE_VIOLATIONS = {"malformed_call": "wrong_param", "unknown_tool": "wrong_tool",
                   "missing_required": "missing_param", "duplicate_call": "extra_call"}


def _plain_args(call: dict) -> dict:
    args = call["function"]["arguments"]
    while isinstance(args, str):
        args = json.loads(args)
    return args


def violate_rules(rng: np.random.Generator, sample: dict, has_image: bool) -> dict:
    """A tool-calling response turned into one the reward's rules reject: an unclosed argument
    object (gated), a tool the prompt does not offer (gated), a required argument left out or an
    exact duplicate call (penalties). Always a failure: the label says which and why."""
    kind = _pick(rng, tuple(RULE_VIOLATIONS))
    calls = [json.loads(json.dumps(c)) for c in sample["response"]["tool_calls"]]
    i = int(rng.integers(len(calls)))
    fn = calls[i]["function"]
    offered = {t["function"]["name"] for t in sample["tools"]}
    if kind == "malformed_call":
        fn["arguments"] = json.dumps(_plain_args(calls[i]), ensure_ascii=False)[:-1]   # unclosed object
        reason = f"the {fn['name']} call's arguments are not a closed JSON object"
    elif kind == "unknown_tool":
        old = fn["name"]
        fn["name"] = _pick(rng, sorted(set(TOOLS) - offered))
        reason = f"calls {fn['name']}, which this conversation does not offer, instead of {old}"
    elif kind == "missing_required":
        args = _plain_args(calls[i])
        required = [a for a in TOOLS[fn["name"]]["function"]["parameters"]["required"] if a in args]
        gone = _pick(rng, required)
        del args[gone]
        fn["arguments"] = args
        reason = f"the {fn['name']} call leaves out the required argument {gone}"
    else:
        dup = json.loads(json.dumps(calls[i]))
        dup["id"] = f"{calls[i]['id']}_dup"
        calls.insert(i + 1, dup)
        reason = f"calls {fn['name']} twice with the same arguments"
    out = dict(sample)
    out["response"] = {"content": sample["response"]["content"], "tool_calls": calls}
    out["label"] = {"l3": "fail", "reason": reason, "issues": [RULE_VIOLATIONS[kind]],
                    "img": sample["label"]["img"] if has_image else None}
    return out


# Words an online reply adds or swaps in: wording noise that carries no content.
_FILLER = ("sure", "now", "just", "also", "here", "okay", "then", "really", "quickly", "again",
           "please", "great")
_OPENERS = ("Sure! ", "Okay, ", "Thanks for waiting. ", "Right, ", "Of course. ")


def online_reply(rng: np.random.Generator, response: str, correct: str | None, fail: bool) -> str:
    """The reply that "really went out" for a text-only prompt (the field report's §5 check).

    Online replies were mostly right, so a passing response reads like the reply that went out
    (its own text, lightly reworded: character similarity mostly 0.6-1.0), and a failing one
    differs from it (the prompt's correct reply, more heavily reworded: mostly 0.2-0.7). The
    teacher's fail rate must therefore fall as similarity rises; flat rates mean label noise.
    The judge never reads this field (render.py ignores it)."""
    base = response if not fail or not correct else correct
    strength = rng.uniform(0.0, 0.3) if not fail else rng.uniform(0.3, 0.8)
    words: list[str] = []
    for w in base.split():
        r = rng.random()
        if r < strength / 3:
            continue                                      # drop
        if r < 2 * strength / 3:
            words.append(_pick(rng, _FILLER))             # swap
            continue
        if r < strength:
            words.append(_pick(rng, _FILLER))             # insert
        words.append(w)
    text = " ".join(words) or base
    if rng.random() < strength:
        text = _pick(rng, _OPENERS) + text
    return text


_A_VOWEL = re.compile(r"\b([Aa]) (?=orange\b)")


def _articles(value: Any) -> Any:
    """'a orange' -> 'an orange' everywhere (also inside encoded arguments). Applied to both
    classes alike, so the article carries no label information."""
    if isinstance(value, str):
        return _A_VOWEL.sub(r"\1n ", value)
    if isinstance(value, list):
        return [_articles(v) for v in value]
    if isinstance(value, dict):
        return {k: _articles(v) for k, v in value.items()}
    return value


def dumps(sample: dict) -> str:
    return json.dumps(sample, ensure_ascii=False)


# Everything the judge will read, for training the tokenizer on the right distribution.
def corpus_texts(samples: list[dict]) -> list[str]:
    texts: list[str] = [judge_contracts.TOOL_CALL_CONTRACT, judge_contracts.TEXT_ONLY_CONTRACT,
                        judge_contracts.TOOL_CALL_CONTRACT_COMPACT, judge_contracts.TEXT_ONLY_CONTRACT_COMPACT]
    texts += [json.dumps(t, ensure_ascii=False) for t in TOOLS.values()]
    texts += [tool_signature(t) for t in TOOLS.values()]   # the compact listing (data.tools_listing)
    for s in samples:
        texts += [json.dumps(t, ensure_ascii=False) for t in s["tools"]]
        for m in s["messages"]:
            c = m.get("content")
            if isinstance(c, str):
                texts.append(c)
            elif isinstance(c, list):
                texts += [p["text"] for p in c if p.get("type") == "text"]
        resp = s["response"]
        if resp.get("content"):
            texts.append(resp["content"])
        for call in resp.get("tool_calls") or []:
            args = call["function"]["arguments"]
            texts.append(json.dumps({"name": call["function"]["name"], "arguments": args}, ensure_ascii=False))
        lab = s["label"]
        texts.append("{" + ", ".join(f"{json.dumps(key)}: {json.dumps(lab[key], ensure_ascii=False)}"
                                     for key in ("l3", "reason", "issues", "img")) + "}")
    return texts


def write_dataset(out_dir: str, n: int, seed: int = 0, fail_rate: float = 0.08,
                  with_tokenizer: bool = True, vocab_size: int = 4096, rule_violation_rate: float = 0.0) -> dict:
    """samples.jsonl + images/ + tokenizer/ under out_dir; returns a small summary."""
    os.makedirs(out_dir, exist_ok=True)
    cfg = SynthConfig(n=n, seed=seed, fail_rate=fail_rate, rule_violation_rate=rule_violation_rate)
    samples = generate(cfg, out_dir)
    with open(os.path.join(out_dir, "samples.jsonl"), "w", encoding="utf-8") as f:
        for s in samples:
            f.write(dumps(s) + "\n")
    if with_tokenizer:
        from rm_jax.data.tokenizer_build import write_tokenizer_dir
        write_tokenizer_dir(os.path.join(out_dir, "tokenizer"), corpus_texts(samples), vocab_size)
    n_fail = sum(s["label"]["l3"] == "fail" for s in samples)
    n_tool = sum(bool(s["response"]["tool_calls"]) for s in samples)
    return {"n": len(samples), "n_fail": n_fail, "fail_rate": n_fail / max(1, len(samples)),
            "tool_call_share": n_tool / max(1, len(samples)),
            "n_prompts": len({s["prompt_id"] for s in samples})}
