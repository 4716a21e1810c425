"""Policy SFT examples: the conversation as the policy reads it, its passing response as the target.

The field report's judge starts from the policy's own SFT checkpoint (§2.1): a policy trained to
write the right call has already learned to read the request and copy its values ("2K" into
``resolution``), which is the lookup a judge needs before it can compare. This renderer turns a
judge sample into that policy example:

    prompt = the chat template over the sample's messages and tool schemas (or their signature
             lines, as the judge lists them), with the generation prompt (the policy's own input
             format; images in place, tool results as the judge transcript shows them)
    target = the response in the policy's output format: its text, then each call as a
             Qwen/Hermes ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` block,
             then ``<|im_end|>`` (the only tokens with loss)

Only responses the teacher passed are policy targets: a failing one is a recorded rejection
(``not_a_passing_response``), never a silent drop. The examples use the judge's shard format
(``verdict_pos = -1``: there is no verdict slot), so the same loader, trainer and checkpoint
export serve both stages.
"""

from __future__ import annotations

import numpy as np

from rm_jax.data import images as images_lib
from rm_jax.data import target as target_lib
from rm_jax.data.render import (JudgeInput, Renderer, _message_parts, _Parts, _tool_result, route_of,
                                system_listing)
from rm_jax.data.schema import ImageRef, Sample, SampleError, ToolCall
from rm_jax.data.tool_args import canonical_arguments

NOT_PASSING = "not_a_passing_response"


def _call_dict(call: ToolCall, tools) -> dict:
    # The judge's canonical argument order (tool_args): the policy learns the order it is judged in.
    return {"function": {"name": call.name, "arguments": canonical_arguments(call, tools)}}


class PolicyRenderer(Renderer):
    """Renderer.render's contract (a JudgeInput, SampleError with a reason) for policy examples."""

    def policy_chat(self, sample: Sample) -> tuple[list[dict], list[ImageRef]]:
        chat: list[dict] = []
        images: list[ImageRef] = []
        for i, msg in enumerate(sample.messages):
            out = _Parts(self.guard)
            if msg.role == "tool":
                _tool_result(out, msg, sample.base_dir, i)
            else:
                _message_parts(out, msg)
            entry: dict = {"role": msg.role, "content": out.parts}
            if msg.tool_calls:
                entry["tool_calls"] = [_call_dict(c, sample.tools) for c in msg.tool_calls]
            chat.append(entry)
            images += out.images
        listing = system_listing(sample, self.cfg, self.guard)
        if listing:   # where the template would put its tools block: the system turn
            if chat and chat[0]["role"] == "system":
                chat[0] = {**chat[0], "content": chat[0]["content"] + [{"type": "text", "text": "\n\n" + listing}]}
            else:
                chat.insert(0, {"role": "system", "content": [{"type": "text", "text": listing}]})
        return chat, images

    def response_message(self, sample: Sample) -> dict:
        resp = sample.response
        msg: dict = {"role": "assistant", "content": self.guard(resp.content) if resp.content else None}
        if resp.tool_calls:
            msg["tool_calls"] = [_call_dict(c, sample.tools) for c in resp.tool_calls]
        return msg

    def texts(self, sample: Sample) -> tuple[str, str, list[ImageRef]]:
        """(prompt text, target text, images). The target is what the template appends for the
        response turn, up to and including <|im_end|>."""
        chat, refs = self.policy_chat(sample)
        tools = self.template_tools(sample)
        prompt = self.tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False)
        full = self.tokenizer.apply_chat_template(chat + [self.response_message(sample)], tools=tools,
                                                  add_generation_prompt=False, tokenize=False)
        opener = "<|im_start|>assistant\n"
        if not (full.startswith(prompt[: -len(opener)]) and prompt.endswith(opener)):
            raise SampleError("template_mismatch", "response",
                              "the chat template does not render the response turn after the generation prompt")
        tail = full[len(prompt) - len(opener):]
        if not tail.startswith(opener):
            raise SampleError("template_mismatch", "response", "the response turn does not open an assistant turn")
        body = tail[len(opener):]
        end = body.rfind(self.tokenizer.eos_token or "<|im_end|>")
        if end < 0:
            raise SampleError("template_mismatch", "response", "the response turn has no end-of-turn token")
        return prompt, body[:end], refs

    def render(self, sample: Sample, *, with_target: bool = True) -> JudgeInput:
        if with_target and (sample.label is None or sample.label.l3 != "pass"):
            raise SampleError(NOT_PASSING, "label", "policy SFT learns from passing responses only")
        prompt, target, refs = self.texts(sample)
        pil = [images_lib.load_image(r.source, r.field) for r in refs]
        processed = self.image_pre(pil)
        prompt_ids = self._expand_images(target_lib.encode_piece(self.tokenizer, prompt), processed.tokens_per_image)
        target_ids = target_lib.encode_piece(self.tokenizer, target) + [self.eos_id] if with_target else []
        ids = np.asarray(prompt_ids + target_ids, np.int32)
        mask = np.zeros(len(ids), np.uint8)
        mask[len(prompt_ids):] = 1
        return JudgeInput(id=sample.id, prompt_id=sample.prompt_id, input_ids=ids, target_mask=mask,
                         verdict_pos=-1, pixel_values=processed.pixel_values,
                         image_grid_thw=processed.grid_thw, route=route_of(sample), label=0,
                         has_image=bool(refs), n_image_tokens=int(sum(processed.tokens_per_image)),
                         flags=sample.flags)


def build_policy_shards(input_path: str, out_dir: str, cfg, tokenizer_dir: str, *, progress: bool = False) -> dict:
    """Policy examples of a samples JSONL as shards (rm_jax.data.build; failing responses are
    rejections with NOT_PASSING). Returns the build stats."""
    from rm_jax.data import build as build_lib
    opts = build_lib.BuildOptions.from_config(cfg.data)
    renderer = PolicyRenderer.from_config(cfg.data, tokenizer_dir, storage_dtype=opts.pixel_dtype)
    return build_lib.build(input_path, out_dir, renderer, opts, config_dict=cfg.to_dict(),
                           tokenizer_dir=tokenizer_dir, progress=progress).stats
