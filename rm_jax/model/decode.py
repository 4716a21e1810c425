"""KV-cache greedy decoding for the judge: one prefill, then static-shape decode steps.

``Decoder(model)`` wraps any ``interface.JudgeModel`` (split once; the jitted functions take the
graph definition as a static argument and the params as arrays, like the train step):

* ``prefill(inputs, cache_len) -> (logits_bv, DecodeState)``: the ordinary ``forward_arrays`` over
  the prompt (images, deepstack, MRoPE positions from ``prepare_inputs``) with ``return_kv=True``
  and no ``[B, T, V]`` head: only each row's last position goes through the LM head.
* ``step(cache, token_b) -> (logits_bv, DecodeState)``: one new token per row.
* ``extend_slot_logits(cache, rows_b, tokens_bn, n_b, ...)`` / ``generate_shared(...)``: several
  new tokens per row continuing a *shared* prefix cache row (a GRPO group's prompt, prefilled
  once): the slot logits after them, or decoding from there.
* ``slot_logits(inputs, pass_id, fail_id)``: the P(pass)-only path (no cache at all).
* ``generate(inputs, spec, ...) -> Generation``: prefill + a ``lax.while_loop`` of decode steps
  in ONE jitted call (no host round trip per token), bounded by ``spec.max_new_tokens`` and
  leaving the loop early once every row has emitted EOS (or read its verdict slot, with
  ``stop_at_slot``).
* ``sample_text(inputs, spec, temperature_b, budget_b, seed) -> TextGeneration``: plain
  free-text generation for the chat endpoint (greedy at temperature 0, else sampling), with each
  chosen token's log-probability and the top-k alternatives, in one jitted call as well.

Design choices:

* **State per layer kind** (``rm_jax.model.decode_state``): attention layers keep a KV cache,
  Gated DeltaNet layers a recurrent state; the model's ``decode_tokens`` runs new tokens against
  it and returns what each kind adds, and this module writes it (``write_one`` / ``write_many``).
  Nothing here knows an architecture.
* **Static shapes, no recompile per token.** The KV cache is ``[attention layers, B, S, kv_heads,
  head_dim]`` with ``S = prompt bucket + max_new_tokens``; every step writes one column per row
  and attends over all ``S`` keys with per-row key lengths. A step therefore has the same shapes whatever the
  step index, so it compiles once per (batch, bucket).
* **Right padding** (the training loader's layout, and the layout ``prepare_inputs(...,
  attention="lengths")`` checks). Row ``b``'s prompt occupies cache slots ``[0, len_b)``; its
  ``i``-th new token is written at ``len_b + i`` and the query attends to keys ``[0, len_b + i]``.
  Padding slots between ``len_b`` and the bucket end hold garbage k/v from the prefill, but each is
  overwritten before the key-length mask first admits it. (Left padding would write every row at
  the same slot, but needs an explicit ``[B, 1, T, T]`` prefill mask, which rules out the
  flash-attention path on GPU, and differs from what the judge was trained on.)
* **MRoPE positions of generated tokens** follow transformers' generation exactly: after the
  prompt, ``get_rope_index`` stores ``rope_deltas = max_prompt_position + 1 - n_prompt_tokens``
  and new text tokens get ``cache_position + rope_deltas`` on all three axes, i.e.
  ``max_prompt_position + 1 + i`` for the ``i``-th new token. With images the maximum position is
  not ``len - 1`` (an image run advances the position by ``max(h, w) / merge``, not by its token
  count), so the cache carries ``next_pos_b`` separately from ``length_b``.
* **The cache follows the scanned layer stacks.** ``forward_arrays`` returns each ``LayerStack``'s
  k/v as scan outputs (leading layer axis) and the decode step scans the same stacks with the
  matching slice of the cache as ``xs``; each layer returns only its new ``[B, 1, K, Hd]`` k/v, and
  the step scatters all of them into the full cache once (in place: the step donates the cache).
  A recurrent state is replaced instead; pad tokens (``valid_bn`` False) leave it unchanged.
* **The verdict slot is found by the decoder, not by searching text afterwards.** A small
  automaton over token *strings* (``slot_automaton``: KMP over the characters of ``"l3": "``,
  precomputed as a ``[states, V]`` table) runs inside the loop; when a row's generated text ends
  exactly at a token boundary with ``"l3": "``, the logits of that step are the slot logits. So
  the slot is always the value of the ``l3`` key -- never the first "pass"/"fail" in a reason --
  and a verdict-first prompt (which ends in that prefix) simply starts the automaton in its final
  state. On a hit the chosen verdict (argmax over pass/fail at the slot) is forced token by token,
  then greedy decoding continues. Rows can also be teacher-forced (``force_bf``) from the start,
  which reads the slot of a given output.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rm_jax.model import decode_state
from rm_jax.model.interface import JudgeModel, StaticGraph
from rm_jax.model.records import DecodeState, JudgeInputs
from rm_jax.sharding import constrain

SLOT_PATTERN = '"l3": "'


@flax.struct.dataclass
class Generation:
    tokens_bn: jax.Array        # generated ids (forced verdict included), pad after EOS / unused
    n_tokens_b: jax.Array       # tokens generated per row (EOS included)
    finished_b: jax.Array       # EOS emitted within the budget
    slot_found_b: jax.Array
    slot_step_b: jax.Array      # index in tokens_bn of the verdict token (-1: not found)
    logit_pass_b: jax.Array     # at the slot (fp32)
    logit_fail_b: jax.Array
    logsumexp_b: jax.Array      # over the full vocabulary at the slot


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Static decoding parameters (hashable: part of the jit cache key)."""
    max_new_tokens: int
    eos_id: int
    pad_id: int
    pass_ids: tuple[int, ...]
    fail_ids: tuple[int, ...]

    @property
    def verdict_width(self) -> int:
        return max(len(self.pass_ids), len(self.fail_ids))


# ---------------------------------------------------------------------------------------------
# The slot automaton (host side, once per tokenizer)
# ---------------------------------------------------------------------------------------------

def _kmp_step(pattern: str, state: int, ch: str) -> int:
    """Longest prefix of ``pattern`` that is a suffix of (matched prefix + ch)."""
    text = pattern[:state] + ch
    for k in range(min(len(pattern), len(text)), 0, -1):
        if text.endswith(pattern[:k]):
            return k
    return 0


def slot_automaton(tokenizer, vocab_size: int, pattern: str = SLOT_PATTERN) -> np.ndarray:
    """``table[state, token]``: the match state after appending ``token``'s text.

    State ``len(pattern)`` means the text so far ends with ``pattern`` exactly at the token
    boundary, i.e. the next token is the slot. Token texts come from decoding each id alone
    (byte-level BPE: exact for ASCII, which the pattern is); ids beyond the tokenizer map to ''."""
    n_tok = min(vocab_size, len(tokenizer))
    texts = tokenizer.batch_decode([[i] for i in range(n_tok)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    n_states = len(pattern) + 1
    chars = set(pattern)
    step = {(s, c): _kmp_step(pattern, s, c) for s in range(n_states) for c in chars}
    table = np.zeros((n_states, vocab_size), np.int32)
    table[:, n_tok:] = np.arange(n_states)[:, None]          # empty text: state unchanged
    for v, text in enumerate(texts):
        if not text:
            table[:, v] = np.arange(n_states)
            continue
        if not chars.intersection(text):
            continue                                          # any foreign char resets to 0
        for s in range(n_states):
            st = s
            for c in text:
                st = step.get((st, c), 0)
            table[s, v] = st
    return table


# ---------------------------------------------------------------------------------------------
# Pure functions (traced inside jit)
# ---------------------------------------------------------------------------------------------

def _head(model: JudgeModel, h_bd: jax.Array) -> jax.Array:
    logits_bv = jnp.einsum("bd,dv->bv", h_bd, model.head_dv().astype(model.dtype)).astype(jnp.float32)
    return constrain(logits_bv, ("batch", "act_vocab"))


def _last_hidden(final_btd: jax.Array, lengths_b: jax.Array) -> jax.Array:
    # Right padding: row b's last prompt token sits at lengths_b - 1 (>= 0: rows are never empty).
    idx_b = jnp.maximum(lengths_b - 1, 0)
    return jnp.take_along_axis(final_btd, idx_b[:, None, None], axis=1)[:, 0]


def _lengths(inputs: JudgeInputs) -> jax.Array:
    if inputs.kv_lengths_b is None:
        raise ValueError("decoding needs right-padded prompts: prepare_inputs(..., attention='lengths')")
    return jnp.asarray(inputs.kv_lengths_b, jnp.int32)


def verdict_logits_at(model: JudgeModel, final_btd: jax.Array, pos_b: jax.Array, pass_id: int,
                      fail_id: int):
    """(logit_pass_b, logit_fail_b, logsumexp_b) from the final hidden state at ``pos_b`` (the
    position whose next token is the verdict): the LM head on B rows, not [B, T, V]."""
    h_bd = jnp.take_along_axis(final_btd, jnp.asarray(pos_b, jnp.int32)[:, None, None], axis=1)[:, 0]
    logits_bv = _head(model, h_bd)
    return logits_bv[:, pass_id], logits_bv[:, fail_id], jax.nn.logsumexp(logits_bv, axis=-1)


def verdict_probabilities(logit_pass, logit_fail, logsumexp) -> tuple[np.ndarray, np.ndarray]:
    """Host side of a slot read: P(pass) = softmax over {pass, fail} and the mass outside them
    (``off_vocab_mass``), elementwise, in float64."""
    lp, lf, lse = (np.asarray(x, np.float64) for x in (logit_pass, logit_fail, logsumexp))
    p_pass = 1.0 / (1.0 + np.exp(np.minimum(lf - lp, 700.0)))
    return p_pass, np.clip(1.0 - np.exp(lp - lse) - np.exp(lf - lse), 0.0, 1.0)


def slot_logits_fn(model: JudgeModel, inputs: JudgeInputs, pass_id: int, fail_id: int):
    """(logit_pass_b, logit_fail_b, logsumexp_b) at each row's last prompt position, no cache."""
    out = model.forward_arrays(inputs, logits=False)
    # Right padding: row b's last prompt token sits at lengths_b - 1 (>= 0: rows are never empty).
    last_b = jnp.maximum(_lengths(inputs) - 1, 0)
    return verdict_logits_at(model, out.final_hidden_btd, last_b, pass_id, fail_id)


def prefill_fn(model: JudgeModel, inputs: JudgeInputs, cache_len: int) -> tuple[jax.Array, DecodeState]:
    """Prompt forward that fills a ``cache_len``-slot state; returns last-position logits [B, V]."""
    lengths_b = _lengths(inputs)
    out = model.forward_arrays(inputs, logits=False, return_kv=True)
    logits_bv = _head(model, _last_hidden(out.final_hidden_btd, lengths_b))
    mask_bt = jnp.asarray(inputs.attention_mask_bt) > 0
    pos_3bt = jnp.asarray(inputs.positions_3bt)
    next_pos_b = jnp.max(jnp.where(mask_bt[None], pos_3bt, -1), axis=(0, 2)) + 1
    return logits_bv, decode_state.from_prefill(out, cache_len, lengths_b, next_pos_b)


def step_fn(model: JudgeModel, cache: DecodeState, token_b: jax.Array) -> tuple[jax.Array, DecodeState]:
    """Append one token per row; logits [B, V] of the new position."""
    x_b1d, new = model.decode_tokens(cache, token_b[:, None])
    logits_bv = _head(model, model.final_norm(x_b1d)[:, 0])
    return logits_bv, decode_state.write_one(cache, new)


def _valid(tokens_bn: jax.Array, n_b: jax.Array) -> jax.Array:
    """[B, N] True at each row's own tokens (the first ``n_b``), False at its right padding."""
    return jnp.arange(tokens_bn.shape[1], dtype=jnp.int32)[None, :] < jnp.asarray(n_b)[:, None]


def extend_slot_logits_fn(model: JudgeModel, cache: DecodeState, rows_b: jax.Array, tokens_bn: jax.Array,
                          n_b: jax.Array, pass_id: int, fail_id: int):
    """Shared-prefix P(pass): slot logits of prompts that continue cached prefixes.

    Row ``b`` continues cache row ``rows_b[b]`` (a prefix prefilled once for all the samples that
    share it, e.g. a GRPO group's responses to one prompt) with its own ``n_b[b]`` suffix tokens
    (right-padded in ``tokens_bn``), which end at its verdict slot. Returns (logit_pass_b,
    logit_fail_b, logsumexp_b) there, as ``slot_logits_fn`` does for the whole prompt."""
    cache = decode_state.take_rows(cache, rows_b)
    x_bnd, _ = model.decode_tokens(cache, tokens_bn, _valid(tokens_bn, n_b))
    logits_bv = _head(model, model.final_norm(_last_hidden(x_bnd, n_b)))
    return logits_bv[:, pass_id], logits_bv[:, fail_id], jax.nn.logsumexp(logits_bv, axis=-1)


@flax.struct.dataclass
class _Loop:
    step: jax.Array
    tokens_bn: jax.Array
    n_b: jax.Array
    done_b: jax.Array
    match_b: jax.Array
    force_bf: jax.Array
    force_pos_b: jax.Array
    force_len_b: jax.Array
    slot_b: jax.Array
    slot_step_b: jax.Array
    lp_b: jax.Array
    lf_b: jax.Array
    lse_b: jax.Array


def _check_slot(g: _Loop, logits_bv: jax.Array, spec: DecodeSpec, full_state: int) -> _Loop:
    """Record the slot logits of rows whose text now ends with the pattern; force their verdict."""
    hit_b = (g.match_b == full_state) & ~g.slot_b & ~g.done_b
    lp_b, lf_b = logits_bv[:, spec.pass_ids[0]], logits_bv[:, spec.fail_ids[0]]
    lse_b = jax.nn.logsumexp(logits_bv, axis=-1)
    width = g.force_bf.shape[1]
    pad = lambda ids: jnp.asarray(list(ids) + [spec.pad_id] * (width - len(ids)), jnp.int32)
    choose_pass_b = lp_b >= lf_b
    verdict_bf = jnp.where(choose_pass_b[:, None], pad(spec.pass_ids)[None], pad(spec.fail_ids)[None])
    verdict_len_b = jnp.where(choose_pass_b, len(spec.pass_ids), len(spec.fail_ids))
    # A teacher-forced row keeps its own tokens: its slot is read, its verdict is not replaced.
    inject_b = hit_b & (g.force_pos_b >= g.force_len_b)
    return g.replace(
        slot_b=g.slot_b | hit_b, slot_step_b=jnp.where(hit_b, g.n_b, g.slot_step_b),
        lp_b=jnp.where(hit_b, lp_b, g.lp_b), lf_b=jnp.where(hit_b, lf_b, g.lf_b),
        lse_b=jnp.where(hit_b, lse_b, g.lse_b),
        force_bf=jnp.where(inject_b[:, None], verdict_bf, g.force_bf),
        force_pos_b=jnp.where(inject_b, 0, g.force_pos_b),
        force_len_b=jnp.where(inject_b, verdict_len_b, g.force_len_b))


def generate_fn(model: JudgeModel, inputs: JudgeInputs, table_sv: jax.Array, match0_b: jax.Array,
                force_bf: jax.Array, force_len_b: jax.Array, live_b: jax.Array, stop_at_slot: jax.Array,
                spec: DecodeSpec) -> Generation:
    """Prefill, then greedy decoding with slot detection and forcing, in one traced function.
    ``stop_at_slot`` (a traced bool, so P(pass)-only and full decoding share one compile) ends
    the loop once every live row has its slot."""
    logits_bv, cache = prefill_fn(model, inputs, inputs.input_ids_bt.shape[1] + spec.max_new_tokens)
    return _decode_loop(model, logits_bv, cache, table_sv, match0_b, force_bf, force_len_b, live_b, stop_at_slot,
                        spec)


def generate_shared_fn(model: JudgeModel, cache: DecodeState, rows_b: jax.Array, tokens_bn: jax.Array,
                       n_b: jax.Array, table_sv: jax.Array, match0_b: jax.Array, force_bf: jax.Array,
                       force_len_b: jax.Array, live_b: jax.Array, spec: DecodeSpec) -> Generation:
    """``generate_fn`` for prompts that continue cached prefixes (see ``extend_slot_logits_fn``):
    each row's suffix is run against its prefix row and written into a copy of that row, then
    decoding proceeds exactly as after a full prefill. The cache needs ``N + max_new_tokens``
    free slots per row."""
    cache = decode_state.take_rows(cache, rows_b)
    x_bnd, new = model.decode_tokens(cache, tokens_bn, _valid(tokens_bn, n_b))
    cache = decode_state.write_many(cache, new, n_b)
    logits_bv = _head(model, model.final_norm(_last_hidden(x_bnd, n_b)))
    return _decode_loop(model, logits_bv, cache, table_sv, match0_b, force_bf, force_len_b, live_b,
                        jnp.asarray(False), spec)


def _decode_loop(model: JudgeModel, logits_bv: jax.Array, cache: DecodeState, table_sv: jax.Array,
                 match0_b: jax.Array, force_bf: jax.Array, force_len_b: jax.Array, live_b: jax.Array,
                 stop_at_slot: jax.Array, spec: DecodeSpec) -> Generation:
    """Greedy decoding from the logits of each row's last prompt position and its cache."""
    b = logits_bv.shape[0]
    n = spec.max_new_tokens
    full_state = table_sv.shape[0] - 1
    f32 = jnp.zeros((b,), jnp.float32)
    g = _Loop(step=jnp.zeros((), jnp.int32), tokens_bn=jnp.full((b, n), spec.pad_id, jnp.int32),
              n_b=jnp.zeros((b,), jnp.int32), done_b=~live_b.astype(bool), match_b=match0_b.astype(jnp.int32),
              force_bf=force_bf.astype(jnp.int32), force_pos_b=jnp.zeros((b,), jnp.int32),
              force_len_b=force_len_b.astype(jnp.int32), slot_b=jnp.zeros((b,), bool),
              slot_step_b=jnp.full((b,), -1, jnp.int32), lp_b=f32, lf_b=f32, lse_b=f32)
    g = _check_slot(g, logits_bv, spec, full_state)

    def active(g):
        return ~g.done_b & ~(g.slot_b & stop_at_slot)

    def cond(carry):
        g, _, _ = carry
        return (g.step < n) & jnp.any(active(g))

    def body(carry):
        g, logits_bv, cache = carry
        forcing_b = g.force_pos_b < g.force_len_b
        forced_b = jnp.take_along_axis(g.force_bf, jnp.minimum(g.force_pos_b, g.force_bf.shape[1] - 1)[:, None],
                                       axis=1)[:, 0]
        tok_b = jnp.where(forcing_b, forced_b, jnp.argmax(logits_bv, axis=-1).astype(jnp.int32))
        tok_b = jnp.where(g.done_b, spec.pad_id, tok_b)
        g = g.replace(
            step=g.step + 1,
            tokens_bn=jax.lax.dynamic_update_slice_in_dim(g.tokens_bn, tok_b[:, None], g.step, axis=1),
            n_b=g.n_b + (~g.done_b).astype(jnp.int32),
            match_b=jnp.where(g.done_b, g.match_b, table_sv[g.match_b, tok_b]),
            force_pos_b=g.force_pos_b + (forcing_b & ~g.done_b).astype(jnp.int32),
            done_b=g.done_b | (tok_b == spec.eos_id))
        logits_bv, cache = step_fn(model, cache, tok_b)
        return _check_slot(g, logits_bv, spec, full_state), logits_bv, cache

    g, _, _ = jax.lax.while_loop(cond, body, (g, logits_bv, cache))
    finished_b = jnp.any(g.tokens_bn == spec.eos_id, axis=1)
    return Generation(tokens_bn=g.tokens_bn, n_tokens_b=g.n_b, finished_b=finished_b, slot_found_b=g.slot_b,
                      slot_step_b=g.slot_step_b, logit_pass_b=g.lp_b, logit_fail_b=g.lf_b, logsumexp_b=g.lse_b)


@dataclasses.dataclass(frozen=True)
class TextSpec:
    """Static parameters of free-text generation (part of the jit cache key: keep few values)."""
    max_new_tokens: int               # the static budget; rows stop earlier at their own budget_b
    stop_ids: tuple[int, ...]         # EOS-like tokens (end of turn, end of text)
    pad_id: int
    top_k: int = 20                   # alternatives recorded per step (OpenAI allows up to 20)


@flax.struct.dataclass
class TextGeneration:
    tokens_bn: jax.Array              # generated ids (stop token included), pad after
    n_tokens_b: jax.Array             # tokens generated per row (stop token included)
    finished_b: jax.Array             # a stop token was emitted within the row's budget
    logprob_bn: jax.Array             # log P(chosen token) under the model (temperature 1)
    top_ids_bnk: jax.Array            # the top_k most likely tokens at each step
    top_logprob_bnk: jax.Array


def sample_text_fn(model: JudgeModel, inputs: JudgeInputs, temperature_b: jax.Array, budget_b: jax.Array,
                   live_b: jax.Array, key: jax.Array, spec: TextSpec) -> TextGeneration:
    """Prefill, then one token per step: argmax where ``temperature_b == 0``, else a sample of
    softmax(logits / T). Log-probabilities are the model's own distribution (T = 1), as OpenAI-
    compatible servers report them, so they do not change with the sampling temperature."""
    logits_bv, cache = prefill_fn(model, inputs, inputs.input_ids_bt.shape[1] + spec.max_new_tokens)
    b, n, k = logits_bv.shape[0], spec.max_new_tokens, spec.top_k
    stop_s = jnp.asarray(spec.stop_ids, jnp.int32)
    temp_b = jnp.asarray(temperature_b, jnp.float32)
    budget_b = jnp.minimum(jnp.asarray(budget_b, jnp.int32), n)
    init = dict(step=jnp.zeros((), jnp.int32), tokens_bn=jnp.full((b, n), spec.pad_id, jnp.int32),
                n_b=jnp.zeros((b,), jnp.int32), done_b=~jnp.asarray(live_b, bool) | (budget_b <= 0),
                finished_b=jnp.zeros((b,), bool), logprob_bn=jnp.zeros((b, n), jnp.float32),
                top_ids_bnk=jnp.zeros((b, n, k), jnp.int32), top_logprob_bnk=jnp.zeros((b, n, k), jnp.float32),
                key=key)

    def cond(carry):
        g, _, _ = carry
        return (g["step"] < n) & jnp.any(~g["done_b"])

    def body(carry):
        g, logits_bv, cache = carry
        logp_bv = jax.nn.log_softmax(logits_bv.astype(jnp.float32), axis=-1)
        key, sub = jax.random.split(g["key"])
        sampled_b = jax.random.categorical(sub, logits_bv / jnp.maximum(temp_b, 1e-6)[:, None], axis=-1)
        tok_b = jnp.where(temp_b > 0, sampled_b, jnp.argmax(logits_bv, axis=-1)).astype(jnp.int32)
        tok_b = jnp.where(g["done_b"], spec.pad_id, tok_b)
        top_lp_bk, top_ids_bk = jax.lax.top_k(logp_bv, k)
        chosen_b = jnp.take_along_axis(logp_bv, tok_b[:, None], axis=1)[:, 0]
        at = lambda buf, val: jax.lax.dynamic_update_slice_in_dim(buf, val[:, None], g["step"], axis=1)
        is_stop_b = jnp.any(tok_b[:, None] == stop_s[None], axis=1) & ~g["done_b"]
        n_b = g["n_b"] + (~g["done_b"]).astype(jnp.int32)
        g = dict(step=g["step"] + 1, tokens_bn=at(g["tokens_bn"], tok_b), n_b=n_b,
                 done_b=g["done_b"] | is_stop_b | (n_b >= budget_b), finished_b=g["finished_b"] | is_stop_b,
                 logprob_bn=at(g["logprob_bn"], chosen_b), top_ids_bnk=at(g["top_ids_bnk"], top_ids_bk),
                 top_logprob_bnk=at(g["top_logprob_bnk"], top_lp_bk), key=key)
        logits_bv, cache = step_fn(model, cache, tok_b)
        return g, logits_bv, cache

    g, _, _ = jax.lax.while_loop(cond, body, (init, logits_bv, cache))
    return TextGeneration(tokens_bn=g["tokens_bn"], n_tokens_b=g["n_b"], finished_b=g["finished_b"],
                          logprob_bn=g["logprob_bn"], top_ids_bnk=g["top_ids_bnk"],
                          top_logprob_bnk=g["top_logprob_bnk"])


# ---------------------------------------------------------------------------------------------
# Jitted entry points
# ---------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=(0, 11))
def _jit_generate_shared(graph: StaticGraph, state, cache, rows_b, tokens_bn, n_b, table_sv, match0_b, force_bf,
                         force_len_b, live_b, spec):
    return generate_shared_fn(graph.merge(state), cache, rows_b, tokens_bn, n_b, table_sv, match0_b,
                              force_bf, force_len_b, live_b, spec)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _jit_slot_logits(graph: StaticGraph, state, inputs, pass_id, fail_id):
    return slot_logits_fn(graph.merge(state), inputs, pass_id, fail_id)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _jit_prefill(graph: StaticGraph, state, inputs, cache_len):
    return prefill_fn(graph.merge(state), inputs, cache_len)


@functools.partial(jax.jit, static_argnums=(0, 6, 7))
def _jit_extend_slot_logits(graph: StaticGraph, state, cache, rows_b, tokens_bn, n_b, pass_id, fail_id):
    return extend_slot_logits_fn(graph.merge(state), cache, rows_b, tokens_bn, n_b, pass_id, fail_id)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _jit_step(graph: StaticGraph, state, cache, token_b):
    return step_fn(graph.merge(state), cache, token_b)


@functools.partial(jax.jit, static_argnums=(0, 9))
def _jit_generate(graph: StaticGraph, state, inputs, table_sv, match0_b, force_bf, force_len_b, live_b, stop_at_slot,
                  spec):
    return generate_fn(graph.merge(state), inputs, table_sv, match0_b, force_bf, force_len_b, live_b,
                       stop_at_slot, spec)


@functools.partial(jax.jit, static_argnums=(0, 7))
def _jit_sample_text(graph: StaticGraph, state, inputs, temperature_b, budget_b, live_b, key, spec):
    return sample_text_fn(graph.merge(state), inputs, temperature_b, budget_b, live_b, key, spec)


class Decoder:
    """The judge split once, with jitted prefill / step / generate (run under the model's mesh)."""

    def __init__(self, model: JudgeModel, mesh=None):
        graphdef, self.state = nnx.split(model)
        self.graph = StaticGraph.of(graphdef)
        self.cfg = model.cfg
        self.mesh = mesh if mesh is not None else getattr(model, "mesh", None)

    def _run(self, fn, *args):
        if self.mesh is None:
            return fn(self.graph, self.state, *args)
        with jax.set_mesh(self.mesh):
            return fn(self.graph, self.state, *args)

    def slot_logits(self, inputs: JudgeInputs, pass_id: int, fail_id: int):
        return self._run(lambda gd, st, x: _jit_slot_logits(gd, st, x, int(pass_id), int(fail_id)), inputs)

    def prefill(self, inputs: JudgeInputs, cache_len: int) -> tuple[jax.Array, DecodeState]:
        return self._run(lambda gd, st, x: _jit_prefill(gd, st, x, int(cache_len)), inputs)

    def extend_slot_logits(self, cache: DecodeState, rows_b, tokens_bn, n_b, pass_id: int, fail_id: int):
        """Slot logits after each row's suffix, continuing cache row ``rows_b`` (not donated: one
        prefix cache serves several suffix batches). The cache needs ``n`` free slots per row."""
        args = tuple(np.asarray(a, np.int32) for a in (rows_b, tokens_bn, n_b))
        return self._run(lambda gd, st, c, *a: _jit_extend_slot_logits(gd, st, c, *a, int(pass_id), int(fail_id)),
                         cache, *args)

    def step(self, cache: DecodeState, token_b) -> tuple[jax.Array, DecodeState]:
        """One decode step. The cache is donated: use the returned one."""
        return self._run(_jit_step, cache, jnp.asarray(token_b, jnp.int32))

    def generate(self, inputs: JudgeInputs, spec: DecodeSpec, table_sv, match0_b, force_bf=None,
                 force_len_b=None, live_b=None, stop_at_slot: bool = False) -> Generation:
        """Greedy decoding. ``match0_b``: initial automaton state per row (``len(pattern)`` when the
        prompt ends in the slot prefix). ``force_bf``/``force_len_b``: teacher-forced tokens.
        ``live_b``: False for filler rows of a padded batch (done from the start, so they never
        keep the loop running). ``stop_at_slot``: leave the loop once every live row has read its
        slot (P(pass) only)."""
        b = np.asarray(inputs.input_ids_bt).shape[0]
        force_bf, force_len_b, live_b = self._loop_args(b, spec, force_bf, force_len_b, live_b)
        args = (inputs, table_sv, np.asarray(match0_b, np.int32), force_bf, force_len_b, live_b,
                np.asarray(stop_at_slot, bool))
        return self._run(lambda gd, st, *a: _jit_generate(gd, st, *a, spec), *args)

    def generate_shared(self, cache: DecodeState, rows_b, tokens_bn, n_b, spec: DecodeSpec, table_sv, match0_b,
                        force_bf=None, force_len_b=None, live_b=None) -> Generation:
        """``generate`` for suffixes continuing prefix cache rows ``rows_b`` (``Decoder.prefill``
        with ``cache_len >= prefix bucket + suffix width + max_new_tokens``)."""
        b = len(rows_b)
        force_bf, force_len_b, live_b = self._loop_args(b, spec, force_bf, force_len_b, live_b)
        args = tuple(np.asarray(a, np.int32) for a in (rows_b, tokens_bn, n_b)) + (
            table_sv, np.asarray(match0_b, np.int32), force_bf, force_len_b, live_b)
        return self._run(lambda gd, st, c, *a: _jit_generate_shared(gd, st, c, *a, spec), cache, *args)

    def sample_text(self, inputs: JudgeInputs, spec: TextSpec, temperature_b, budget_b, seed: int = 0,
                    live_b=None) -> TextGeneration:
        """Free-text generation (chat): per-row temperature (0 = greedy) and token budget."""
        b = np.asarray(inputs.input_ids_bt).shape[0]
        live_b = np.ones((b,), bool) if live_b is None else np.asarray(live_b, bool)
        args = (inputs, np.asarray(temperature_b, np.float32), np.asarray(budget_b, np.int32), live_b,
                jax.random.key(int(seed)))
        return self._run(lambda gd, st, *a: _jit_sample_text(gd, st, *a, spec), *args)

    @staticmethod
    def _loop_args(b: int, spec: DecodeSpec, force_bf, force_len_b, live_b):
        if force_bf is None:
            force_bf = np.full((b, 0), spec.pad_id, np.int32)
            force_len_b = np.zeros((b,), np.int32)
        force_bf = np.asarray(force_bf, np.int32)
        # One static width (the token budget) whether or not rows are teacher-forced: one compile.
        width = max(spec.max_new_tokens, spec.verdict_width)
        if force_bf.shape[1] > width:
            raise ValueError(f"{force_bf.shape[1]} forced tokens exceed max_new_tokens={spec.max_new_tokens}")
        force_bf = np.pad(force_bf, ((0, 0), (0, width - force_bf.shape[1])), constant_values=spec.pad_id)
        live_b = np.ones((b,), bool) if live_b is None else np.asarray(live_b, bool)
        return force_bf, np.asarray(force_len_b, np.int32), live_b
