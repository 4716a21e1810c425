"""Grain loader: deterministic order, exact resume, oversampling in the stream, static shapes."""

import numpy as np
import pytest

from rm_jax.data import loader, records


def _cfg(**kw):
    base = dict(batch_size=4, buckets=(512, 768, 1024), seed=3)
    base.update(kw)
    return loader.LoaderConfig(**base)


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_same_seed_same_order_and_resume(built_shards):
    out, _ = built_shards
    ds = loader.make_dataset(out, "train", _cfg())
    a = _take(loader.make_iterator(ds), 12)
    it = loader.make_iterator(ds)
    _take(it, 5)
    state = it.get_state()
    resumed = _take(loader.make_iterator(loader.make_dataset(out, "train", _cfg()), state), 7)
    for x, y in zip(a[5:], resumed):
        assert all(np.array_equal(x[k], y[k]) for k in x)
    other = _take(loader.make_iterator(loader.make_dataset(out, "train", _cfg(seed=4))), 12)
    assert any(not np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, other))


def test_oversampling_visible_in_stream(built_shards):
    out, result = built_shards
    labels = records.load_index(out, "train")["label"]
    n_fail, n_pass = int(labels.sum()), int((labels == 0).sum())
    epoch = n_pass + 3 * n_fail
    ds = loader.make_dataset(out, "train", _cfg(batch_size=1, num_epochs=1, drop_remainder=False))
    got = np.asarray([b["label"][0] for b in loader.make_iterator(ds)])
    assert len(got) == epoch and int(got.sum()) == 3 * n_fail == result.stats["oversampling"]["stream_fail"]
    held = records.load_index(out, "heldout")["label"]
    hds = loader.make_dataset(out, "heldout", _cfg(batch_size=1, num_epochs=1, shuffle=False, drop_remainder=False))
    assert sum(1 for _ in loader.make_iterator(hds)) == len(held)   # never oversampled


def test_static_shapes_and_padding(built_shards):
    out, _ = built_shards
    ds = loader.make_dataset(out, "heldout", _cfg(batch_size=8, num_epochs=1, shuffle=False, drop_remainder=False))
    for b in loader.make_iterator(ds):
        B, L = b["input_ids"].shape
        assert B == 8 and L in (512, 768, 1024)
        assert (b["attention_mask"].sum(1) > 0).sum() == b["example_valid"].sum()
        P = b["pixel_values"].shape[0]
        assert P & (P - 1) == 0 and P >= b["image_grid_thw"].prod(-1).sum()
        assert (b["target_mask"] <= b["attention_mask"]).all()


def test_process_slices_are_the_one_process_batch(built_shards):
    """Process p's batch i is rows [p*B/P, (p+1)*B/P) of the one-process batch i, so the slices
    in process order are that batch. A finite stream is padded to whole global batches: every
    process yields the same number of batches (none can stop early and hang a collective)."""
    out, _ = built_shards
    for split, kw in (("train", dict(num_epochs=None)), ("heldout", dict(num_epochs=1, shuffle=False,
                                                                           drop_remainder=False))):
        one = loader.make_iterator(loader.make_dataset(out, split, _cfg(batch_size=4, buckets=(1024,), **kw)))
        parts = [list(loader.make_iterator(loader.make_dataset(
            out, split, _cfg(batch_size=4, buckets=(1024,), process_index=p, process_count=2, **kw))))
            if split == "heldout" else None for p in range(2)]
        if split == "train":
            its = [loader.make_iterator(loader.make_dataset(
                out, split, _cfg(batch_size=4, buckets=(1024,), process_index=p, process_count=2, **kw))) for p in range(2)]
            parts = [_take(it, 6) for it in its]
            whole = _take(one, 6)
        else:
            whole = list(one)
        assert len(parts[0]) == len(parts[1]) == len(whole)
        for w, a, b in zip(whole, *parts):
            for key in ("input_ids", "target_mask", "label", "example_valid"):
                np.testing.assert_array_equal(np.concatenate([a[key], b[key]]), w[key])
    held = records.load_index(out, "heldout")["label"]
    assert sum(int(b["example_valid"].sum()) for b in whole) == len(held)


def test_image_ladder_fits_every_batch_on_few_rungs():
    from rm_jax.data.loader import ImageLadder
    ladder = ImageLadder.for_frame_capacity(256, merge=2)
    rng = np.random.default_rng(0)
    shapes = set()
    for _ in range(2000):
        images_per_sample = rng.integers(0, 3, size=rng.integers(1, 33))
        patches = sum(int(rng.integers(4, 65)) * 4 for _ in range(int(images_per_sample.sum())))
        n_images = int(images_per_sample.sum())
        p_pad, g_pad = ladder.pad(patches, n_images)
        assert p_pad >= patches and g_pad >= n_images and p_pad % 4 == 0
        assert g_pad & (g_pad - 1) == 0
        shapes.add((p_pad, g_pad))
    # one shape per rung: 1..64 image rows on 7 rungs, instead of one per (patch, row) power pair
    assert len(shapes) <= 7, sorted(shapes)
    assert ladder.pad(0, 0) == (128, 1)
    with pytest.raises(ValueError):
        ImageLadder(0)


def _record_prompts(out, split):
    """prompt_id of every record of `split`, in index order (decoded from the shards)."""
    import grain
    source = grain.sources.ArrayRecordDataSource(records.shard_paths(out, split))
    return [records.decode(source[i])["prompt_id"] for i in range(len(source))]


def test_index_numbers_prompts(built_shards):
    out, _ = built_shards
    for split in records.SPLITS:
        numbers = records.load_index(out, split)["prompt"]
        ids = _record_prompts(out, split)
        pairs = set(zip(ids, numbers.tolist()))
        assert len(pairs) == len(set(ids)) == len(set(numbers.tolist()))   # one number per prompt_id


def test_grouped_stream_keeps_a_prompts_responses_together(built_shards):
    out, _ = built_shards
    index = records.load_index(out, "train")
    stream = loader.stream_indices(index["label"], 3)
    prompts = index["prompt"]
    for epoch in range(2):
        order = loader.grouped_epoch(prompts, stream, 3, epoch)
        assert sorted(order.tolist()) == sorted(stream.tolist())       # same records, same repeats
        runs = prompts[order][np.r_[True, np.diff(prompts[order]) != 0]]
        assert len(runs) == len(set(prompts.tolist()))                  # each prompt one contiguous run
    assert not np.array_equal(loader.grouped_epoch(prompts, stream, 3, 0), loader.grouped_epoch(prompts, stream, 3, 1))
    # Through the loader: two epochs in exactly that order, and an exact resume.
    cfg = _cfg(batch_size=1, num_epochs=2, drop_remainder=False, group_by_prompt=True)
    got = [b["input_ids"][0][b["attention_mask"][0] > 0] for b in loader.make_iterator(loader.make_dataset(out, "train", cfg))]
    want = np.concatenate([loader.grouped_epoch(prompts, stream, 3, e) for e in range(2)])
    plain = loader.make_iterator(loader.make_dataset(out, "train", _cfg(batch_size=1, num_epochs=1, shuffle=False,
                                                                        drop_remainder=False, oversample_fail=1)))
    by_record = [b["input_ids"][0][b["attention_mask"][0] > 0] for b in plain]
    assert len(got) == len(want) and all(np.array_equal(g, by_record[w]) for g, w in zip(got, want))
    it = loader.make_iterator(loader.make_dataset(out, "train", _cfg(group_by_prompt=True)))
    _take(it, 3)
    resumed = loader.make_iterator(loader.make_dataset(out, "train", _cfg(group_by_prompt=True)), it.get_state())
    assert all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(_take(it, 4), _take(resumed, 4)))


def test_grouped_stream_needs_numbered_prompts(built_shards, tmp_path):
    import shutil
    out, _ = built_shards
    old = tmp_path / "old"
    shutil.copytree(out, old)
    z = dict(np.load(records.index_path(str(old), "train")))
    del z["prompt"]
    np.savez(records.index_path(str(old), "train"), **z)
    with pytest.raises(ValueError, match="rebuild"):
        loader.make_dataset(str(old), "train", _cfg(group_by_prompt=True))
    loader.make_dataset(str(old), "train", _cfg())   # ungrouped streams still read old shards
