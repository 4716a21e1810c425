"""Base-LM examples: next-token text in the policy's chat format or the judge's transcript format.

Nobody starts a judge from random weights: users bring a pretrained model. The embedded default
imitates that with a tiny base LM (launch.pretrain_base) trained once on synthetic conversations,
then fine-tuned into the policy and the judge as users do. Each sample becomes one example, in
one of two forms chosen by its prompt_id (so a prompt's responses share a form and both forms
cover the whole generator):

    chat       = the conversation and its response as the policy reads and writes them
                 (PolicyRenderer.texts, the response turn closed by <|im_end|>)
    transcript = the judge's input up to the assistant opener (Renderer.prompt_text): the routed
                 contract and the transcript with the judged response, without any verdict

Every text token is a target; image placeholder tokens are not (no pixels are predicted). The
verdict JSON never appears, so the base cannot learn the judge's labels. Examples carry no
label (``label = 0``, ``verdict_pos = -1``), as policy examples do, so the same shards, loader,
trainer and HF export serve the base.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib

import numpy as np

from rm_jax.data import build as build_lib
from rm_jax.data import build_rows
from rm_jax.data import images as images_lib
from rm_jax.data import target as target_lib
from rm_jax.data.policy import PolicyRenderer
from rm_jax.data.render import JudgeInput, route_of
from rm_jax.data.schema import Sample

FORM_CHAT = "chat"
FORM_TRANSCRIPT = "transcript"


def form_of(prompt_id: str) -> str:
    """A stable half of the prompts in each form (crc32, not Python's salted hash)."""
    return FORM_CHAT if zlib.crc32(prompt_id.encode()) % 2 == 0 else FORM_TRANSCRIPT


class PretrainRenderer(PolicyRenderer):
    """Renderer.render's contract for base-LM examples (SampleError with a reason on bad input)."""

    def text_of(self, sample: Sample) -> tuple[str, list]:
        if form_of(sample.prompt_id) == FORM_CHAT:
            prompt, body, refs = self.texts(sample)
            return prompt + body, refs
        return self.prompt_text(sample)

    def render(self, sample: Sample, *, with_target: bool = True) -> JudgeInput:
        del with_target   # every example is all target: there is no label to leave out
        text, refs = self.text_of(sample)
        processed = self.image_pre([images_lib.load_image(r.source, r.field) for r in refs])
        ids = self._expand_images(target_lib.encode_piece(self.tokenizer, text), processed.tokens_per_image)
        if form_of(sample.prompt_id) == FORM_CHAT:
            ids = ids + [self.eos_id]
        ids_t = np.asarray(ids, np.int32)
        mask = (ids_t != self.image_pad_id).astype(np.uint8)
        mask[0] = 0   # the first token has nothing before it to be predicted from
        return JudgeInput(id=sample.id, prompt_id=sample.prompt_id, input_ids=ids_t, target_mask=mask,
                          verdict_pos=-1, pixel_values=processed.pixel_values,
                          image_grid_thw=processed.grid_thw, route=route_of(sample), label=0,
                          has_image=bool(refs), n_image_tokens=int(sum(processed.tokens_per_image)),
                          flags=sample.flags)


def build_pretrain_shards(input_path: str, out_dir: str, cfg, tokenizer_dir: str) -> dict:
    """Base-LM examples of a samples JSONL as shards (rm_jax.data.build, no failure oversampling:
    there are no labels to balance). Returns the build stats."""
    opts = dataclasses.replace(build_lib.BuildOptions.from_config(cfg.data), oversample_fail=1)
    renderer = PretrainRenderer.from_config(cfg.data, tokenizer_dir, storage_dtype=opts.pixel_dtype)
    return build_lib.build(input_path, out_dir, renderer, opts, config_dict=cfg.to_dict(),
                           tokenizer_dir=tokenizer_dir, progress=False).stats


# ---------------------------------------------------------------- the corpus


def request_key(sample: dict) -> str:
    """The user turns' text: what makes two prompts the same request (image files differ by name)."""
    texts = []
    for m in sample["messages"]:
        if m["role"] != "user":
            continue
        c = m["content"]
        texts += [c] if isinstance(c, str) else [p["text"] for p in c if p["type"] == "text"]
    return "\n".join(texts)


def heldout_request_keys(samples_path: str, heldout_fraction: float, split_seed: int) -> set[str]:
    """The request keys of a samples JSONL's held-out prompts (the build's split rule)."""
    keys = set()
    with open(samples_path) as f:
        for line in f:
            s = json.loads(line)
            if build_rows.split_of(s["prompt_id"], heldout_fraction, split_seed) == "heldout":
                keys.add(request_key(s))
    return keys


def write_corpus(data: str, excluded: set[str]) -> tuple[str, int, int]:
    """data/samples.jsonl minus the excluded requests, as data/corpus.jsonl (image paths stay
    relative to the same folder). Returns (path, samples read, samples dropped)."""
    path = os.path.join(data, "corpus.jsonl")
    n = dropped = 0
    with open(os.path.join(data, "samples.jsonl")) as src, open(path, "w") as dst:
        for line in src:
            n += 1
            if request_key(json.loads(line)) in excluded:
                dropped += 1
                continue
            dst.write(line)
    return path, n, dropped
