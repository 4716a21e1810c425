"""The scorer: P(pass) at the verdict slot after one prefill, and the full verdict by decoding.

``Scorer(model, renderer, field_order=..., buckets=..., batch_size=..., max_new_tokens=...)``

* ``p_pass(samples) -> list[VerdictScore]``: the GRPO reward's continuous part.
* ``score(samples) -> list[JudgeResult]``: P(pass), then the rest of the verdict JSON (reason,
  issues, img) by greedy decoding with a KV cache, parsed with ``target.parse_output``.

Design choices:

* **Exactly the training input.** Each sample goes through ``renderer.render(sample,
  with_target=False)`` (the one renderer build and labelling use), then the verdict prefix tokens
  ``renderer.scoring_prefix_ids()`` (``{"l3": "``, tokenized as its own piece, as the training
  target was). The last prompt position is then the verdict slot, the position whose next-token
  distribution the judge was trained to put on ``pass``/``fail``.
* **The slot, never the first "pass".** P(pass) = softmax over the two verdict tokens' logits
  at the slot. Searching the generated text for the first "pass" would read a word in a reason
  ("... the pass-through URL ...") or a confidence already collapsed by the reason written before
  it. ``off_vocab_mass`` = 1 - the full-vocabulary probability of those two tokens: a judge that
  puts mass elsewhere at the slot is off its format, which P(pass) alone would hide.
* **One prefill, no [B, T, V].** The verdict-first P(pass) path is one jitted forward with
  ``logits=False``; only each row's last hidden state meets the LM head (``head_dv()``), so the
  vocabulary matmul is ``[B, D] x [D, V]``, not ``[B, T, D] x [D, V]``.
* **Static shapes.** Samples are sorted by length and batched; each batch is padded like the
  training loader (``loader.Collate``: the smallest length bucket that fits, right padding, a fixed
  batch size with filler rows; with ``frame_capacity``, the run's vision frame budget and image
  rows and patches on one ``ImageLadder`` rung, otherwise powers of two each), so a run compiles
  one prefill (and one decode loop) per bucket and rung, whatever the samples. Filler rows hold one pad token
  so that no row is empty; their results are dropped.
* **Shared prefixes (GRPO groups).** Samples with one ``prompt_id`` and the same images share
  their rendered prompt up to the response. With ``share_prefix`` (the default, verdict-first)
  each group's longest common token prefix (at least ``min_shared_tokens``, holding every image
  token) is prefilled once into a KV cache; each member then runs only its own tokens after it
  (``Decoder.extend_slot_logits`` / ``generate_shared``), reading the same slot logits and decoding
  the same text as a whole-prompt prefill (tests: equal to 1e-5, and to transformers). Samples
  without a group are scored whole.
* **Decoding** (``rm_jax.model.decode``): prefill into a static KV cache of ``bucket +
  max_new_tokens`` slots, then a jitted ``while_loop`` of one-token steps, stopping per row at EOS
  and as a whole when every row is done or the budget is spent. Verdict-first: the decoder starts
  *at* the slot, reads P(pass) from the prefill logits, forces the chosen verdict's tokens
  (argmax over pass/fail, the same decision P(pass) >= 0.5 makes) and decodes the rest.
  Reason-first (the ablation): decoding starts at the assistant turn and the decoder's slot
  automaton reads P(pass) at the step where the generated text ends with ``"l3": "``; ``p_pass``
  stops as soon as every row has reached it.
* **Sharding.** With a mesh (the training mesh; the model loaded onto it), token arrays are
  placed with their batch dimension over the batch axes (``data, fsdp, expert``); the model's own
  logical constraints do the rest. ``batch_size`` must divide evenly over those axes.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import itertools
import math
import sys
from typing import Sequence

import jax
import numpy as np

from rm_jax.data import loader as loader_lib
from rm_jax.data import target as target_lib
from rm_jax.data.render import JudgeInput, Renderer
from rm_jax.data.schema import Sample, render_error
from rm_jax.model import placement
from rm_jax.model.decode import SLOT_PATTERN, DecodeSpec, Decoder, slot_automaton, verdict_probabilities
from rm_jax.model.interface import JudgeInputs, JudgeModel
from rm_jax.model.registry import prepare_inputs
from rm_jax.sharding import logical_to_spec


SUFFIX_ROOM = 128   # KV slots a prefix cache keeps for member suffixes, at least


@dataclasses.dataclass(frozen=True)
class VerdictScore:
    id: str
    p_pass: float              # softmax over [pass, fail] logits at the slot; nan without a slot
    off_vocab_mass: float      # 1 - P(pass token) - P(fail token) over the full vocabulary
    logit_pass: float
    logit_fail: float
    slot_found: bool = True    # reason-first: the decoder reached '"l3": "' within the budget
    error: str | None = None   # render failure / too long: no score


@dataclasses.dataclass(frozen=True)
class JudgeResult:
    id: str
    p_pass: float
    verdict: str | None        # the token written at the slot (argmax pass/fail unless forced), else parsed l3
    reason: str | None
    issues: tuple[str, ...]
    img: int | None
    parse_ok: bool             # parse_output status "ok" or "recovered"
    status: str                # parse_output status, or "error"
    off_vocab_mass: float
    text: str                  # the judge's output: scoring prefix + decoded tokens (EOS cut)
    n_new_tokens: int
    finished: bool             # EOS within max_new_tokens
    slot_found: bool = True
    slot_index: int = -1       # index of the verdict token among the new tokens (0 when verdict-first)
    error: str | None = None


class ScoreMode(enum.StrEnum):
    """What a scoring call computes: P(pass) alone (one prefill) or the full verdict (decoding).
    The HTTP API's ``mode`` values; a ``str``, so ``"p_pass"`` and ``ScoreMode.P_PASS`` are equal."""
    P_PASS = "p_pass"
    FULL = "full"


@dataclasses.dataclass
class ScoreItem:
    """A rendered sample ready for a device batch (``Scorer.render``)."""
    index: int                 # position in the caller's list
    rendered: JudgeInput
    ids: np.ndarray            # prompt + scoring prefix
    key: tuple | None | str = dataclasses.field(default="", repr=False)   # prefix_key, once computed


@dataclasses.dataclass
class PrefixGroup:
    """Samples whose prompts start with the same tokens and images (one prompt_id): the first
    ``n_shared`` tokens are prefilled once, each member continues with its own suffix."""
    items: list[ScoreItem]
    n_shared: int

    def suffix(self, it: ScoreItem) -> np.ndarray:
        return it.ids[self.n_shared:]


def _probabilities(lp: float, lf: float, lse: float) -> tuple[float, float]:
    p_pass, off_vocab = verdict_probabilities(lp, lf, lse)
    return float(p_pass), float(off_vocab)


def _in_flight(calls, depth: int = 2):
    """(batch, device result) pairs -> (batch, host result), with up to ``depth`` calls queued:
    the host collates and dispatches the next batch while the device runs this one (fetching each
    result right after its call serialized the two). Bounded, so only ``depth`` batches' inputs
    (e.g. prefix KV caches) are alive at once."""
    queue: collections.deque = collections.deque()
    for batch, result in calls:
        queue.append((batch, result))
        if len(queue) >= depth:
            done, value = queue.popleft()
            yield done, jax.device_get(value)
    while queue:
        done, value = queue.popleft()
        yield done, jax.device_get(value)


class Scorer:
    def __init__(self, model: JudgeModel, renderer: Renderer, *, field_order: Sequence[str] | None = None,
                 buckets: Sequence[int], batch_size: int, max_new_tokens: int = 128, mesh=None,
                 progress: bool | None = None, share_prefix: bool = True, min_shared_tokens: int = 32,
                 frame_capacity: int | None = None):
        order = tuple(field_order) if field_order is not None else tuple(renderer.cfg.field_order)
        if order != tuple(renderer.cfg.field_order):
            # The slot prefix and the decoded JSON follow the order the judge was trained on.
            raise ValueError(f"field_order {order} differs from the renderer's {tuple(renderer.cfg.field_order)}")
        self.model, self.renderer, self.field_order = model, renderer, order
        self.verdict_first = target_lib.verdict_prefix(order) is not None
        self.prefix_ids = list(renderer.scoring_prefix_ids() or [])
        self.buckets = tuple(sorted(int(b) for b in buckets))
        self.batch_size, self.max_new_tokens = int(batch_size), int(max_new_tokens)
        self.mesh = mesh if mesh is not None else getattr(model, "mesh", None)
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.share_prefix, self.min_shared_tokens = bool(share_prefix), int(min_shared_tokens)
        # The run's patches-per-frame budget (``train.host_batch.frame_capacity``): one vision shape, and
        # image batches padded to an ImageLadder rung. None: powers of two that fit each batch.
        self.frame_capacity = None if frame_capacity is None else int(frame_capacity)
        self.ladder = None if frame_capacity is None else loader_lib.ImageLadder.for_frame_capacity(
            self.frame_capacity, model.cfg.vision.spatial_merge_size)
        self.decoder = Decoder(model, self.mesh)
        tok = renderer.tokenizer
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else renderer.eos_id)
        v = renderer.verdict
        self.pass_id, self.fail_id = int(v.pass_id), int(v.fail_id)
        self._spec = DecodeSpec(max_new_tokens=self.max_new_tokens, eos_id=int(renderer.eos_id), pad_id=self.pad_id,
                                pass_ids=tuple(int(i) for i in v.pass_ids), fail_ids=tuple(int(i) for i in v.fail_ids))
        self._full_state = len(SLOT_PATTERN)
        self._table = None
        self._batch_spec = None
        if self.mesh is not None:
            axes = logical_to_spec(("batch",))[0]
            shards = int(np.prod([self.mesh.shape[a] for a in axes]))
            if self.batch_size % shards:
                raise ValueError(f"batch_size={self.batch_size} is not divisible by the mesh's batch axes "
                                 f"{axes} = {shards} devices")
            self._batch_spec = axes

    @property
    def batch_shards(self) -> int:
        """Devices a batch's rows are split over (a batch size must be a multiple of it)."""
        if self._batch_spec is None or self.mesh is None:
            return 1
        return int(np.prod([self.mesh.shape[a] for a in self._batch_spec]))

    @classmethod
    def for_run(cls, model, renderer: Renderer, run_cfg, **kwargs) -> "Scorer":
        """A scorer with the training run's field order, length buckets and image frame budget."""
        from rm_jax.data.images import ImageBudget
        vision = model.cfg.vision
        capacity = ImageBudget.from_config(run_cfg.data.image).max_patches(vision.patch_size,
                                                                          vision.spatial_merge_size)
        return cls(model, renderer, field_order=tuple(run_cfg.data.field_order), buckets=tuple(run_cfg.data.buckets),
                   frame_capacity=capacity, **kwargs)

    # -- public API -----------------------------------------------------------------------------

    def p_pass(self, samples: Sequence[Sample]) -> list[VerdictScore]:
        """P(pass) at the verdict slot for each sample (order kept)."""
        return self.run(ScoreMode.P_PASS, samples)

    def score(self, samples: Sequence[Sample], *, forced_ids: Sequence[Sequence[int]] | None = None
              ) -> list[JudgeResult]:
        """P(pass) plus the decoded verdict JSON, parsed.

        ``forced_ids`` (optional, per sample): assistant tokens to teacher-force instead of
        decoding (after the scoring prefix when verdict-first) -- reads the slot and the parse of a
        given output, e.g. a teacher label, through the same decoder."""
        return self.run(ScoreMode.FULL, samples, forced_ids=forced_ids)

    def run(self, mode: ScoreMode | str, samples: Sequence[Sample], *,
            forced_ids: Sequence[Sequence[int]] | None = None) -> list:
        """``p_pass`` or ``score`` by mode: one VerdictScore / JudgeResult per sample, order kept."""
        mode = ScoreMode(mode)
        items, errors = self._render(samples)
        out: list = [None] * len(samples)
        for i, err in errors.items():
            out[i] = self.error_result(mode, samples[i].id, err)
        groups: list[PrefixGroup] = []
        if self.verdict_first and self.share_prefix:
            groups, items = self._prefix_groups(items)
        extra = self.max_new_tokens if mode is ScoreMode.FULL else 0
        shared = ((part, self._shared_call(mode, part, cache, rows_b, tokens_bn, n_b, forced_ids))
                  for part, cache, rows_b, tokens_bn, n_b in self._shared_batches(groups, extra, mode))
        whole = ((batch, self._whole_call(mode, batch, inputs, forced_ids))
                 for batch, inputs in self._batches(items, mode))
        for batch, got in itertools.chain(_in_flight(shared), _in_flight(whole)):
            for it, row in zip(batch, self.read(mode, batch, got)):
                out[it.index] = row
        return out

    # -- device batches, for a caller that schedules them (the server's continuous batching) -----
    # ``render`` -> ``prefix_groups`` -> ``dispatch_shared`` / ``dispatch_whole`` (device results,
    # not fetched) -> ``jax.device_get`` -> ``read``: the same calls ``p_pass`` / ``score`` make, so
    # a row is the same whichever batch it lands in (to float tolerance, as batch composition).

    def prefix_key(self, it: ScoreItem) -> tuple | None:
        """What prefix groups are formed by: (prompt_id, the images' digest); None: scored whole."""
        if it.key == "":                   # hashing the pixels is the cost: once per item
            ji = it.rendered
            it.key = None if not ji.prompt_id else (ji.prompt_id, hashlib.sha1(
                np.ascontiguousarray(ji.pixel_values).tobytes()
                + np.asarray(ji.image_grid_thw, np.int64).tobytes()).hexdigest())
        return it.key  # type: ignore[return-value]

    def prefix_groups(self, items: list[ScoreItem]) -> tuple[list[PrefixGroup], list[ScoreItem]]:
        """Groups that share a prefix prefill, and the items scored whole (``[]`` without sharing)."""
        if not (self.verdict_first and self.share_prefix):
            return [], list(items)
        return self._prefix_groups(items)

    @staticmethod
    def suffix_width(longest: int) -> int:
        """The padded suffix width of a prefix batch whose longest member suffix is ``longest``."""
        return max(16, 1 << (int(longest) - 1).bit_length())     # few static suffix widths

    def one_group(self, it: ScoreItem, longest_prefix: int) -> PrefixGroup | None:
        """``it`` as a one-member prefix group: its prompt up to the last token (at most
        ``longest_prefix`` tokens, every image token in it) is the prefix. A lone item then fills a
        shared step's spare member rows instead of a whole-prompt batch of its own; any split
        point reads the same slot (the shared-prefix path is exact). None: no valid split."""
        n = min(len(it.ids) - 1, int(longest_prefix))
        images = np.flatnonzero(it.ids == self.model.cfg.image_token_id)
        if n < 1 or (len(images) and n <= int(images[-1])):
            return None
        return PrefixGroup(items=[it], n_shared=n)

    def dispatch_whole(self, mode: ScoreMode | str, items: list[ScoreItem]):
        """One device batch of at most ``batch_size`` whole prompts: (rows, device result)."""
        mode = ScoreMode(mode)
        if not 0 < len(items) <= self.batch_size:
            raise ValueError(f"a device batch holds 1..{self.batch_size} items, got {len(items)}")
        batch = sorted(items, key=lambda it: len(it.ids))
        inputs = self.place(self._collate([(it.ids, it.rendered) for it in batch]))
        return batch, self._whole_call(mode, batch, inputs, None)

    def dispatch_shared(self, mode: ScoreMode | str, groups: list[PrefixGroup]):
        """One prefill of at most ``batch_size`` prefixes, then their members in device batches:
        [(rows, device result)], every member of a group in this one call."""
        mode = ScoreMode(mode)
        if not 0 < len(groups) <= self.batch_size:
            raise ValueError(f"a prefix batch holds 1..{self.batch_size} groups, got {len(groups)}")
        extra = self.max_new_tokens if mode is ScoreMode.FULL else 0
        return [(part, self._shared_call(mode, part, cache, rows_b, tokens_bn, n_b, None))
                for part, cache, rows_b, tokens_bn, n_b in self._shared_batches(groups, extra, mode)]

    def error_result(self, mode: ScoreMode | str, sample_id: str, error: str):
        """The result of a sample that could not be scored (``render``'s errors)."""
        if ScoreMode(mode) is ScoreMode.P_PASS:
            return VerdictScore(id=sample_id, p_pass=math.nan, off_vocab_mass=math.nan, logit_pass=math.nan,
                                logit_fail=math.nan, slot_found=False, error=error)
        return JudgeResult(id=sample_id, p_pass=math.nan, verdict=None, reason=None, issues=(), img=None,
                           parse_ok=False, status="error", off_vocab_mass=math.nan, text="", n_new_tokens=0,
                           finished=False, slot_found=False, slot_index=-1, error=error)

    def _shared_call(self, mode: ScoreMode, part, cache, rows_b, tokens_bn, n_b, forced_ids):
        if mode is ScoreMode.P_PASS:
            return self.decoder.extend_slot_logits(cache, rows_b, tokens_bn, n_b, self.pass_id, self.fail_id)
        return self.decoder.generate_shared(cache, rows_b, tokens_bn, n_b, self._spec, self._slot_table(),
                                            self._match0(), *self._forced(part, forced_ids), live_b=self._live(part))

    def _whole_call(self, mode: ScoreMode, batch, inputs, forced_ids):
        if mode is ScoreMode.P_PASS:
            if self.verdict_first:
                return self.decoder.slot_logits(inputs, self.pass_id, self.fail_id)
            return self.decoder.generate(inputs, self._spec, self._slot_table(), np.zeros(self.batch_size, np.int32),
                                         live_b=self._live(batch), stop_at_slot=True)
        return self.decoder.generate(inputs, self._spec, self._slot_table(), self._match0(),
                                     *self._forced(batch, forced_ids), live_b=self._live(batch))

    def _match0(self) -> np.ndarray:
        return np.full(self.batch_size, self._full_state if self.verdict_first else 0, np.int32)

    def read(self, mode: ScoreMode | str, batch: list[ScoreItem], got) -> list:
        """A fetched device result -> one VerdictScore (``p_pass``) or JudgeResult (``full``) per row."""
        if ScoreMode(mode) is ScoreMode.FULL:
            return [self._result(it.rendered.id, got, row) for row, it in enumerate(batch)]
        if isinstance(got, tuple):         # slot logits (verdict-first: whole or after a shared prefix)
            lp, lf, lse = got
            found = np.ones(len(lp), bool)
        else:                              # reason-first: the decoder's slot automaton
            lp, lf, lse, found = got.logit_pass_b, got.logit_fail_b, got.logsumexp_b, got.slot_found_b
        out = []
        for row, it in enumerate(batch):
            if not found[row]:
                out.append(VerdictScore(id=it.rendered.id, p_pass=math.nan, off_vocab_mass=math.nan,
                                        logit_pass=math.nan, logit_fail=math.nan, slot_found=False))
                continue
            p, off = _probabilities(lp[row], lf[row], lse[row])
            out.append(VerdictScore(id=it.rendered.id, p_pass=p, off_vocab_mass=off, logit_pass=float(lp[row]),
                                    logit_fail=float(lf[row]), slot_found=True))
        return out

    # -- internals ------------------------------------------------------------------------------

    def render(self, samples: Sequence[Sample]) -> tuple[list[ScoreItem], dict[int, str]]:
        """Rendered items (prompt + scoring prefix) and {index: error} for the ones that failed."""
        return self._render(samples)

    def _render(self, samples: Sequence[Sample]) -> tuple[list[ScoreItem], dict[int, str]]:
        items, errors = [], {}
        for i, s in enumerate(samples):
            try:
                ji = self.renderer.render(s, with_target=False)
            except Exception as e:   # noqa: BLE001 -- recorded per sample; the rest are scored
                errors[i] = render_error(e)
                continue
            ids = np.concatenate([ji.input_ids, np.asarray(self.prefix_ids, np.int32)]).astype(np.int32)
            if len(ids) > self.buckets[-1]:
                errors[i] = f"too_long: {len(ids)} tokens > the largest bucket {self.buckets[-1]}"
                continue
            items.append(ScoreItem(index=i, rendered=ji, ids=ids))
        return items, errors

    def _prefix_groups(self, items: list[ScoreItem]) -> tuple[list[PrefixGroup], list[ScoreItem]]:
        """Groups of >= 2 samples with one prompt_id, identical images and a common token prefix of
        at least ``min_shared_tokens`` that holds every image token; and the items left alone.

        The prefix is the longest common *token* prefix of the rendered prompts (not the
        conversation text), so whatever the tokenizer merged across the response boundary, each
        member's ids are exactly its own; one token is always left as suffix (the slot's)."""
        by_key: dict[tuple, list[ScoreItem]] = {}
        alone: list[ScoreItem] = []
        image_id = self.model.cfg.image_token_id
        for it in items:
            key = self.prefix_key(it)
            if key is None:
                alone.append(it)
                continue
            by_key.setdefault(key, []).append(it)
        groups = []
        for members in by_key.values():
            if len(members) > 1:
                shortest = min(len(it.ids) for it in members)
                ids_mt = np.stack([it.ids[:shortest] for it in members])
                differs = np.flatnonzero(np.any(ids_mt != ids_mt[0], axis=0))
                n = int(differs[0]) if len(differs) else shortest
                n = min(n, shortest - 1)
                last_image = max((int(np.flatnonzero(it.ids == image_id)[-1]) for it in members
                                  if np.any(it.ids == image_id)), default=-1)
                if n >= self.min_shared_tokens and n > last_image:
                    groups.append(PrefixGroup(items=members, n_shared=n))
                    continue
            alone.extend(members)
        return groups, alone

    def _shared_batches(self, groups: list[PrefixGroup], extra_slots: int, desc: str):
        """Yields (members, prefix cache, rows_b, tokens_bn, n_b): each batch of prefixes is
        prefilled once into a cache with room for the longest suffix (+ ``extra_slots`` for
        decoding), then the members run against their prefix's cache row, batch_size at a time.
        Filler rows repeat row 0 with one suffix token; callers drop them."""
        from tqdm import tqdm
        order = sorted(groups, key=lambda g: g.n_shared)
        with tqdm(total=sum(len(g.items) for g in groups), desc=f"{str(desc)} (shared prefixes)", unit="sample",
                  disable=not self.progress) as bar:
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                inputs = self._collate([(g.items[0].ids[:g.n_shared], g.items[0].rendered) for g in chunk])
                width = self.suffix_width(max(len(g.suffix(it)) for g in chunk for it in g.items))
                # Room for SUFFIX_ROOM suffix tokens at least, so the prefill's shape does not
                # change with the suffix width below it (one compile per bucket and rung).
                room = max(width, SUFFIX_ROOM)
                _, cache = self.decoder.prefill(self.place(inputs), inputs.input_ids_bt.shape[1] + room + extra_slots)
                rows = [(r, g, it) for r, g in enumerate(chunk) for it in g.items]
                for r0 in range(0, len(rows), self.batch_size):
                    part = rows[r0:r0 + self.batch_size]
                    rows_b = np.zeros(self.batch_size, np.int32)
                    tokens_bn = np.full((self.batch_size, width), self.pad_id, np.int32)
                    n_b = np.ones(self.batch_size, np.int32)
                    for k, (r, g, it) in enumerate(part):
                        suffix = g.suffix(it)
                        rows_b[k], tokens_bn[k, :len(suffix)], n_b[k] = r, suffix, len(suffix)
                    yield [it for _, _, it in part], cache, rows_b, tokens_bn, n_b
                    bar.update(len(part))

    def _forced(self, batch: list[ScoreItem], forced_ids):
        """Teacher-forced tokens of a batch as (force_bf, force_len_b), or (None, None)."""
        if forced_ids is None:
            return None, None
        rows = [list(forced_ids[it.index]) for it in batch]
        force_bf = np.full((self.batch_size, max(len(r) for r in rows)), self.pad_id, np.int32)
        force_len_b = np.zeros(self.batch_size, np.int32)
        for r, ids in enumerate(rows):
            force_bf[r, :len(ids)], force_len_b[r] = ids, len(ids)
        return force_bf, force_len_b

    def _result(self, sample_id: str, gen, row: int) -> JudgeResult:
        """One row of a Generation: the decoded text parsed, the slot's P(pass) and verdict."""
        n = int(gen.n_tokens_b[row])
        new_ids = [int(t) for t in gen.tokens_bn[row, :n]]
        finished = bool(new_ids) and new_ids[-1] == self._spec.eos_id
        if finished:
            new_ids = new_ids[:-1]
        text = self.renderer.tokenizer.decode(self.prefix_ids + new_ids, skip_special_tokens=True,
                                              clean_up_tokenization_spaces=False)
        parsed = target_lib.parse_output(text)
        found = bool(gen.slot_found_b[row])
        if found:
            p, off = _probabilities(gen.logit_pass_b[row], gen.logit_fail_b[row], gen.logsumexp_b[row])
            # The token written at the slot: the argmax verdict that was forced, or the
            # teacher-forced one.
            at_slot = int(gen.tokens_bn[row, gen.slot_step_b[row]]) if gen.slot_step_b[row] < n else -1
            verdict = {self.pass_id: "pass", self.fail_id: "fail"}.get(at_slot, parsed.l3)
        else:
            p, off, verdict = math.nan, math.nan, parsed.l3
        return JudgeResult(
            id=sample_id, p_pass=p, verdict=verdict, reason=parsed.reason, issues=tuple(parsed.issues),
            img=parsed.img, parse_ok=parsed.status != "failed", status=parsed.status, off_vocab_mass=off,
            text=text, n_new_tokens=n, finished=finished, slot_found=found, slot_index=int(gen.slot_step_b[row]))

    def _live(self, batch: list[ScoreItem]) -> np.ndarray:
        return np.arange(self.batch_size) < len(batch)

    def _slot_table(self):
        if self._table is None:
            v = self.model.cfg.text.vocab_size
            if self.verdict_first:
                # Decoding starts at the slot; after it the automaton is never consulted again.
                table = np.zeros((self._full_state + 1, v), np.int32)
            else:
                table = slot_automaton(self.renderer.tokenizer, v)
            self._table = jax.numpy.asarray(table)
        return self._table

    def _batches(self, items: list[ScoreItem], desc: str):
        """Sorted by length, padded like the loader; yields (items of the batch, device JudgeInputs)."""
        from tqdm import tqdm
        order = sorted(items, key=lambda it: len(it.ids))
        with tqdm(total=len(items), desc=desc, unit="sample", disable=not self.progress) as bar:
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                yield chunk, self.place(self._collate([(it.ids, it.rendered) for it in chunk]))
                bar.update(len(chunk))

    def _collate(self, prompts: list[tuple[np.ndarray, JudgeInput]]) -> JudgeInputs:
        """(token ids, the rendered sample whose images they hold) -> one padded batch, as the
        training loader pads (``loader.Collate``); filler rows hold one pad token, never empty."""
        cfg = self.model.cfg
        collate = loader_lib.Collate(self.batch_size, self.buckets, self.pad_id, cfg.vision.patch_dim,
                                     ladder=self.ladder)
        b = collate([{"input_ids": ids, "target_mask": np.zeros(len(ids), np.uint8), "verdict_pos": -1,
                      "label": -1, "route_tool_call": 0, "has_image": int(ji.has_image),
                      "pixel_values": ji.pixel_values, "image_grid_thw": ji.image_grid_thw}
                     for ids, ji in prompts])
        mask = b["attention_mask"]
        mask[len(prompts):, 0] = 1
        return prepare_inputs(cfg, b["input_ids"], mask, b["pixel_values"], b["image_grid_thw"],
                              attention="lengths", frame_capacity=self.frame_capacity)

    def place(self, inputs: JudgeInputs) -> JudgeInputs:
        """A host batch on the scorer's devices (rows over the mesh's batch axes)."""
        return self._to_device(inputs)

    def _to_device(self, inputs: JudgeInputs) -> JudgeInputs:
        if self.mesh is None:
            return inputs
        return placement.place_inputs(inputs, self.mesh)
