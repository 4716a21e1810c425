"""KV-cache decoding == full re-forward, token by token, fp32.

A random tiny judge (deepstack layers alone, one dense layer, a scanned run of two MoE layers),
a batch of three right-padded prompts of different lengths (two with images of different
non-square grids, one text-only), greedy decoding. At every step the cached logits must equal the
last-position logits of a full forward over prompt + tokens generated so far: that pins the cache
writes, the per-row key lengths, and the MRoPE positions of generated tokens (max prompt
position + 1 + step, which is not len + step once an image is in the prompt).
"""

import os

import jax
import numpy as np
import pytest
from transformers import AutoTokenizer

from rm_jax.model import ModelConfig, RuntimeOptions, init_model, prepare_inputs
from rm_jax.model.decode import SLOT_PATTERN, DecodeSpec, Decoder, slot_automaton
from rm_jax.serve.warmup import CompileCounter

VSTART, VEND, IMAGE = 3, 4, 5
T, STEPS = 72, 6
# One spec for every test: generate compiles once per spec (EOS 1 is never greedy-picked here).
SPEC = DecodeSpec(max_new_tokens=STEPS, eos_id=1, pad_id=0, pass_ids=(7,), fail_ids=(8, 10))


def small_cfg() -> ModelConfig:
    from configs.tiny import hf_model_config
    d = hf_model_config().to_dict()
    d["text_config"].update(vocab_size=320, num_hidden_layers=5, mlp_only_layers=[2])
    d["vision_config"].update(num_position_embeddings=16)
    return ModelConfig.from_hf_dict(d, RuntimeOptions())


def prompts(cfg):
    """Row 0: one 8x12-patch image, 50 tokens; row 1: 12x8 + 8x8 images, 68 tokens; row 2: text, 37."""
    rng = np.random.default_rng(0)
    lengths, images = (50, 68, 37), ([(1, 8, 12)], [(1, 12, 8), (1, 8, 8)], [])
    ids = np.zeros((3, T), np.int32)
    mask = np.zeros((3, T), np.int32)
    grids = []
    for row, (n, row_imgs) in enumerate(zip(lengths, images)):
        ids[row, :n] = rng.integers(20, cfg.text.vocab_size, n)
        at = 6
        for g in row_imgs:
            k = g[1] * g[2] // 4
            ids[row, at - 1], ids[row, at:at + k], ids[row, at + k] = VSTART, IMAGE, VEND
            at += k + 4
            grids.append(g)
        mask[row, :n] = 1
    grids = np.array(grids)
    pixels = rng.standard_normal((int(np.prod(grids, -1).sum()), cfg.vision.patch_dim)).astype(np.float32)
    return ids, mask, pixels, grids, np.array(lengths)


@pytest.fixture(scope="module")
def setup():
    cfg = small_cfg()
    model = init_model(cfg, seed=1)
    return model, cfg, Decoder(model), prompts(cfg)


def test_cached_steps_equal_full_forward(setup):
    model, cfg, dec, (ids, mask, pixels, grids, lengths) = setup
    inputs = prepare_inputs(cfg, ids, mask, pixels, grids, attention="lengths")
    logits, cache = dec.prefill(inputs, T + STEPS)
    assert cache.k_lbskh.shape == (5, 3, T + STEPS, cfg.text.num_key_value_heads, cfg.text.head_dim)
    # Image rows: the next position is the max prompt position + 1, less than the length.
    assert int(cache.next_pos_b[0]) < lengths[0] and int(cache.next_pos_b[2]) == lengths[2]

    full_ids = np.zeros((3, T + STEPS), np.int32)
    full_ids[:, :T] = ids
    full_mask = np.zeros_like(full_ids)
    full_mask[:, :T] = mask
    generated = []
    for step in range(STEPS + 1):
        ref = np.asarray(model(full_ids, full_mask, pixels, grids))   # one shape: compiles once
        ref_last = ref[np.arange(3), lengths + step - 1]
        got = np.asarray(logits)
        scale = max(1.0, float(np.abs(ref_last).max()))
        np.testing.assert_allclose(got, ref_last, rtol=0, atol=2e-5 * scale, err_msg=f"step {step}")
        if step == STEPS:
            break
        tok = got.argmax(-1).astype(np.int32)
        generated.append(tok)
        full_ids[np.arange(3), lengths + step] = tok
        full_mask[np.arange(3), lengths + step] = 1
        logits, cache = dec.step(cache, tok)
    np.testing.assert_array_equal(np.asarray(cache.length_b), lengths + STEPS)

    # The whole-loop generate (prefill + while_loop in one jit) produces the same greedy tokens.
    table = np.zeros((len(SLOT_PATTERN) + 1, cfg.text.vocab_size), np.int32)
    gen = dec.generate(inputs, SPEC, table, np.zeros(3, np.int32))
    assert SPEC.eos_id not in np.stack(generated).tolist()
    np.testing.assert_array_equal(np.asarray(gen.tokens_bn), np.stack(generated, 1))
    assert np.asarray(gen.n_tokens_b).tolist() == [STEPS] * 3
    assert not np.asarray(gen.slot_found_b).any()


def test_step_compiles_once(setup):
    model, cfg, dec, (ids, mask, pixels, grids, _) = setup
    inputs = prepare_inputs(cfg, ids, mask, pixels, grids, attention="lengths")
    _, cache = dec.prefill(inputs, T + STEPS)
    counter = CompileCounter.install()
    before = counter.compiles + counter.cache_hits
    for i in range(3):
        _, cache = dec.step(cache, np.full(3, 20 + i, np.int32))
    assert counter.compiles + counter.cache_hits - before <= 1


def test_eos_stops_rows_and_forcing(setup):
    """A row that emits EOS stops (pad afterwards); forced tokens are fed verbatim."""
    model, cfg, dec, (ids, mask, pixels, grids, _) = setup
    inputs = prepare_inputs(cfg, ids, mask, pixels, grids, attention="lengths")
    eos, spec = SPEC.eos_id, SPEC
    table = np.zeros((len(SLOT_PATTERN) + 1, cfg.text.vocab_size), np.int32)
    force = np.array([[11, eos, 0], [12, 13, 14], [0, 0, 0]], np.int32)
    gen = dec.generate(inputs, spec, table, np.zeros(3, np.int32), force, np.array([2, 3, 0]))
    toks = np.asarray(gen.tokens_bn)
    assert toks[0].tolist() == [11, eos, 0, 0, 0, 0] and int(gen.n_tokens_b[0]) == 2 and bool(gen.finished_b[0])
    assert toks[1, :3].tolist() == [12, 13, 14] and int(gen.n_tokens_b[1]) == STEPS


def test_slot_automaton_matches_the_slot_text_over_token_texts(synth_dir):
    """``table[state, token]`` on a real byte-level BPE tokenizer: the KMP match state of
    '"l3": "' after the token's text, whether a token is one character or several."""
    tok = AutoTokenizer.from_pretrained(os.path.join(synth_dir, "tokenizer"))
    table = slot_automaton(tok, len(tok) + 2)

    def one(text: str) -> int:
        (token,) = tok(text, add_special_tokens=False)["input_ids"]
        return token
    quote, x, colon_quote = one('"'), one("x"), one('": "')
    full = len(SLOT_PATTERN)
    assert table[full - 1, quote] == full          # '"l3": ' + '"' completes
    assert table[full, quote] == 1                 # a second '"' restarts at the one-quote prefix
    assert table[3, x] == 0
    assert table[1, quote] == 1
    assert table[3, colon_quote] == full           # '"l3' + '": "' completes in one token
    state = 0
    for token in tok('{"l3": "', add_special_tokens=False)["input_ids"]:
        state = table[state, token]
    assert state == full
    # ids past the tokenizer (padded vocabulary) have no text: the state is kept
    np.testing.assert_array_equal(table[:, len(tok):], np.repeat(np.arange(full + 1)[:, None], 2, 1))


def test_slot_automaton_hit_forces_verdict_and_stops(setup):
    """Token 30 "completes" the slot text (table column set to the final state): the logits after
    it are the slot logits, the verdict is forced next, and stop_at_slot ends the loop there."""
    model, cfg, dec, (ids, mask, pixels, grids, lengths) = setup
    inputs = prepare_inputs(cfg, ids, mask, pixels, grids, attention="lengths")
    full = len(SLOT_PATTERN)
    table = np.zeros((full + 1, cfg.text.vocab_size), np.int32)
    table[:, 30] = full
    spec = SPEC
    force = np.array([[21, 30], [30, 0], [22, 23]], np.int32)
    args = (inputs, spec, table, np.zeros(3, np.int32), force, np.array([2, 1, 2]))
    gen = jax.device_get(dec.generate(*args))
    assert gen.slot_found_b.tolist() == [True, True, False]
    assert gen.slot_step_b.tolist() == [2, 1, -1]
    for row in (0, 1):
        s = int(gen.slot_step_b[row])
        verdict = [7] if gen.logit_pass_b[row] >= gen.logit_fail_b[row] else [8, 10]
        assert gen.tokens_bn[row, s:s + len(verdict)].tolist() == verdict
    # The slot logits are the step logits after feeding the forced prefix (row 1: one step).
    _, cache = dec.prefill(inputs, T + STEPS)
    logits, _ = dec.step(cache, np.array([21, 30, 22], np.int32))
    np.testing.assert_allclose(gen.logit_pass_b[1], np.asarray(logits)[1, 7], rtol=0, atol=1e-5)
    stopped = jax.device_get(dec.generate(*args, live_b=np.array([True, True, False]), stop_at_slot=True))
    # The loop ends once every live row has its slot (row 0, step 2); row 1 went on meanwhile.
    assert stopped.n_tokens_b.tolist() == [2, 2, 0] and stopped.slot_found_b.tolist() == [True, True, False]
