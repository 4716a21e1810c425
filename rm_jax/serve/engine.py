"""What the device worker runs: scoring batches (the ``launch.score`` rows) and chat generation.

``Engine.load(workdir, step, ...)`` restores the judge the way ``launch.score`` does (same
renderer from the run's data manifest, same ``Scorer``, same row function), so a ``/v1/score``
row equals the ``launch.score`` line for the same sample.

The chat endpoint serves the same weights as a plain chat model: the run's tokenizer and chat
template over the request's messages (text, and images given as data URIs, processed by the
run's image processor with the training pixel budget), then ``Decoder.sample_text``. Prompts
may be longer than the training buckets (a teacher prompt carries a whole contract): chat has its
own buckets, doubling up to the model's position limit.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import numpy as np

from rm_jax.data import images as images_lib
from rm_jax.data import loader as loader_lib
from rm_jax.data import target as target_lib
from rm_jax.data.schema import Sample, SampleError
from rm_jax.model.decode import TextGeneration, TextSpec
from rm_jax.model.registry import prepare_inputs
from rm_jax.calibration import IDENTITY, Calibration
from rm_jax.score.reward import RewardSettings
from rm_jax.score.scorer import Scorer, ScoreMode
from rm_jax.serve.stream import ScoreStream
from rm_jax.serve.rollout import assistant_turn_start
from rm_jax.serve.toolcalls import CallFormat, format_of_template

KIND_CHAT = "chat"          # the batcher's kinds: the ScoreModes, and chat


def kind_label(kind) -> str:
    """A batch kind's metrics label: score_full, score_p_pass, chat."""
    return f"score_{kind.value}" if isinstance(kind, ScoreMode) else str(kind)
CHAT_BATCH = 8              # chat rows per device call (its own compile per bucket and budget)
CHAT_MAX_TOKENS = 1024      # the largest completion budget (a request's max_tokens is clamped)
CHAT_DEFAULT_TOKENS = 256   # when a request gives none
CHAT_MAX_CONTEXT = 32768    # prompt + completion, at most (and at most the model's positions)


class ChatInputError(ValueError):
    """A chat request the model cannot take (bad image, prompt too long): answered 400."""


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    ids: np.ndarray             # [T] prompt ids, image pads expanded, generation prompt included
    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    temperature: float
    max_tokens: int
    top_logprobs: int
    seed: int | None


@dataclasses.dataclass(frozen=True)
class ChatOutput:
    text: str
    token_ids: tuple[int, ...]          # stop token excluded
    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]   # per token: (id, logprob) alternatives
    finish_reason: str                  # "stop" | "length"
    prompt_tokens: int


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(int(n) - 1, 0).bit_length())


class Engine:
    def __init__(self, *, model, renderer, run_cfg, step: int, workdir: str, max_batch: int, max_new_tokens: int,
                 reward: RewardSettings, call_format: CallFormat | None = None,
                 calibration: Calibration = IDENTITY):
        from rm_jax.model.decode import Decoder
        self.model, self.renderer, self.run_cfg, self.step = model, renderer, run_cfg, int(step)
        self.workdir = os.path.abspath(workdir)
        self.reward = reward
        self.calibration = calibration      # P(pass) before the reward reads it (identity by default)
        self.model_type = run_cfg.model.model_type
        self.max_batch = int(max_batch)
        self.scorer = Scorer.for_run(model, renderer, run_cfg, batch_size=self.max_batch,
                                     max_new_tokens=max_new_tokens, progress=False)
        self.decoder: Decoder = self.scorer.decoder          # one split of the weights for both paths
        tok = renderer.tokenizer
        self.pad_id = self.scorer.pad_id
        stops = {int(renderer.eos_id)}
        for name in ("<|im_end|>", "<|endoftext|>"):
            i = tok.convert_tokens_to_ids(name)
            if isinstance(i, int) and i != tok.unk_token_id:
                stops.add(i)
        self.stop_ids = tuple(sorted(stops))
        # Chat prompts may be longer than the training buckets; each longer bucket is its own
        # compile, made only when a prompt needs it.
        max_pos = min(int(model.cfg.text.max_position_embeddings), CHAT_MAX_CONTEXT)
        buckets, b = list(self.scorer.buckets), self.scorer.buckets[-1]
        while b * 2 <= max_pos:
            b *= 2
            buckets.append(b)
        self.chat_buckets = tuple(buckets)
        self.model_id = f"{os.path.basename(self.workdir.rstrip(os.sep)) or 'judge'}-step{self.step}"
        # How rollouts are read: the template's assistant-turn start, and the call format it names
        # (a policy's format may be forced with call_format).
        self.assistant_start = assistant_turn_start(tok)
        self.call_format = format_of_template(tok.chat_template) if call_format is None else call_format

    @classmethod
    def load(cls, workdir: str, step: int | None = None, *, max_batch: int = 32, max_new_tokens: int = 64,
             tokenizer: str = "", reward: RewardSettings = RewardSettings(), calibration: Calibration = IDENTITY,
             call_format: CallFormat | None = None) -> "Engine":
        from rm_jax.score.checkpoints import load_judge
        from rm_jax.score.run import renderer_for
        run_cfg, renderer = renderer_for(workdir, tokenizer)
        model, _, used = load_judge(workdir, step)
        return cls(model=model, renderer=renderer, run_cfg=run_cfg, step=used, workdir=workdir, max_batch=max_batch,
                   max_new_tokens=max_new_tokens, reward=reward, call_format=call_format, calibration=calibration)

    # -- the worker's entry point ---------------------------------------------------------------

    def run_batch(self, kind: str, payloads: Sequence) -> list:
        if isinstance(kind, ScoreMode):
            return self._score(kind, payloads)
        if kind == KIND_CHAT:
            return self._chat(payloads)
        raise ValueError(f"unknown batch kind {kind!r}")

    def score_stream(self, *, max_wait_s: float, on_batch=None):
        """Continuous batching of the scoring kinds over this engine's scorer (the worker's
        usual path; ``run_batch`` stays for retrying a job alone)."""
        return ScoreStream(self.scorer, self.rows,
                           max_wait_s=max_wait_s, on_batch=on_batch)

    def rows(self, mode: ScoreMode, samples: Sequence[Sample], results: Sequence) -> list[dict]:
        """Scorer results -> the ``launch.score`` rows of a request."""
        from rm_jax.score.run import p_pass_row, result_row
        row = result_row if mode is ScoreMode.FULL else p_pass_row
        return [row(s, r, self.reward, self.calibration) for s, r in zip(samples, results)]

    def _score(self, mode: ScoreMode, payloads: Sequence[Sequence[Sample]]) -> list[list[dict]]:
        """Every request's samples in one scorer call (GRPO groups across requests share prefixes)."""
        flat = [s for samples in payloads for s in samples]
        rows = self.rows(mode, flat, self.scorer.run(mode, flat))
        out, k = [], 0
        for samples in payloads:
            out.append(rows[k:k + len(samples)])
            k += len(samples)
        return out

    # -- chat -----------------------------------------------------------------------------------

    def prepare_chat(self, messages: list[dict], *, temperature: float, max_tokens: int | None,
                     top_logprobs: int, seed: int | None) -> ChatPrompt:
        """OpenAI messages (content: str or text / image_url parts) -> a tokenized prompt."""
        chat, pil = [], []
        for i, m in enumerate(messages):
            content = m.get("content")
            role = "system" if m["role"] == "developer" else m["role"]
            if content is None or isinstance(content, str):
                chat.append({"role": role, "content": content or ""})
                continue
            parts = []
            for j, p in enumerate(content):
                if p["type"] == "text":
                    parts.append({"type": "text", "text": p.get("text") or ""})
                    continue
                url = (p.get("image_url") or {}).get("url") or ""
                field = f"messages[{i}].content[{j}].image_url"
                if not url.startswith("data:image/"):
                    raise ChatInputError(f"{field}: only data:image/...;base64 URIs are accepted")
                try:
                    pil.append(images_lib.load_image(url, field))
                except SampleError as e:
                    raise ChatInputError(str(e)) from None
                parts.append({"type": "image"})
            chat.append({"role": role, "content": parts})
        tok = self.renderer.tokenizer
        try:
            text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        except Exception as e:   # noqa: BLE001 -- a template that refuses these messages: the client's input
            raise ChatInputError(f"messages: the chat template refused them: {e}") from None
        processed = self.renderer.image_pre(pil)
        try:
            ids = self.renderer._expand_images(target_lib.encode_piece(tok, text), processed.tokens_per_image)
        except SampleError as e:
            raise ChatInputError(str(e)) from None
        budget = min(int(max_tokens or CHAT_DEFAULT_TOKENS), CHAT_MAX_TOKENS)
        if len(ids) + budget > self.chat_buckets[-1] or len(ids) > self.chat_buckets[-1]:
            raise ChatInputError(f"messages: the prompt is {len(ids)} tokens; with max_tokens={budget} it exceeds "
                                 f"the model's context of {self.chat_buckets[-1]} tokens")
        return ChatPrompt(np.asarray(ids, np.int32), processed.pixel_values, processed.grid_thw, float(temperature),
                          budget, int(top_logprobs), seed)

    def _collate(self, prompts: Sequence[ChatPrompt], batch: int):
        cfg = self.model.cfg
        collate = loader_lib.Collate(batch, self.chat_buckets, self.pad_id, cfg.vision.patch_dim)
        b = collate([{"input_ids": p.ids, "target_mask": np.zeros(len(p.ids), np.uint8), "verdict_pos": -1,
                      "label": -1, "route_tool_call": 0, "has_image": int(len(p.image_grid_thw) > 0),
                      "pixel_values": p.pixel_values, "image_grid_thw": p.image_grid_thw} for p in prompts])
        mask = b["attention_mask"]
        mask[len(prompts):, 0] = 1         # filler rows: one pad token, never empty
        return prepare_inputs(cfg, b["input_ids"], mask, b["pixel_values"], b["image_grid_thw"], attention="lengths")

    def _chat(self, prompts: Sequence[ChatPrompt]) -> list[ChatOutput]:
        import jax
        out: list[ChatOutput] = []
        for start in range(0, len(prompts), CHAT_BATCH):
            chunk = list(prompts[start:start + CHAT_BATCH])
            shards = self.scorer.batch_shards
            b = -(-_pow2_at_least(len(chunk), 1) // shards) * shards   # the batch axes must divide it
            longest = max(p.max_tokens for p in chunk)
            # Longest prompt + budget must fit the model; the budget bucket is a power of two >= 16.
            n = min(_pow2_at_least(longest, 16), CHAT_MAX_TOKENS)
            inputs = self.scorer.place(self._collate(chunk, b))
            temp_b = np.zeros(b, np.float32)
            budget_b = np.zeros(b, np.int32)
            for k, p in enumerate(chunk):
                temp_b[k], budget_b[k] = p.temperature, p.max_tokens
            seed = next((p.seed for p in chunk if p.seed is not None), None)
            seed = int(np.random.randint(0, 2**31 - 1)) if seed is None else seed
            spec = TextSpec(max_new_tokens=n, stop_ids=self.stop_ids, pad_id=self.pad_id)
            gen: TextGeneration = jax.device_get(self.decoder.sample_text(inputs, spec, temp_b, budget_b, seed,
                                                                          live_b=np.arange(b) < len(chunk)))
            for k, p in enumerate(chunk):
                out.append(self._chat_output(gen, k, p))
        return out

    def _chat_output(self, gen: TextGeneration, row: int, p: ChatPrompt) -> ChatOutput:
        n = int(gen.n_tokens_b[row])
        ids = [int(t) for t in gen.tokens_bn[row, :n]]
        finished = bool(gen.finished_b[row])
        if finished and ids and ids[-1] in self.stop_ids:
            n -= 1
            ids = ids[:-1]
        k = max(int(p.top_logprobs), 0)
        top = tuple(tuple((int(gen.top_ids_bnk[row, i, j]), float(gen.top_logprob_bnk[row, i, j])) for j in range(k))
                    for i in range(n))
        text = self.renderer.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return ChatOutput(text=text, token_ids=tuple(ids), logprobs=tuple(float(x) for x in gen.logprob_bn[row, :n]),
                          top=top, finish_reason="stop" if finished else "length", prompt_tokens=len(p.ids))

    def token_text(self, token_id: int) -> str:
        return self.renderer.tokenizer.decode([token_id], skip_special_tokens=False,
                                              clean_up_tokenization_spaces=False)
