"""The scalar RM: reward position (right/left padding, pad == eos, multi-turn), and the RM step
sharded over 8 emulated devices == unsharded, accumulation == one big microbatch."""

import jax
import numpy as np
import pytest
from flax import nnx

from rm_jax.model import prepare_inputs
from rm_jax.rm import data as data_lib
from rm_jax.rm.head import init_reward_model, reward_positions
from rm_jax.rm.render import split_turn
from rm_jax.run_config import model_config, parse

EOS = 2


VOCAB = 512


def mini_config(tiny_cfg):
    """The tiny config shrunk further (2 layers, D=32, 4 experts): compiles stay short."""
    import copy
    from configs import rm_tiny
    cfg = copy.deepcopy(tiny_cfg)
    t = cfg.model.text_config
    t.hidden_size, t.num_hidden_layers, t.num_experts = 32, 2, 4
    t.intermediate_size, t.moe_intermediate_size, t.vocab_size = 48, 24, VOCAB
    t.num_attention_heads, t.num_key_value_heads = 2, 1
    cfg.model.vision_config.out_hidden_size = 32
    cfg.model.vision_config.deepstack_visual_indexes = (0,)
    cfg.rm = rm_tiny.get_config().rm
    cfg.train.warmup_steps = 1
    return parse(cfg)


@pytest.fixture(scope="module")
def rm_cfg(tiny_cfg):
    return mini_config(tiny_cfg)


@pytest.fixture(scope="module")
def mcfg(rm_cfg):
    return model_config(rm_cfg)


@pytest.fixture(scope="module")
def rm(mcfg):
    return init_reward_model(mcfg, seed=0)


@nnx.jit
def _jit_rewards(m, inputs, resp_bt):
    return m.rewards(inputs, resp_bt)


def _rewards(rm, ids_bt, mask_bt, resp_bt, jit=True):
    inputs = prepare_inputs(rm.cfg, ids_bt, mask_bt, attention="mask")
    return np.asarray(_jit_rewards(rm, inputs, resp_bt) if jit else rm.rewards(inputs, resp_bt))


def test_reward_positions_from_mask():
    resp = np.zeros((3, 8), np.int32)
    resp[0, 2:5] = 1      # right padded
    resp[1, 5:8] = 1      # left padded: ends at the array end
    resp[2, 3:4] = 1
    assert reward_positions(resp).tolist() == [4, 7, 3]


def test_reward_position_padding_and_pad_eq_eos(rm):
    """Each sequence alone == the same sequence right padded, left padded, padded with eos."""
    rng = np.random.default_rng(0)
    seqs = []
    for n_prompt, n_resp in ((9, 5), (11, 3), (6, 8)):    # one unpadded length (14): one compile
        ids = rng.integers(20, VOCAB, n_prompt + n_resp).astype(np.int32)
        ids[-1] = EOS                       # the end-of-turn token closes the turn
        ids[n_prompt - 3] = EOS             # an earlier turn's end (multi-turn): never the reward position
        seqs.append((ids, n_prompt))
    alone = _rewards(rm, np.stack([ids for ids, _ in seqs]), np.ones((3, 14), np.int32),
                     np.stack([(np.arange(14) >= npr).astype(np.int32) for _, npr in seqs]))
    t = 24
    for side in ("right", "left"):
        for pad_id in (0, EOS):
            ids_bt = np.full((len(seqs), t), pad_id, np.int32)
            mask_bt = np.zeros((len(seqs), t), np.int32)
            resp_bt = np.zeros((len(seqs), t), np.int32)
            for b, (ids, npr) in enumerate(seqs):
                off = 0 if side == "right" else t - len(ids)
                ids_bt[b, off:off + len(ids)] = ids
                mask_bt[b, off:off + len(ids)] = 1
                resp_bt[b, off + npr:off + len(ids)] = 1
            got = _rewards(rm, ids_bt, mask_bt, resp_bt)
            np.testing.assert_allclose(got, alone, rtol=2e-4, atol=2e-5, err_msg=f"{side} pad={pad_id}")
            if side == "right" and pad_id == EOS:
                # what a naive read would take instead: the array end / the last eos in the row
                naive_b = [t - 1] * len(seqs)
                assert reward_positions(resp_bt).tolist() != naive_b
                assert all(ids_bt[b, -1] == EOS for b in range(len(seqs)))


def test_split_turn_multi_turn(renderer):
    """The target turn of a multi-turn chat: its span ends at its own end-of-turn token."""
    tok = renderer.tokenizer
    eos = int(renderer.eos_id)
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "make a red star"},
            {"role": "assistant", "content": "Here it is."}, {"role": "user", "content": "now blue"}]
    p1, r1, ok1 = split_turn(tok, chat, "Done: a blue star.", eos)
    p2, r2, ok2 = split_turn(tok, chat, "No.", eos)
    assert ok1 and ok2 and p1 == p2                       # the shared prefix is token-identical
    assert r1[-1] == eos and eos not in r1[:-1]
    assert sum(t == eos for t in p1) == 4                 # history turns end in the same token
    full = tok.apply_chat_template(chat + [{"role": "assistant", "content": "Done: a blue star."}], tokenize=False)
    assert tok.decode(p1 + r1) == full.rstrip("\n")
    resp = np.zeros((1, len(p1) + len(r1) + 5), np.int32)
    resp[0, len(p1):len(p1) + len(r1)] = 1
    assert int(reward_positions(resp)[0]) == len(p1) + len(r1) - 1


def _batch(mcfg, rows, t, n_micro, seed=0):
    rng = np.random.default_rng(seed)
    micros = []
    for a in range(n_micro):
        lens = rng.integers(t // 2, t + 1, rows)
        ids = np.zeros((rows, t), np.int32)
        mask = np.zeros((rows, t), np.int32)
        resp = np.zeros((rows, t), np.int32)
        for b, n in enumerate(lens):
            ids[b, :n] = rng.integers(20, VOCAB, n)
            ids[b, n - 1] = EOS
            mask[b, :n] = 1
            resp[b, n // 2:n] = 1
        inputs = prepare_inputs(mcfg, ids, mask, attention="lengths")
        # two prompts of 4 candidates per microbatch: 6 pairs each, hard / soft / tie / margins / weights
        pa, pb = [], []
        for g in range(rows // 4):
            for i in range(4):
                for j in range(i + 1, 4):
                    pa.append(4 * g + i)
                    pb.append(4 * g + j)
        n_p = len(pa) + 2
        micros.append({"inputs": inputs, "response_mask": resp,
                       "pair_a": np.asarray(pa + [0, 0], np.int32), "pair_b": np.asarray(pb + [1, 1], np.int32),
                       "pair_p": rng.choice([0.0, 1.0, 0.5, 0.8], n_p).astype(np.float32),
                       "pair_m": rng.choice([0.0, 0.5], n_p).astype(np.float32),
                       "pair_w_raw": rng.uniform(0.5, 2.0, n_p).astype(np.float32),
                       "pair_group": np.asarray([a * 10 + k // 6 for k in range(n_p - 2)] + [-1, -1]),
                       "pair_valid": np.asarray([True] * (n_p - 2) + [False, False])})
    return micros


def _one_step(tiny_cfg, mcfg, mesh, micros):
    from rm_jax.rm import train
    rm = init_reward_model(mcfg, seed=0)
    from rm_jax.model import placement
    placement.place_params(rm, mesh)
    builder = train.make_builder(tiny_cfg, rm, mesh, total_steps=10)
    state = builder.init_state()
    state, metrics = builder.train(state, data_lib.assemble(micros, True))
    return jax.device_get(metrics), jax.device_get(state.params)


def test_rm_step_sharded_equals_unsharded(rm_cfg, mcfg, devices8):
    from rm_jax.sharding import make_mesh
    micros = _batch(mcfg, rows=8, t=32, n_micro=2)
    m1, p1 = _one_step(rm_cfg, mcfg, make_mesh(devices=devices8[:1]), micros)
    m8, p8 = _one_step(rm_cfg, mcfg, make_mesh({"data": 4, "fsdp": 2}, devices=devices8), micros)
    for k in m1:
        np.testing.assert_allclose(m8[k], m1[k], rtol=2e-4, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=2e-6)
    assert m1["pair_loss"] > 0 and np.isfinite(m1["grad_norm"])


@pytest.mark.slow
def test_rm_accumulation_equals_one_microbatch(rm_cfg, mcfg, devices8):
    """Two microbatches of 8 rows == one of 16 with the same pairs (weights over the whole step)."""
    from rm_jax.sharding import make_mesh
    micros = _batch(mcfg, rows=8, t=32, n_micro=2, seed=3)
    a, b = micros
    both = {"inputs": jax.tree.map(lambda x, y: np.concatenate([x, y], axis=-2 if x.ndim == 3 else 0),
                                   a["inputs"], b["inputs"]),
            "response_mask": np.concatenate([a["response_mask"], b["response_mask"]])}
    both.update({k: np.concatenate([a[k], b[k] + 8 if k in ("pair_a", "pair_b") else b[k]])
                 for k in ("pair_a", "pair_b", "pair_p", "pair_m", "pair_w_raw", "pair_group", "pair_valid")})
    mesh = make_mesh(devices=devices8[:1])
    import dataclasses
    # the MoE balance loss is per microbatch, not additive over rows
    cfg = rm_cfg.replace(moe=dataclasses.replace(rm_cfg.moe, lb_coef=0.0))
    m2, p2 = _one_step(cfg, mcfg, mesh, micros)
    m1, p1 = _one_step(cfg, mcfg, mesh, [both])
    for k in ("pair_loss", "center_loss", "pair_accuracy", "margin", "chosen_reward", "grad_norm"):
        np.testing.assert_allclose(m2[k], m1[k], rtol=2e-4, atol=1e-6, err_msg=k)
    for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=2e-4, atol=2e-6)


# -- Qwen3.5 (Gated DeltaNet + gated attention, MoE with a shared expert) as the RM backbone ---------

Q35_LAYERS = ["linear_attention", "full_attention", "linear_attention"]


def qwen35_text_config():
    from rm_jax.model.qwen3_5_moe.config import Qwen35MoeConfig
    hf = dict(model_type="qwen3_5_moe_text", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
              moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=5, num_experts_per_tok=2,
              layer_types=Q35_LAYERS, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                   mrope_section=[2, 1, 1], mrope_interleaved=True))
    return Qwen35MoeConfig.from_hf_dict(hf)


@pytest.fixture(scope="module")
def q35_rm():
    return init_reward_model(qwen35_text_config(), seed=0)


def test_qwen35_reward_position(q35_rm):
    """The reward of a right-padded row (pad == eos, an earlier turn's eos in the prompt) is the head
    on the final-norm hidden state of the row's own end-of-turn token, computed on the sequence
    alone and cut right there: the position is the target turn's last token, and nothing after it
    (padding, through the recurrent Gated DeltaNet layers too) reaches it."""
    rm = q35_rm
    rng = np.random.default_rng(1)
    t = 24
    ids_bt = np.full((3, t), EOS, np.int32)
    mask_bt = np.zeros((3, t), np.int32)
    resp_bt = np.zeros((3, t), np.int32)
    seqs = []
    for b, (n_prompt, n_resp) in enumerate(((9, 5), (11, 3), (6, 12))):
        ids = rng.integers(20, VOCAB, n_prompt + n_resp).astype(np.int32)
        ids[-1] = EOS
        ids[n_prompt - 3] = EOS
        ids_bt[b, :len(ids)], mask_bt[b, :len(ids)], resp_bt[b, n_prompt:len(ids)] = ids, 1, 1
        seqs.append(ids)
    got = _rewards(rm, ids_bt, mask_bt, resp_bt)
    want = []
    for ids in seqs:
        inputs = prepare_inputs(rm.cfg, ids[None], np.ones((1, len(ids)), np.int32), attention="mask")
        h_d = rm.backbone.forward_arrays(inputs, logits=False).final_hidden_btd[0, -1]
        want.append(float(rm.head(h_d[None])[0]))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    assert reward_positions(resp_bt).tolist() == [13, 13, 17]
    # the reward moves with the token at that position, not with the padding after it
    moved = ids_bt.copy()
    moved[0, 13] = 30
    assert abs(_rewards(rm, moved, mask_bt, resp_bt)[0] - got[0]) > 1e-6
    repadded = ids_bt.copy()
    repadded[:, 20:] = 0
    np.testing.assert_allclose(_rewards(rm, repadded, mask_bt, resp_bt), got, rtol=2e-5, atol=2e-6)


@pytest.mark.slow   # a Qwen3.5 training compile: ~1-3 min on 2 shared cores
def test_qwen35_rm_trains(devices8):
    """A tiny Qwen3.5 RM learns a fixed set of hard pairs through the RM step on an 8-device mesh."""
    import dataclasses
    from rm_jax.model import placement
    from rm_jax.rm.step import RMStepBuilder, RMStepConfig
    from rm_jax.rm.loss import PairLossConfig
    from rm_jax.sharding import make_mesh
    from rm_jax.train import optim
    mcfg = qwen35_text_config()
    mesh = make_mesh({"data": 4, "fsdp": 2}, devices=devices8)
    rm = init_reward_model(mcfg, seed=0)
    placement.place_params(rm, mesh)
    ocfg = dataclasses.replace(optim.OptimConfig(), lr=1e-2, warmup_steps=1, total_steps=20)
    builder = RMStepBuilder(rm, optim.make_optimizer(ocfg, nnx.state(rm, nnx.Param)),
                            RMStepConfig(loss=PairLossConfig(True, 0.0)), mesh)
    micros = _batch(mcfg, rows=8, t=32, n_micro=1, seed=5)
    micros[0]["pair_p"][:], micros[0]["pair_m"][:] = 1.0, 0.0      # hard pairs: the loss can go to 0
    batch = data_lib.assemble(micros, True)
    state = builder.init_state()
    losses = []
    for _ in range(12):
        state, metrics = builder.train(state, batch)
        losses.append(float(metrics["pair_loss"]))
    assert builder.trace_count == 1
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses
    assert float(metrics["pair_accuracy"]) == 1.0
