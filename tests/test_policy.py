"""The policy SFT stage: its examples, its loss, its export into a judge's init, and its cache."""

import functools
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from rm_jax.data import schema
from rm_jax.data.policy import NOT_PASSING, PolicyRenderer
from rm_jax.run_config import adopt_init_config, model_config, parse
from rm_jax.sharding import make_mesh
from rm_jax.train import loop
from run_flags import OVERRIDES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def policy_renderer(tiny_cfg, synth_dir):
    return PolicyRenderer.from_config(tiny_cfg.data, os.path.join(synth_dir, "tokenizer"))


def _samples(synth_dir):
    path = os.path.join(synth_dir, "samples.jsonl")
    with open(path, "rb") as f:
        return [schema.parse_line(line, line=i + 1, base_dir=synth_dir) for i, line in enumerate(f)]


def _hermes(sample) -> str:
    """The response in the policy's output format, written independently of the chat template."""
    resp = sample.response
    blocks = [resp.content] if resp.content else []
    blocks += ["<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
               + "\n</tool_call>" for c in resp.tool_calls]
    return "\n".join(blocks) + "<|im_end|>"


def test_policy_target_is_the_response_only_and_failures_are_rejected(policy_renderer, synth_dir):
    samples = _samples(synth_dir)
    tok = policy_renderer.tokenizer
    kinds = set()
    for s in samples:
        if s.label.l3 == "fail":
            with pytest.raises(schema.SampleError) as e:
                policy_renderer.render(s)
            assert e.value.reason == NOT_PASSING
            continue
        ex = policy_renderer.render(s)
        on = np.flatnonzero(ex.target_mask)
        assert on.size and on[-1] == ex.length - 1 and np.all(np.diff(on) == 1)   # one span at the end
        assert tok.decode(ex.input_ids[on].tolist(), skip_special_tokens=False) == _hermes(s)
        prompt = tok.decode(ex.input_ids[:on[0]].tolist(), skip_special_tokens=False)
        assert prompt.endswith("<|im_start|>assistant\n") and ex.verdict_pos == -1
        kinds.add(bool(s.response.tool_calls))
    assert kinds == {True, False}


def test_policy_loss_covers_response_tokens_only_against_numpy(policy_renderer, synth_dir):
    from rm_jax.train.loss import LossConfig, target_cross_entropy
    exs = [policy_renderer.render(s) for s in _samples(synth_dir)[:12] if s.label.l3 == "pass"][:3]
    t = max(e.length for e in exs)
    ids = np.zeros((len(exs), t), np.int32)
    mask = np.zeros((len(exs), t), np.float32)
    for i, e in enumerate(exs):
        ids[i, :e.length], mask[i, :e.length] = e.input_ids, e.target_mask
    rng = np.random.default_rng(0)
    d, v = 16, int(ids.max()) + 7
    h = rng.standard_normal((len(exs), t, d)).astype(np.float32)
    w = rng.standard_normal((d, v)).astype(np.float32)
    got = target_cross_entropy(jnp.asarray(h), jnp.asarray(w), jnp.asarray(ids), jnp.asarray(mask),
                               LossConfig(max_target_tokens=192, vocab_chunk=32))
    logits = h @ w
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    want, n = 0.0, 0
    for i, e in enumerate(exs):
        for tt in np.flatnonzero(e.target_mask):      # token tt is predicted from position tt - 1
            want -= logp[i, tt - 1, ids[i, tt]]
            n += 1
    assert float(got.n_tokens) == n
    np.testing.assert_allclose(float(got.loss_sum), want, rtol=1e-5)


@pytest.mark.slow   # trains and compiles a model: ~1 min on a quiet host
def test_policy_export_then_init_from_is_bit_identical(tiny_cfg, synth_dir, tmp_path):
    """The stage's path: train the policy (launch.train's loop), export it with launch.convert's
    orbax_to_hf, start a judge run from it with train.init_from: the judge's initial parameters
    are the policy's trained ones, bit for bit."""
    from flax import nnx

    from rm_jax.data.policy import build_policy_shards
    from rm_jax.score.checkpoints import load_judge
    cfg = tiny_cfg.copy_and_resolve_references()
    build_policy_shards(os.path.join(synth_dir, "samples.jsonl"), str(tmp_path / "shards"), parse(cfg),
                        os.path.join(synth_dir, "tokenizer"))
    cfg.data.dir = str(tmp_path / "shards")
    cfg.data.oversample_fail = 1
    cfg.train.update({**OVERRIDES, "steps": 2, "checkpoint_every": 2, "eval_every": 0, "verdict_weight": 1.0,
                      "max_target_tokens": 192})
    cfg.model.text_config.num_hidden_layers = 2
    cfg.model.vision_config.depth = 1
    cfg.model.vision_config.deepstack_visual_indexes = (0,)
    loop.run(parse(cfg), str(tmp_path / "policy"), progress=False)
    # The CLI a user runs (and launch.policy_sft runs): its own process, its own flags.
    subprocess.run([sys.executable, "-m", "launch.convert", "--to_hf", f"--ckpt={tmp_path / 'policy'}",
                    f"--out={tmp_path / 'hf'}"], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    trained, _, _ = load_judge(str(tmp_path / "policy"))

    judge_cfg = tiny_cfg.copy_and_resolve_references()
    judge_cfg.train.init_from = str(tmp_path / "hf")
    judge_cfg = adopt_init_config(parse(judge_cfg))
    mesh = make_mesh(judge_cfg.mesh, num_experts=model_config(judge_cfg).text.num_experts, global_batch=8)
    started, _ = loop.build_model(judge_cfg, mesh)
    ours, theirs = (dict(nnx.to_flat_state(nnx.state(m, nnx.Param))) for m in (started, trained))
    assert ours.keys() == theirs.keys()
    for p in ours:
        a, b = np.asarray(ours[p][...]), np.asarray(theirs[p][...])
        assert a.dtype == b.dtype and np.array_equal(a, b), p


@pytest.fixture
def policy_sft_module():
    """launch.policy_sft imported into this worker's global absl flags, and taken out again after:
    its --input/--out/... would clash with another launch module (launch.convert) imported
    in-process by a test that runs later, or earlier, on the same xdist worker."""
    import importlib

    from absl import flags
    names = ("input", "out", "tokenizer", "steps", "force")
    saved = {n: flags.FLAGS[n] for n in names if n in flags.FLAGS}
    for n in saved:
        delattr(flags.FLAGS, n)
    sys.modules.pop("launch.policy_sft", None)
    try:
        yield importlib.import_module("launch.policy_sft")
    finally:
        flags.FLAGS.unparse_flags()
        for n in names:
            if n in flags.FLAGS:
                delattr(flags.FLAGS, n)
        for n, flag in saved.items():
            flags.FLAGS[n] = flag
        sys.modules.pop("launch.policy_sft", None)


def test_policy_stage_cache_reused_when_unchanged_and_rebuilt_when_inputs_change(tmp_path, monkeypatch,
                                                                                  policy_sft_module):
    """launch.policy_sft skips every stage when the cache key matches, runs them when it does not."""
    from absl import flags

    policy_sft = policy_sft_module
    from rm_jax.data import policy as policy_lib
    data = tmp_path / "data"
    (data / "tokenizer").mkdir(parents=True)
    (data / "tokenizer" / "tokenizer.json").write_text("{}")
    (data / "samples.jsonl").write_text('{"id": "a"}\n')
    out = tmp_path / "policy"
    calls = []

    def fake_build(input_path, out_dir, cfg, tok_dir, **_):
        calls.append("build")
        return {"read": 1, "kept": 1, "rejected_by_reason": {}, "splits": {}}

    def fake_run(stage, args, timings, key):
        calls.append(f"launch.{stage}")
        if stage == "convert":
            (out / "hf").mkdir(parents=True, exist_ok=True)
            (out / "hf" / "config.json").write_text("{}")

    monkeypatch.setattr(policy_lib, "build_policy_shards", fake_build)
    monkeypatch.setattr(policy_sft, "run_stage", fake_run)     # the stages are other tests' subject

    def stage(*extra):
        argv = ["policy_sft", f"--input={data}/samples.jsonl", f"--out={out}", "--steps=5", *extra]
        monkeypatch.setattr(sys, "argv", argv)
        flags.FLAGS.unparse_flags()
        flags.FLAGS(argv)
        before = len(calls)
        policy_sft.main(argv)
        return calls[before:]

    rebuilt = ["build", "launch.train", "launch.convert"]
    assert stage() == rebuilt
    assert stage() == []                                              # same inputs: reused
    assert stage("--steps=6") == rebuilt                              # another step count
    assert stage("--steps=6") == []
    (data / "samples.jsonl").write_text('{"id": "b"}\n')              # new data
    assert stage("--steps=6") == rebuilt
    (data / "tokenizer" / "tokenizer.json").write_text('{"v": 2}')   # new tokenizer
    assert stage("--steps=6") == rebuilt
    assert stage("--steps=6", "--force") == rebuilt
    # The user's --config.* overrides are part of the key too.
    key = functools.partial(policy_sft.cache_key, str(data / "samples.jsonl"), str(data / "tokenizer"),
                            policy_sft.DEFAULT_CONFIG, steps=6)
    assert key([]) != key(["--config.train.lr=0.001"]) and key([]) == key([])
    flags.FLAGS.unparse_flags()
