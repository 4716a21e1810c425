"""Swapped-value detection: value classes from the build, swaps and labels per row, the loss term
against a reference from the model's own logits, and the config's refusals."""

import json
import os

import jax
import numpy as np
import pytest

from rm_jax.data import synth
from rm_jax.data.render import RESPONSE_HEADER
from rm_jax.data.schema import Sample, read_samples
from rm_jax.data.value_swap import VALUE_KEPT, VALUE_OFF, VALUE_SWAPPED, ValueClasses, swap_batch
from rm_jax.sharding import make_mesh
from rm_jax.train import loop, optim
from rm_jax.train.data_plan import BatchStream, RunPlan, loader_config
from rm_jax.train.host_batch import TokenWeights, ValueCheck, assemble, frame_capacity
from rm_jax.train.step import StepBuilder
from run_flags import train_cfg
from step_probe import objective_and_logits


def test_response_span_is_the_judged_response(renderer, synth_dir):
    seen = 0
    for s in read_samples(os.path.join(synth_dir, "samples.jsonl")):
        if not isinstance(s, Sample):
            continue
        chat, refs = renderer.judge_chat(s)
        if refs:        # the user turn is a list of parts when it holds images
            continue
        ex = renderer.render(s, with_target=False)
        start, end = ex.response_span
        content = chat[-1]["content"]
        text = content if isinstance(content, str) else "".join(p["text"] for p in content if p["type"] == "text")
        want = text.rsplit(RESPONSE_HEADER, 1)[1]
        assert renderer.tokenizer.decode(ex.input_ids[start:end]) == want
        assert ex.input_ids[end] == renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
        seen += 1
    assert seen > 20


def test_build_records_the_classes_of_single_token_values(built_shards, renderer):
    data_dir, result = built_shards
    classes = ValueClasses.from_json(result.manifest["value_classes"])
    decoded = [{renderer.tokenizer.decode([t]) for t in c} for c in classes.classes]
    pools = [set(synth.RESOLUTIONS), set(synth.ASPECTS), set(synth.COLOURS), set(synth.SHAPES),
             {str(c) for c in synth.COUNTS}]
    # every class is the values of one argument kind, and the kinds the calls use are all there
    assert all(any(d <= p for p in pools) for d in decoded), decoded
    assert all(any(d <= p for d in decoded) for p in pools[:2])   # resolutions and aspect ratios
    assert result.stats["value_classes"] == {"classes": len(classes.classes),
                                             "tokens": sum(len(c) for c in classes.classes)}
    with open(os.path.join(data_dir, "manifest.json")) as f:
        assert json.load(f)["value_classes"] == classes.to_json()


def _batch(rows, labels, valid=None, spans=None):
    ids = np.asarray(rows, np.int32)
    b = len(rows)
    spans = spans or [(1, ids.shape[1])] * b
    return {"input_ids": ids, "label": np.asarray(labels, np.int32),
            "example_valid": np.ones(b, np.int32) if valid is None else np.asarray(valid, np.int32),
            "response_start": np.asarray([s for s, _ in spans], np.int32),
            "response_end": np.asarray([e for _, e in spans], np.int32),
            "target_mask": np.ones_like(ids, np.uint8)}


CLASSES = ValueClasses(((10, 11, 12), (20, 21)))


def test_swap_batch_swaps_one_value_of_passing_rows_and_labels_their_values():
    rows = [[10, 5, 10, 20, 6], [11, 5, 6, 21, 6], [12, 20, 5, 5, 5], [5, 5, 5, 5, 5], [10, 20, 5, 5, 5]]
    batch = _batch(rows, labels=[0, 0, 1, 0, 0], valid=[1, 1, 1, 1, 0], spans=[(0, 5), (1, 5), (0, 5), (0, 5), (0, 5)])
    got = swap_batch(batch, CLASSES, 1.0, (0, 7, 0))
    ids, vt = got.input_ids, got.value_target
    # row 0: three class tokens, one swapped for another member of its class
    changed = np.flatnonzero(ids[0] != np.asarray(rows[0]))
    assert len(changed) == 1 and vt[0, changed[0]] == VALUE_SWAPPED
    j = changed[0]
    cls = next(c for c in CLASSES.classes if rows[0][j] in c)
    assert ids[0, j] in cls and ids[0, j] != rows[0][j]
    assert set(np.flatnonzero(vt[0] >= 0)) == {0, 2, 3}
    # row 1: position 0 is before the response, so only position 3 can be swapped
    assert ids[1, 0] == 11 and vt[1, 0] == VALUE_OFF and vt[1, 3] == VALUE_SWAPPED and ids[1, 3] == 20
    # a failing row, a row without class tokens and an invalid row are untouched and unlabelled
    for i in (2, 3, 4):
        np.testing.assert_array_equal(ids[i], rows[i])
        assert (vt[i] == VALUE_OFF).all()
    np.testing.assert_array_equal(got.swapped, [True, True, False, False, False])
    # rate: with a tiny rate the values are labelled but kept
    kept = swap_batch(batch, CLASSES, 1e-9, (0, 7, 0))
    np.testing.assert_array_equal(kept.input_ids, batch["input_ids"])
    assert (kept.value_target[0][[0, 2, 3]] == VALUE_KEPT).all() and not kept.swapped.any()


def test_swaps_depend_on_the_global_row_not_on_the_process_split():
    rng = np.random.default_rng(0)
    rows = rng.choice([5, 10, 11, 12, 20, 21], size=(8, 12))
    whole = swap_batch(_batch(rows, [0] * 8), CLASSES, 0.5, (3, 1, 0))
    halves = [swap_batch(_batch(rows[k:k + 4], [0] * 4), CLASSES, 0.5, (3, 1, 0), row_offset=k) for k in (0, 4)]
    np.testing.assert_array_equal(whole.input_ids, np.concatenate([h.input_ids for h in halves]))
    np.testing.assert_array_equal(whole.value_target, np.concatenate([h.value_target for h in halves]))
    other_step = swap_batch(_batch(rows, [0] * 8), CLASSES, 0.5, (3, 2, 0))
    assert not np.array_equal(whole.input_ids, other_step.input_ids)
    assert 0 < whole.swapped.sum() < 8


def test_swap_batch_keeps_to_the_position_budget():
    rows = [[10, 20, 11, 21, 12, 20, 10, 21]] * 4
    got = swap_batch(_batch(rows, [0] * 4), CLASSES, 0.5, (0, 0, 0), max_positions=3)
    assert ((got.value_target >= 0).sum(1) == 3).all()
    assert (got.value_target == VALUE_SWAPPED).sum() == got.swapped.sum()


def test_value_classes_are_validated():
    with pytest.raises(ValueError, match="two or more"):
        ValueClasses(((1,),))
    with pytest.raises(ValueError, match="share tokens"):
        ValueClasses(((1, 2), (2, 3)))


_cfg = train_cfg


def test_value_term_is_the_verdict_token_nll_at_the_labelled_values(tiny_cfg, built_shards):
    """Swapped rows lose their target; `value_check_loss` is the mean two-way NLL (fail vs pass,
    from the model's own logits) at the labelled positions, added to the objective with its weight."""
    data_dir, result = built_shards
    cfg = _cfg(tiny_cfg, data_dir, value_check_weight=0.5, value_check_rate=0.7)
    mesh = make_mesh(dict(data=1), devices=jax.devices()[:1], num_experts=8, global_batch=8)
    plan = RunPlan(total_steps=1, micro_batch=8, accumulation=1, steps_per_epoch=10.0)
    model, mcfg = loop.build_model(cfg, mesh)
    stream = BatchStream(cfg.data.dir, "train", loader_config(cfg, plan, split="train"), 1)
    micro = stream.next()
    check = ValueCheck.from_config(cfg, result.manifest)
    host = assemble(mcfg, micro, frame_capacity(cfg, mcfg), TokenWeights.from_config(cfg.train, mcfg),
                         check, step=0)
    again = assemble(mcfg, micro, frame_capacity(cfg, mcfg), TokenWeights.from_config(cfg.train, mcfg),
                          check, step=0)
    np.testing.assert_array_equal(host.batch.inputs.input_ids_bt, again.batch.inputs.input_ids_bt)
    vt = host.batch.value_target[0]
    swapped = (vt == VALUE_SWAPPED).any(1)
    assert swapped.any() and (vt >= 0).sum() > swapped.sum()
    assert (host.batch.target_mask[0][swapped] == 0).all()
    assert (host.batch.target_mask[0][~swapped & (micro[0]["example_valid"] > 0)].sum(1) > 0).all()
    assert ((vt >= 0).any(1) <= (micro[0]["label"] == 0)).all()      # failing rows are never labelled

    builder = StepBuilder(model, optim.make_optimizer(optim.OptimConfig(lr=1e-3, warmup_steps=1, total_steps=2),
                                                      model), loop.step_config(cfg, result.manifest), mesh)
    one = jax.tree.map(lambda x: x[0], host.batch)
    totals = (np.float32(one.target_mask.sum()), np.float32(1.0), np.float32((vt >= 0).sum()))
    objective, sums, logits = objective_and_logits(builder, model, mesh, one, totals)
    tokens = result.manifest["verdict_tokens"]
    two = logits[..., [tokens["fail_id"], tokens["pass_id"]]]
    logp = two - np.logaddexp(two[..., :1], two[..., 1:])
    b, t = np.nonzero(vt >= 0)
    ref_value = -np.where(vt[b, t] == VALUE_SWAPPED, logp[b, t, 0], logp[b, t, 1]).mean()
    np.testing.assert_allclose(sums.value_sum / sums.value_n, ref_value, rtol=1e-5)
    np.testing.assert_allclose(objective, sums.ce_sum / sums.n_tokens + 0.5 * ref_value + cfg.moe.lb_coef * sums.lb,
                               rtol=1e-5)


def test_value_check_refuses_data_without_classes(tiny_cfg, built_shards):
    cfg = _cfg(tiny_cfg, built_shards[0], value_check_weight=1.0)
    assert ValueCheck.from_config(_cfg(tiny_cfg, built_shards[0]), {}) is None     # off: nothing read
    with pytest.raises(ValueError, match="rebuild them"):
        ValueCheck.from_config(cfg, {})
    with pytest.raises(ValueError, match="no value classes"):
        ValueCheck.from_config(cfg, {"value_classes": []})
    with pytest.raises(ValueError, match="value_check_rate"):
        _cfg(tiny_cfg, built_shards[0], value_check_weight=1.0, value_check_rate=0.0)
    with pytest.raises(ValueError, match="verdict_tokens"):
        loop.step_config(cfg, {})


@pytest.mark.slow   # an off-by-default term: suite time
def test_a_run_with_the_term_resumes_exactly(tiny_cfg, built_shards, tmp_path):
    """The swaps are a function of (seed, step, microbatch, row): a run resumed from its step-1
    checkpoint logs exactly the rows of the uninterrupted run, `value_check_loss` included."""
    import shutil
    from rm_jax.train.metrics_log import read_metrics
    from run_flags import TIMING
    cfg = _cfg(tiny_cfg, built_shards[0], steps=2, checkpoint_every=1, eval_every=0, async_checkpoint=False,
               value_check_weight=1.0, value_check_rate=0.5)
    loop.run(cfg, str(tmp_path), progress=False)
    whole = read_metrics(str(tmp_path))
    assert all(np.isfinite(r["value_check_loss"]) and r["value_check_loss"] > 0 for r in whole)
    shutil.rmtree(tmp_path / "checkpoints" / "2")
    result = loop.run(cfg, str(tmp_path), progress=False)
    assert result["resumed_from"] == 1
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]
    assert strip(read_metrics(str(tmp_path))) == strip(whole)
