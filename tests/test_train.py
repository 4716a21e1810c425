"""Trainer: one trace per run, sharded == single-device, kill -9 + resume == uninterrupted,
a damaged checkpoint falls back, the oversampled stream is visible in the metrics."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from rm_jax.data import loader as loader_lib
from rm_jax.run_config import model_config
from rm_jax.sharding import make_mesh
from rm_jax.train import loop, optim
from rm_jax.train.data_plan import BatchStream, RunPlan, loader_config
from rm_jax.train.evaluate import VerdictSlot, evaluate
from rm_jax.train.host_batch import assemble, frame_capacity
from rm_jax.train.metrics_log import read_metrics
from rm_jax.train.step import StepBuilder, StepConfig, host_batch_to_device
from rm_jax.train.loss import LossConfig
from run_flags import OVERRIDES, TIMING, override_flags, train_cfg
from step_probe import objective_and_logits

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_cfg = train_cfg


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_run_traces_once_and_logs(tiny_cfg, built_shards, tmp_path):
    cfg = _cfg(tiny_cfg, built_shards[0], steps=2, checkpoint_every=2, eval_every=0)
    result = loop.run(cfg, str(tmp_path), progress=False)
    assert result["trace_count"] == 1 and result["steps"] == 2 and result["checkpoints"] == [2]
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("loss", "lb_loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "fail_share",
                "expert_imbalance"):
        assert all(np.isfinite(r[key]) for r in rows), key
    manifest = json.load(open(tmp_path / "manifest.json"))
    assert manifest["devices"]["count"] == 8 and manifest["mesh"]["data"] == 8
    assert len(manifest["data_manifest_sha256"]) == 64 and manifest["packages"]["jax"]


def _two_steps(cfg, mesh_shape, backend, devices):
    """Two train steps of ``cfg`` on a mesh: (metrics 1, metrics 2, params) on the host."""
    cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, backend=backend))
    mesh = make_mesh(mesh_shape, devices=devices, num_experts=8, global_batch=8)
    plan = RunPlan(total_steps=2, micro_batch=8, accumulation=1, steps_per_epoch=10.0)
    model, mcfg = loop.build_model(cfg, mesh)
    # Adam's first update is g / (|g| + eps): with eps=1e-8 a near-zero gradient (a rarely seen
    # token's embedding row) becomes a +-lr step whose sign is summation-order noise.
    ocfg = optim.OptimConfig(lr=1e-3, warmup_steps=1, total_steps=2, eps=1e-4)
    builder = StepBuilder(model, optim.make_optimizer(ocfg, model),
                          StepConfig(LossConfig(96, 512), lb_coef=0.01),
                          mesh, optim.schedule(ocfg))
    state = builder.init_state()
    stream = BatchStream(cfg.data.dir, "train", loader_config(cfg, plan, split="train"), 1)
    host = assemble(mcfg, stream.next(), frame_capacity(cfg, mcfg), cfg.train.verdict_weight)
    batch = host_batch_to_device(host.batch, builder.batch_shardings(host.batch))
    with jax.set_mesh(mesh):
        fn = builder.jit_train(state, batch)
        state, m1 = fn(state, builder.rest, batch)
        state, m2 = fn(state, builder.rest, batch)
    return jax.device_get(m1), jax.device_get(m2), jax.device_get(state.params)


def _assert_same_steps(ref, got, keys=("loss", "lb_loss", "grad_norm")):
    (a1, a2, pa), (b1, b2, pb) = ref, got
    for k in keys:
        np.testing.assert_allclose(b1[k], a1[k], rtol=2e-5)
        np.testing.assert_allclose(b2[k], a2[k], rtol=2e-5)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        # 5% of one lr-sized (1e-3) update; the losses and gradient norms above are held to 2e-5.
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=5e-5)


def test_sharded_step_equals_single_device(tiny_cfg, built_shards):
    """The same step (the verdict token weighted) on (data=2, expert=4) with ring EP and on one device."""
    single = _two_steps(_cfg(tiny_cfg, built_shards[0]), dict(data=1), "ragged", jax.devices()[:1])
    _assert_same_steps(single, _two_steps(_cfg(tiny_cfg, built_shards[0]), dict(data=2, expert=4), "ep_ring",
                                          jax.devices()))


def _qwen35_cfg(tiny_cfg, shards):
    """The tiny run config with a Qwen3.5-MoE model section (GDN + gated attention + shared expert)
    that reads the tiny tokenizer's shards: its vocabulary and image token ids."""
    tiny = tiny_cfg.model.to_dict()
    text = dict(vocab_size=tiny["text_config"]["vocab_size"], hidden_size=32, num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_conv_kernel_dim=4, moe_intermediate_size=16,
                shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6,
                max_position_embeddings=4096, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                     mrope_section=[1, 1, 0], mrope_interleaved=True))
    vision = {k: tiny["vision_config"][k] for k in ("hidden_size", "intermediate_size", "num_heads", "in_channels",
                                                    "patch_size", "spatial_merge_size", "temporal_patch_size",
                                                    "num_position_embeddings")}
    return _cfg(tiny_cfg, shards, model=dict(
        model_type="qwen3_5_moe", tie_word_embeddings=False, text_config=text,
        vision_config=dict(vision, depth=1, out_hidden_size=32),
        **{k: tiny[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}))


@pytest.mark.slow   # three compiles of the hybrid step (~2-4 min on 2 cores): `make test-slow`
def test_qwen3_5_sharded_steps_equal_single_device(tiny_cfg, built_shards):
    """Qwen3.5-MoE (one GDN and one gated-attention layer, shared expert, images): two steps on
    (fsdp=8) with the ragged experts and on (data=2, expert=4) with ring EP equal one device's."""
    single = _two_steps(_qwen35_cfg(tiny_cfg, built_shards[0]), dict(data=1), "ragged", jax.devices()[:1])
    assert np.isfinite(single[0]["loss"]) and single[1]["grad_norm"] > 0
    for mesh_shape, backend in [(dict(fsdp=8), "ragged"), (dict(data=2, expert=4), "ep_ring")]:
        _assert_same_steps(single, _two_steps(_qwen35_cfg(tiny_cfg, built_shards[0]), mesh_shape, backend,
                                              jax.devices()))


# 8 steps: the kill lands after checkpoint 2 with steps to spare even on a loaded host
KILL_RUN = dict(OVERRIDES, global_batch=4, steps=8, checkpoint_every=2, eval_every=2)


def _train_cmd(workdir, shards):
    flags = override_flags(KILL_RUN)
    return [sys.executable, "-m", "launch.train", f"--config={REPO}/configs/tiny.py", f"--workdir={workdir}",
            f"--config.data.dir={shards}", *flags]


def _env(cache_dir):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)       # one CPU device in the subprocesses: same numerics for all runs
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)   # compile once for the four runs
    return env


def test_kill9_resume_and_damaged_fallback(built_shards, tmp_path):
    shards = built_shards[0]
    ref, crash = tmp_path / "ref", tmp_path / "crash"
    env = _env(tmp_path / "jax_cache")
    subprocess.run(_train_cmd(ref, shards), check=True, cwd=REPO, env=env, capture_output=True)
    reference = _strip(read_metrics(str(ref)))
    assert [r["step"] for r in reference] == list(range(1, 9))
    assert all("val_loss" in r for r in reference if r["step"] % 2 == 0)

    proc = subprocess.Popen(_train_cmd(crash, shards), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (crash / "checkpoints" / "2").is_dir():
        assert proc.poll() is None, "run finished before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(r["step"] for r in read_metrics(str(crash)))
    assert killed_at < 8, "the kill came too late to test a resume"
    subprocess.run(_train_cmd(crash, shards), check=True, cwd=REPO, env=env, capture_output=True)
    assert _strip(read_metrics(str(crash))) == reference

    # damage the newest checkpoint: the run falls back to the previous one and says so
    for root, _, files in os.walk(crash / "checkpoints" / "8" / "state"):
        for f in files:
            if os.path.getsize(os.path.join(root, f)) > 0:
                with open(os.path.join(root, f), "wb") as fh:
                    fh.write(b"garbage")
    out = subprocess.run(_train_cmd(crash, shards), check=True, cwd=REPO, env=env, capture_output=True, text=True)
    assert "damaged" in out.stderr and "falling back" in out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["resumed_from"] == 6 and summary["skipped_damaged"] == [8]
    assert os.listdir(str(crash / "checkpoints_damaged"))
    assert _strip(read_metrics(str(crash))) == reference


@pytest.mark.parametrize("factor", [3, 1])
def test_oversampling_visible_in_training_stream(tiny_cfg, built_shards, factor):
    # built with the config's x3: data.oversample_fail=1 at train time must still give the label share
    cfg = _cfg(tiny_cfg, built_shards[0], data=dict(oversample_fail=factor))
    plan = RunPlan(total_steps=1, micro_batch=8, accumulation=1, steps_per_epoch=1.0)
    stream = BatchStream(cfg.data.dir, "train", loader_config(cfg, plan, split="train"), 1)
    labels = loader_lib.records.load_index(cfg.data.dir, "train")["label"]
    epoch = len(labels) + (factor - 1) * int(labels.sum())
    seen = fails = 0
    while seen < epoch - epoch % 8:
        b = stream.next()[0]
        seen += int(b["example_valid"].sum())
        fails += int(b["label"][b["example_valid"] == 1].sum())
    # whole batches of the first epoch: the stream's fail share is factor x the data's, within one batch
    expected = factor * labels.sum() / epoch
    assert abs(fails / seen - expected) <= 8 / seen


@pytest.mark.slow   # ~50 s: a memory option (expert_grad_dtype), not a contract; `make test-slow`
def test_expert_grads_in_compute_dtype(tiny_cfg, built_shards):
    """expert_grad_dtype=bf16 is exact: the gradient through the model's own cast to bf16 is
    already bf16-valued, so only its storage shrinks. Same loss and gradients bit for bit, an fp32
    accumulator; a dtype other than the compute dtype is refused."""
    cfg = _cfg(tiny_cfg, built_shards[0], dtype="bfloat16", global_batch=4)
    mesh = make_mesh(dict(data=1), devices=jax.devices()[:1], num_experts=8, global_batch=2)
    plan = RunPlan(total_steps=1, micro_batch=2, accumulation=2, steps_per_epoch=10.0)
    model, mcfg = loop.build_model(cfg, mesh)
    stream = BatchStream(cfg.data.dir, "train", loader_config(cfg, plan, split="train"), 2)
    host = assemble(mcfg, stream.next(), frame_capacity(cfg, mcfg))
    ocfg = optim.OptimConfig(lr=1e-3, warmup_steps=1, total_steps=2)
    out = {}
    for grad_dt, accum_dt in (("", ""), ("bfloat16", ""), ("bfloat16", "bfloat16")):
        builder = StepBuilder(model, optim.make_optimizer(ocfg, model), StepConfig(LossConfig(96, 512),
                              expert_grad_dtype=grad_dt, expert_accum_dtype=accum_dt), mesh)
        with jax.set_mesh(mesh):
            grads, metrics = jax.jit(lambda p, r, b: builder.accumulate(p, r, b, with_grad=True))(
                nnx.state(model, nnx.Param), builder.rest, host.batch)
        out[(grad_dt, accum_dt)] = jax.device_get((jax.tree.leaves(grads), metrics, builder.expert_leaf))
    (g32, m32, is_expert), (g16, m16, _) = out[("", "")], out[("bfloat16", "")]
    assert m16["loss"] == m32["loss"]
    assert sum(is_expert) == 3 * 2          # gate, up, down of the 2 sparse layers
    for a, b in zip(g32, g16):
        assert b.dtype == a.dtype == np.float32            # the accumulator stays fp32
        np.testing.assert_array_equal(b, a)
    # A bf16 expert accumulator (the 30B plan's memory saver) rounds the sum of 2 microbatches:
    # expert gradients agree to bf16 precision, everything else bit for bit; the optimizer still
    # gets the master dtype.
    g_acc, m_acc, _ = out[("bfloat16", "bfloat16")]
    assert m_acc["loss"] == m32["loss"]
    for a, b, expert in zip(g32, g_acc, is_expert):
        assert b.dtype == a.dtype == np.float32
        if expert:
            np.testing.assert_allclose(b, a, rtol=0, atol=2 ** -7 * float(np.abs(a).max()))
            assert not np.array_equal(b, a)     # the accumulator really was bf16
        else:
            np.testing.assert_array_equal(b, a)
    cfg32 = _cfg(tiny_cfg, built_shards[0])
    model32, _ = loop.build_model(cfg32, mesh)
    with pytest.raises(ValueError, match="compute dtype"):
        StepBuilder(model32, optim.make_optimizer(ocfg, model32), StepConfig(expert_grad_dtype="bfloat16"), mesh)


def test_bf16_second_moment_tracks_fp32_adam():
    """nu_dtype=bf16 (the 30B plan's memory saver) keeps optax's state structure, stores nu in
    bf16, and follows fp32 AdamW closely over many steps; a b2 whose EMA step would vanish in
    bf16 rounding is refused."""
    import optax
    rng = np.random.default_rng(0)
    params = {"w": jax.numpy.asarray(rng.standard_normal((16, 24)), jax.numpy.float32),
              "b": jax.numpy.zeros((24,), jax.numpy.float32)}
    runs = {}
    for nu in ("", "bfloat16"):
        cfg = optim.OptimConfig(lr=1e-2, warmup_steps=5, total_steps=200, weight_decay=0.01, nu_dtype=nu)
        tx = optim.make_optimizer(cfg, params)
        state, p = tx.init(params), params
        update = jax.jit(tx.update)
        rng = np.random.default_rng(1)           # the same gradient stream for both runs
        for i in range(200):
            # gradients spanning four decades, so nu's relative rounding is exercised everywhere
            g = jax.tree.map(lambda x: jax.numpy.asarray(
                rng.standard_normal(x.shape) * 10.0 ** rng.integers(-3, 1, x.shape), x.dtype), p)
            u, state = update(g, state, p)
            p = optax.apply_updates(p, u)
        runs[nu] = (p, state)
    (p32, s32), (p16, s16) = runs[""], runs["bfloat16"]
    assert jax.tree.structure(s32) == jax.tree.structure(s16)
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(s16[1][0].nu))
    for a, b in zip(jax.tree.leaves(p32), jax.tree.leaves(p16)):
        moved = np.abs(np.asarray(a) - np.asarray(params["w"] if a.shape == (16, 24) else params["b"])).max()
        # measured: 0.21% (w) and 0.22% (b) of the largest movement; docs/operations.md quotes it
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=0.003 * moved)
    with pytest.raises(ValueError, match="b2"):
        optim.make_optimizer(optim.OptimConfig(b2=0.999, nu_dtype="bfloat16"), params)


def test_resume_refuses_checkpoints_trained_on_other_data(tmp_path):
    """A workdir's checkpoints resume only on the shards they were trained on."""
    import json
    from rm_jax.train.run_manifest import check_resume_data
    from rm_jax.utils import file_sha256
    data = tmp_path / "shards"
    data.mkdir()
    (data / "manifest.json").write_text('{"examples": 10}')
    work = tmp_path / "run"
    work.mkdir()
    check_resume_data(str(work), str(data))                         # no manifest yet: a fresh run
    (work / "manifest.json").write_text(json.dumps({"data_manifest_sha256": file_sha256(str(data / "manifest.json"))}))
    check_resume_data(str(work), str(data))                         # same shards: resumes
    (data / "manifest.json").write_text('{"examples": 11}')        # rebuilt
    with pytest.raises(ValueError, match="trained on other data"):
        check_resume_data(str(work), str(data))


def test_metrics_log_survives_a_torn_last_line(tmp_path):
    """SIGKILL mid-write leaves a partial last line: resume truncates past it instead of failing;
    an unparsable line anywhere else is corruption and is reported."""
    from rm_jax.train.metrics_log import MetricsWriter
    rows = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    assert read_metrics(str(tmp_path)) == rows
    MetricsWriter(str(tmp_path), resume_step=2, tensorboard=False).close()
    assert read_metrics(str(tmp_path)) == rows[:2]
    path.write_text(json.dumps(rows[0]) + "\n{bad\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_metrics(str(tmp_path))


def test_init_from_hf_of_other_sizes_with_frozen_vision_then_scored(tiny_cfg, built_shards, tmp_path):
    """A run started from an HF checkpoint takes that checkpoint's architecture: the manifest
    records it, so the scorer rebuilds the model that was trained. freeze_vision keeps the
    tower's weights exactly while the rest trains."""
    from flax import nnx
    from hf_reference import build_hf, parity_hf_config

    from rm_jax.model import load_hf
    from rm_jax.score.checkpoints import load_judge
    hf_cfg = parity_hf_config(vocab_size=4096, num_hidden_layers=2, mlp_only_layers=[])
    hf_cfg["vision_config"].update(depth=1, deepstack_visual_indexes=[0], patch_size=8, num_position_embeddings=64)
    build_hf(hf_cfg, tmp_path / "hf")
    cfg = _cfg(tiny_cfg, built_shards[0], steps=2, checkpoint_every=2, eval_every=0,
               init_from=str(tmp_path / "hf"), freeze_vision=True)
    loop.run(cfg, str(tmp_path / "run"), progress=False)
    manifest = json.load(open(tmp_path / "run" / "manifest.json"))
    assert manifest["config"]["model"]["text_config"]["hidden_size"] == 48        # tiny's is 64
    trained, _, step = load_judge(str(tmp_path / "run"))
    assert step == 2
    source, _ = load_hf(tmp_path / "hf")
    ours, theirs = (dict(nnx.to_flat_state(nnx.state(m, nnx.Param))) for m in (trained, source))
    assert ours.keys() == theirs.keys()
    same = {p: np.array_equal(np.asarray(ours[p][...]), np.asarray(theirs[p][...])) for p in ours}
    assert all(same[p] for p in same if p[0] == "vision")
    assert not all(same[p] for p in same if p[0] != "vision")


def test_token_ids_beyond_the_model_vocab_are_refused(tiny_cfg, built_shards):
    import dataclasses
    cfg = _cfg(tiny_cfg, built_shards[0])
    mcfg = model_config(cfg)
    small = dataclasses.replace(mcfg, text=dataclasses.replace(mcfg.text, vocab_size=16))
    stream = BatchStream(cfg.data.dir, "train", loader_config(cfg, RunPlan(2, 8, 1, 1.0), split="train"), 1)
    with pytest.raises(ValueError, match="vocab_size 16"):
        assemble(small, stream.next(), frame_capacity(cfg, mcfg))


def test_every_checkpoint_damaged_starts_over_with_them_set_aside(tmp_path):
    import jax.numpy as jnp
    from rm_jax.train.checkpoint import CheckpointOptions, Checkpointer, abstract_like
    state = {"w": jnp.arange(4.0)}
    opts = CheckpointOptions(every=1, async_save=False)
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), opts)
    for step in (1, 2):
        ckpt.save(step, state, {"step": step})
    ckpt.close()
    for step in (1, 2):
        for root, _, files in os.walk(tmp_path / "checkpoints" / str(step) / "state"):
            for f in files:
                with open(os.path.join(root, f), "wb") as fh:
                    fh.write(b"garbage")
    again = Checkpointer(str(tmp_path / "checkpoints"), opts)
    assert again.restore(abstract_like(state)) is None
    assert again.steps() == [] and len(os.listdir(tmp_path / "checkpoints_damaged")) == 2
    again.save(1, state, {"step": 1})           # the fresh run can write those steps again
    again.close()


@pytest.mark.slow   # one more compile of the objective: suite time
def test_objective_is_the_weighted_target_nll_plus_the_aux_losses(tiny_cfg, built_shards):
    """The objective one microbatch contributes is the verdict-weighted target NLL (from the model's
    own logits, over the step's target weight) plus the load-balancing term; ``loss`` is that NLL."""
    cfg = _cfg(tiny_cfg, built_shards[0])
    assert cfg.train.verdict_weight != 1.0        # the weighting is exercised
    mesh = make_mesh(dict(data=1), devices=jax.devices()[:1], num_experts=8, global_batch=4)
    plan = RunPlan(total_steps=1, micro_batch=4, accumulation=1, steps_per_epoch=10.0)
    model, mcfg = loop.build_model(cfg, mesh)
    stream = BatchStream(cfg.data.dir, "train", loader_config(cfg, plan, split="train"), 1)
    host = assemble(mcfg, stream.next(), frame_capacity(cfg, mcfg), cfg.train.verdict_weight)
    builder = StepBuilder(model, optim.make_optimizer(optim.OptimConfig(lr=1e-3, warmup_steps=1, total_steps=2),
                                                      model), loop.step_config(cfg), mesh)
    one = jax.tree.map(lambda x: x[0], host.batch)
    assert (one.target_mask == cfg.train.verdict_weight).sum() == host.n_examples
    objective, sums, logits = objective_and_logits(builder, model, mesh, one, np.float32(one.target_mask.sum()))
    logp = jax.nn.log_softmax(logits, axis=-1)
    ids = np.asarray(one.inputs.input_ids_bt)
    tb, tt = np.nonzero(one.target_mask)
    ref_target = -(np.asarray(logp)[tb, tt - 1, ids[tb, tt]] * one.target_mask[tb, tt]).sum() / one.target_mask.sum()
    np.testing.assert_allclose(sums.ce_sum / sums.n_tokens, ref_target, rtol=1e-5)
    np.testing.assert_allclose(objective, ref_target + cfg.moe.lb_coef * sums.lb, rtol=1e-5)


@pytest.mark.slow   # validation cadence and its metrics stay in the default suite: suite time
def test_validation_reads_the_scorers_p_pass_at_the_verdict_slot(tiny_cfg, synth_dir, renderer, built_shards):
    """Held-out validation reads P(pass) from its own teacher-forced forward at verdict_pos - 1.
    Causal attention makes that the scorer's prompt + '{"l3": "' prefill: equal to 1e-5 on the
    same samples. evaluate() then logs the judge metrics beside val_loss, which is unchanged."""
    from rm_jax.data.records import encode, decode
    from rm_jax.data.schema import Sample, read_samples
    from rm_jax.score.scorer import Scorer

    cfg = _cfg(tiny_cfg, built_shards[0])
    mesh = make_mesh(dict(data=1), devices=jax.devices()[:1], num_experts=8, global_batch=4)
    model, mcfg = loop.build_model(cfg, mesh)
    builder = StepBuilder(model, optim.make_optimizer(optim.OptimConfig(lr=1e-3, total_steps=1), model),
                          StepConfig(LossConfig(96, 512)), mesh, None)
    state = builder.init_state()

    got = [s for s in read_samples(os.path.join(synth_dir, "samples.jsonl")) if isinstance(s, Sample)]
    rendered = [(s, renderer.render(s)) for s in got]
    picked = [(s, ji) for s, ji in rendered if len(ji.input_ids) <= 512]
    picked = [x for x in picked if x[1].has_image][:3] + [x for x in picked if not x[1].has_image][:1]
    assert {s.label.l3 for s, _ in picked} >= {"pass"} and len(picked) == 4
    items = [decode(encode(ji, np.float32)) for _, ji in picked]      # exactly what a shard holds
    b = loader_lib.Collate(4, tuple(cfg.data.buckets), renderer.tokenizer.pad_token_id or 0,
                           mcfg.vision.patch_dim)(items)
    batch = assemble(mcfg, [b], frame_capacity(cfg, mcfg)).batch
    dev = host_batch_to_device(batch, builder.batch_shardings(batch))
    v = renderer.verdict
    for row, (s, _) in enumerate(picked):     # the slot's next token is the teacher's verdict
        assert b["input_ids"][row, b["verdict_pos"][row]] == (v.pass_id if s.label.l3 == "pass" else v.fail_id)
    with jax.set_mesh(mesh):
        m = jax.device_get(builder.jit_eval_verdict()(state.params, builder.rest, dev,
                                                       np.maximum(b["verdict_pos"] - 1, 0), v.pass_id, v.fail_id))
        plain = jax.device_get(builder.jit_eval()(state.params, builder.rest, dev))
    p_eval = 1.0 / (1.0 + np.exp(m["logit_fail"] - m["logit_pass"]))
    scored = Scorer(model, renderer, buckets=tuple(cfg.data.buckets), batch_size=4, progress=False,
                    share_prefix=False).p_pass([s for s, _ in picked])
    np.testing.assert_allclose(p_eval, [x.p_pass for x in scored], atol=1e-5)
    np.testing.assert_allclose(m["loss_sum"] / m["target_tokens"], plain["loss"], rtol=1e-5)

    plan = RunPlan(total_steps=1, micro_batch=4, accumulation=1, steps_per_epoch=1.0)
    slot = VerdictSlot.from_manifest(loader_lib.read_manifest(cfg.data.dir))
    assert slot == VerdictSlot(v.pass_id, v.fail_id)
    with_judge = evaluate(builder, cfg, mcfg, state, plan, mesh, slot)
    loss_only = evaluate(builder, cfg, mcfg, state, plan, mesh, None)
    assert set(loss_only) == {"val_loss"}
    np.testing.assert_allclose(with_judge["val_loss"], loss_only["val_loss"], rtol=1e-5)
    for key in ("val_auc", "val_middle_zone", "val_fail_f1", "val_accuracy", "val_majority_baseline",
                "val_off_vocab_mass"):
        assert key in with_judge, key
    assert 0.0 <= with_judge["val_middle_zone"] <= 1.0
    assert VerdictSlot.from_manifest({"verdict_tokens": {"pass_id": 1, "fail_id": 2},
                                           "field_order": ["reason", "issues", "img", "l3"]}) is None


def test_validation_and_nonfinite_check_run_on_their_own_cadence(tiny_cfg, built_shards, tmp_path):
    """eval_every is independent of log_every: a validation step that is not a logging step
    still validates and writes its row (the non-finite check there: the next test)."""
    cfg = _cfg(tiny_cfg, built_shards[0], steps=5, log_every=4, eval_every=3, checkpoint_every=0)
    loop.run(cfg, str(tmp_path / "cadence"), progress=False)
    rows = read_metrics(str(tmp_path / "cadence"))
    assert [r["step"] for r in rows] == [3, 4, 5]            # 3: validation, 4: log, 5: last
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 5]
    assert all(np.isfinite(r["loss"]) for r in rows)


@pytest.mark.slow   # a second training compile (~30-60 s); `make test-slow`
def test_nonfinite_loss_check_runs_at_validation_steps(tiny_cfg, built_shards, tmp_path):
    """The non-finite-loss check runs at a validation step that is not a logging step."""
    # A run diverging after step 2 (lr 1e30 once the one-step warmup is over) that logs only at
    # its last step (5): the step-3 validation stops it.
    cfg = _cfg(tiny_cfg, built_shards[0], steps=5, log_every=0, eval_every=3, checkpoint_every=0, lr=1e30,
               warmup_steps=1)
    with pytest.raises(FloatingPointError, match=r"step 3: training loss is (nan|inf)"):
        loop.run(cfg, str(tmp_path / "nan"), progress=False)


def _merge_micro(micro: list[dict]) -> dict:
    """Loader batches -> one batch of all their rows (images concatenated, padded at the end),
    what the collate would give for one large batch."""
    out = {k: np.concatenate([b[k] for b in micro]) for k in micro[0] if k not in ("pixel_values", "image_grid_thw",
                                                                                   "image_valid")}
    rows = [int(b["image_grid_thw"].prod(-1).sum()) for b in micro]
    imgs = [int((b["image_grid_thw"].prod(-1) > 0).sum()) for b in micro]
    pix = np.zeros((sum(b["pixel_values"].shape[0] for b in micro), micro[0]["pixel_values"].shape[1]),
                   micro[0]["pixel_values"].dtype)
    pix[:sum(rows)] = np.concatenate([b["pixel_values"][:n] for b, n in zip(micro, rows)])
    grid = np.zeros((sum(b["image_grid_thw"].shape[0] for b in micro), 3), np.int32)
    grid[:sum(imgs)] = np.concatenate([b["image_grid_thw"][:n] for b, n in zip(micro, imgs)])
    out.update(pixel_values=pix, image_grid_thw=grid, image_valid=(grid.prod(-1) > 0).astype(np.int32))
    return out


def test_grad_accumulation_equals_one_large_batch(tiny_cfg, built_shards):
    """4 microbatches of 4 = one batch of 16 (fp32): the loss (each microbatch's token sum over
    the step's global token count), the gradient norm and the AdamW update. The load-balancing term
    is off: it is a per-microbatch statistic averaged over microbatches, not a big-batch one."""
    cfg = _cfg(tiny_cfg, built_shards[0], global_batch=16, grad_accum=4)
    mesh = make_mesh(dict(data=1), devices=jax.devices()[:1], num_experts=8, global_batch=4)
    plan = RunPlan(total_steps=2, micro_batch=4, accumulation=4, steps_per_epoch=10.0)
    model, mcfg = loop.build_model(cfg, mesh)
    stream = BatchStream(cfg.data.dir, "train", loader_config(cfg, plan, split="train"), 4)
    micro = stream.next()
    capacity = frame_capacity(cfg, mcfg)
    accumulated = assemble(mcfg, micro, capacity).batch
    large = assemble(mcfg, [_merge_micro(micro)], capacity).batch
    assert accumulated.target_mask.shape[:2] == (4, 4) and large.target_mask.shape[:2] == (1, 16)
    assert sum(int(b["image_grid_thw"].prod(-1).astype(bool).sum()) for b in micro) > 0     # images included
    import optax
    lr = 1e-3
    out = {}
    for name, batch in (("accumulated", accumulated), ("large", large)):
        # constant-lr AdamW: the first step already moves the parameters (one compile per case)
        builder = StepBuilder(model, optax.adamw(lr, b1=0.9, b2=0.95), StepConfig(LossConfig(96, 512)), mesh)
        state = builder.init_state()
        before = jax.device_get(state.params)
        dev = host_batch_to_device(batch, builder.batch_shardings(batch))
        with jax.set_mesh(mesh):
            state, m = builder.jit_train(state, dev)(state, builder.rest, dev)
        moved = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), jax.device_get(state.params), before)
        out[name] = (jax.device_get(m), jax.tree.leaves(moved))
    (ma, ua), (ml, ul) = out["accumulated"], out["large"]
    assert ma["target_tokens"] == ml["target_tokens"] > 0
    np.testing.assert_allclose(ma["loss"], ml["loss"], rtol=1e-6)
    np.testing.assert_allclose(ma["grad_norm"], ml["grad_norm"], rtol=1e-5)     # fp32 summation order only
    assert any(float(np.abs(u).max()) > 0.5 * lr for u in ul)
    for a, b in zip(ua, ul):
        # Adam's first step is lr * g / (|g| + eps): an entry whose gradient is well above eps
        # moves by ~lr and must agree to 1% of lr; where |g| is near eps (e.g. the router column
        # of an expert no token chose) the step amplifies fp32 summation-order noise and is not
        # compared.
        clear = np.maximum(np.abs(a), np.abs(b)) > 0.5 * lr
        np.testing.assert_allclose(a[clear], b[clear], rtol=0, atol=1e-2 * lr)
