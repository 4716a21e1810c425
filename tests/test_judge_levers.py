"""The judge levers' knobs (issue 38): the value-check term read at a chosen layer, the curriculum's
early stream, and the configs the lever table trains (tiny Qwen3.5, head_dim 32)."""

import json
import os

import grain
import jax
import numpy as np
import pytest
from flax import nnx

from launch.common import REPO_ROOT, load_config
from rm_jax.data import records
from rm_jax.data.value_swap import VALUE_SWAPPED
from rm_jax.model import registry
from rm_jax.model.config import ConfigError
from rm_jax.run_config import model_config, parse
from rm_jax.sharding import make_mesh
from rm_jax.train import loop, optim
from rm_jax.train.data_plan import BatchStream, RunPlan, loader_config
from rm_jax.train.host_batch import TokenWeights, ValueCheck, assemble, frame_capacity
from rm_jax.train.step import StepBuilder, host_batch_to_device
from run_flags import train_cfg


def _two_way_nll(hidden_btd, head_dv, value_target_bt, ids):
    logits = np.asarray(hidden_btd, np.float64) @ np.asarray(head_dv, np.float64)
    two = logits[..., [ids["fail_id"], ids["pass_id"]]]
    logp = two - np.logaddexp(two[..., :1], two[..., 1:])
    b, t = np.nonzero(value_target_bt >= 0)
    return -np.where(value_target_bt[b, t] == VALUE_SWAPPED, logp[b, t, 0], logp[b, t, 1]).mean()


def _forward_and_layer0(model, inputs):
    out = model.forward_arrays(inputs, return_hidden=True, logits=False)
    return out, model.final_norm(out.layer_hidden_lbtd[0])


def test_value_check_reads_the_chosen_layer(tiny_cfg, built_shards):
    """With train.value_check_layer=0 (of 2), `value_check_loss` is the verdict tokens' two-way NLL
    read from layer 0's output (final norm, head), not from the final hidden state."""
    data_dir, result = built_shards
    cfg = train_cfg(tiny_cfg, data_dir, value_check_weight=1.0, value_check_rate=0.7, value_check_layer=0)
    mesh = make_mesh(dict(data=1), devices=jax.devices()[:1], num_experts=8, global_batch=8)
    plan = RunPlan(total_steps=1, micro_batch=8, accumulation=1, steps_per_epoch=10.0)
    model, mcfg = loop.build_model(cfg, mesh)
    stream = BatchStream(cfg.data.dir, "train", loader_config(cfg, plan, split="train"), 1)
    host = assemble(mcfg, stream.next(), frame_capacity(cfg, mcfg), TokenWeights.from_config(cfg.train, mcfg),
                    ValueCheck.from_config(cfg, result.manifest), step=0)
    builder = StepBuilder(model, optim.make_optimizer(optim.OptimConfig(lr=1e-3, warmup_steps=1, total_steps=2),
                                                      model), loop.step_config(cfg, result.manifest), mesh)
    state = builder.init_state()
    vt = host.batch.value_target[0]
    assert (vt >= 0).sum() > 0
    with jax.set_mesh(mesh):
        placed = host_batch_to_device(host.batch, builder.batch_shardings(host.batch))
        metrics = jax.device_get(builder.jit_eval()(state.params, builder.rest, placed))
        inputs = jax.tree.map(lambda x: x[0], host.batch.inputs)
        out, layer0 = jax.jit(lambda p, r, x: _forward_and_layer0(nnx.merge(builder.graphdef, p, r), x))(
            state.params, builder.rest, inputs)
    ids, head = result.manifest["verdict_tokens"], model.head_dv()
    at_layer0 = _two_way_nll(layer0, head, vt, ids)
    at_last = _two_way_nll(out.final_hidden_btd, head, vt, ids)
    assert abs(at_layer0 - at_last) > 1e-3          # the two readings differ on this model
    np.testing.assert_allclose(metrics["value_check_loss"], at_layer0, rtol=1e-5)


def test_value_check_layer_is_validated(tiny_cfg, built_shards):
    assert train_cfg(tiny_cfg, built_shards[0]).train.value_check_layer == -1      # the default: the last
    with pytest.raises(ConfigError, match="the model has 2 layers"):
        train_cfg(tiny_cfg, built_shards[0], value_check_layer=2)
    with pytest.raises(ConfigError, match="value_check_layer=-2"):
        train_cfg(tiny_cfg, built_shards[0], value_check_layer=-2)


def _record_facts(data_dir, samples_path):
    """Independently of the curriculum module: each train record's tokens -> (label, issues, length)."""
    with open(samples_path) as f:
        issues = {s["id"]: tuple(s["label"]["issues"] or ()) for s in map(json.loads, f)}
    source = grain.sources.ArrayRecordDataSource(records.shard_paths(data_dir, "train"))
    facts = {}
    for i in range(len(source)):
        r = records.decode(source[i])
        facts[tuple(int(t) for t in r["input_ids"])] = (int(r["label"]), issues[r["id"]], len(r["input_ids"]))
    return facts


def _rows(batch, facts):
    n = batch["attention_mask"].sum(1)
    return [facts[tuple(int(t) for t in batch["input_ids"][i, :n[i]])]
            for i in np.flatnonzero(batch["example_valid"])]


def test_curriculum_draws_one_kind_of_short_inputs_first(tiny_cfg, built_shards, synth_dir):
    """The first curriculum_steps steps hold only passes and failures of the chosen kind, no input
    longer than curriculum_max_len; then the full stream (other kinds) follows, and a stream
    restored from its saved state after step k yields what the uninterrupted one yields."""
    data_dir, _ = built_shards
    facts = _record_facts(data_dir, os.path.join(synth_dir, "samples.jsonl"))
    fail_kinds = sorted({k for label, found, _ in facts.values() if label == 1 for k in found})
    kind = max(fail_kinds, key=lambda k: sum(label == 1 and k in found for label, found, _ in facts.values()))
    lengths = sorted(n for label, found, n in facts.values() if label == 1 and kind in found)
    max_len = lengths[3 * len(lengths) // 4]
    # The fixture's train split holds few failures: oversampled x20 so the early steps show some.
    cfg = train_cfg(tiny_cfg, data_dir, curriculum_kind=kind, curriculum_steps=3, curriculum_max_len=max_len,
                    grad_accum=2, data=dict(oversample_fail=20))
    plan = RunPlan(total_steps=12, micro_batch=4, accumulation=2, steps_per_epoch=10.0)
    stream = BatchStream(data_dir, "train", loader_config(cfg, plan, split="train"), plan.accumulation)
    steps = [[row for b in stream.next() for row in _rows(b, facts)] for _ in range(plan.total_steps)]
    early, late = steps[:3], steps[3:]
    assert all(len(rows) == 8 for rows in early)
    assert all(label == 0 or kind in found for rows in early for label, found, _ in rows)
    assert all(n <= max_len for rows in early for _, _, n in rows)
    assert any(label == 1 for rows in early for label, _, _ in rows)
    assert any(label == 1 and kind not in found for rows in late for label, found, _ in rows)
    assert any(n > max_len for rows in late for _, _, n in rows)

    resumed_stream = BatchStream(data_dir, "train", loader_config(cfg, plan, split="train"), plan.accumulation)
    for _ in range(2):
        resumed_stream.next()
    resumed = BatchStream(data_dir, "train", loader_config(cfg, plan, split="train"), plan.accumulation,
                          state=resumed_stream.state())
    again = [[row for b in resumed.next() for row in _rows(b, facts)] for _ in range(4)]
    assert again == steps[2:6]


def test_curriculum_is_validated(tiny_cfg, built_shards):
    with pytest.raises(ConfigError, match="set both"):
        train_cfg(tiny_cfg, built_shards[0], curriculum_kind="wrong_param")
    with pytest.raises(ConfigError, match="set both"):
        train_cfg(tiny_cfg, built_shards[0], curriculum_steps=10)
    with pytest.raises(ConfigError, match="curriculum_max_len"):
        train_cfg(tiny_cfg, built_shards[0], curriculum_kind="wrong_param", curriculum_steps=1, curriculum_max_len=-1)
    cfg = train_cfg(tiny_cfg, built_shards[0], curriculum_kind="no_such_kind", curriculum_steps=1)
    plan = RunPlan(total_steps=1, micro_batch=8, accumulation=1, steps_per_epoch=10.0)
    with pytest.raises(ValueError, match="no training failure of that kind.*the data's kinds"):
        loader_config(cfg, plan, split="train")


def test_lever_configs_build_their_models():
    """configs/tiny_qwen3_5.py (3 GDN + 1 attention layer, shared expert, partial rotary 0.25) and the
    head_dim 32 override of configs/tiny.py parse and initialize."""
    qwen35 = model_config(parse(load_config(os.path.join(REPO_ROOT, "configs/tiny_qwen3_5.py"))))
    assert qwen35.text.linear_layers == (0, 1, 2) and qwen35.text.attention_layers == (3,)
    assert qwen35.text.rotary_dim == 4 and qwen35.text.rope_theta == 1e7
    assert qwen35.text.shared_expert_intermediate_size > 0
    tiny = load_config(os.path.join(REPO_ROOT, "configs/tiny.py"))
    assert qwen35.image_token_id == tiny.model.image_token_id and qwen35.text.vocab_size == 4096
    tiny.model.text_config.head_dim = 32
    tiny.model.text_config.rope_parameters.mrope_section = (8, 4, 4)
    wide_heads = model_config(parse(tiny))
    assert wide_heads.text.head_dim == 32 and wide_heads.text.hidden_size == 64
    for mcfg in (qwen35, wide_heads):
        model = registry.init_model(mcfg, seed=0)
        assert model.cfg.text.hidden_size == 64
