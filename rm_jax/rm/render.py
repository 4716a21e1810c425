"""The scalar RM's input: the policy's conversation as the judge's transcript, then one candidate
response as the target assistant turn, in the base model's chat template.

    system    = RM_SYSTEM (one fixed text: never routed by the response, so that every candidate
                of a prompt shares the prompt tokens exactly)
    user      = the judge renderer's transcript of the conversation (turns, tool results, images in
                place), without the judged response
    assistant = the candidate response (its text, then its tool calls), closed by the template's
                end-of-turn token -- the *reward position*

The prompt and the candidate turn are tokenized as separate pieces, so the shared prefix is the
same token ids for every candidate by construction; ``build`` still asserts it per group. The
candidate span carries a response mask whose last 1 is the end-of-turn token: the reward position
is read from that mask (never ``hidden[:, -1]``), so right/left padding, pad == eos and the
end-of-turn tokens of history turns cannot move it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rm_jax.data import images as images_lib
from rm_jax.data import target as target_lib
from rm_jax.data.render import Renderer, _Parts, build_transcript, response_parts, system_with_tools
from rm_jax.data.schema import Sample, SampleError

RM_SYSTEM = "Rate how well the assistant's final turn serves the conversation."
REWARD_POSITION_RULE = ("the response mask's last 1: the chat template's end-of-turn token closing the target "
                        "assistant turn (eos_token_id), located from the mask, not the array end")


@dataclasses.dataclass
class RenderedCandidate:
    id: str
    prompt_ids: np.ndarray        # [Tp] int32, shared by the prompt's candidates
    response_ids: np.ndarray      # [Tr] int32: the assistant turn up to and including end-of-turn
    pixel_values: np.ndarray      # [P, C*T*p*p]
    image_grid_thw: np.ndarray    # [N, 3]
    has_eos: bool                 # the turn ends in the end-of-turn token

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


class RMRenderer:
    """Wraps the judge's Renderer: same tokenizer, image processor, guard and transcript."""

    def __init__(self, renderer: Renderer, system: str = RM_SYSTEM):
        self.r, self.system = renderer, system
        self.tokenizer = renderer.tokenizer
        self.eos_id = int(renderer.eos_id)

    def chat(self, sample: Sample):
        transcript = build_transcript(sample, self.r.guard, with_response=False)
        system = system_with_tools(self.system, sample, self.r.cfg, self.r.guard)
        return [{"role": "system", "content": system},
                {"role": "user", "content": transcript.parts}], transcript.images

    def template_probe(self) -> str:
        """The template's text for a fixed chat (its hash goes in the manifest)."""
        return self.tokenizer.apply_chat_template(
            [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
             {"role": "assistant", "content": "A"}], tokenize=False)

    def render(self, sample: Sample) -> RenderedCandidate:
        chat, refs = self.chat(sample)
        tools = self.r.template_tools(sample)
        resp = _Parts(self.r.guard)
        response_parts(resp, sample)
        reply = "".join(p["text"] for p in resp.parts)
        prompt_ids, response_ids, has_eos = split_turn(self.tokenizer, chat, reply, self.eos_id, tools=tools)
        pil = [images_lib.load_image(r.source, r.field) for r in refs]
        processed = self.r.image_pre(pil)
        prompt_ids = self.r._expand_images(prompt_ids, processed.tokens_per_image)
        return RenderedCandidate(id=sample.id, prompt_ids=np.asarray(prompt_ids, np.int32),
                                 response_ids=np.asarray(response_ids, np.int32),
                                 pixel_values=processed.pixel_values,
                                 image_grid_thw=np.asarray(processed.grid_thw, np.int32).reshape(-1, 3),
                                 has_eos=has_eos)


def split_turn(tokenizer, chat: list[dict], reply: str, eos_id: int, *, tools=None
               ) -> tuple[list[int], list[int], bool]:
    """(prompt ids, target-turn ids up to and including its end-of-turn token, has_eos) for
    ``chat`` (any number of earlier turns, assistant turns included) + the assistant ``reply``.
    Prompt and turn are tokenized as separate pieces, so every reply to one chat shares the
    prompt ids exactly. What the template writes after the end-of-turn token is not part of the
    candidate."""
    prompt_text = tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False)
    full_text = tokenizer.apply_chat_template(chat + [{"role": "assistant", "content": reply}], tools=tools,
                                              tokenize=False)
    if not full_text.startswith(prompt_text):
        raise SampleError("template_mismatch", "response",
                          "the chat template's text with the response does not start with its prompt text")
    turn_ids = target_lib.encode_piece(tokenizer, full_text[len(prompt_text):])
    ends = [i for i, t in enumerate(turn_ids) if t == eos_id]
    if not ends:
        return target_lib.encode_piece(tokenizer, prompt_text), turn_ids, False
    return target_lib.encode_piece(tokenizer, prompt_text), turn_ids[:ends[-1] + 1], True
