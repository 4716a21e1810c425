"""Checkpoint conversion: both fused-expert layouts, the ambiguous-shape guard, pickle refusal,
bit-exact HF -> rm_jax -> HF (directly and through Orbax), and transformers loading our export."""

import json
import shutil

import jax

import numpy as np
import pytest
import torch

from rm_jax.model import load_hf, save_hf
from rm_jax.model.safetensors_io import CheckpointError, read_safetensors, write_safetensors
from hf_reference import build_hf, hf_forward, multimodal_batch, parity_hf_config, rel_err

EXPERT_KEYS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def to_published_layout(src, dst):
    """Rewrite a transformers-saved checkpoint with experts as [E, H, 2I] / [E, I, H]."""
    shutil.copytree(src, dst)
    tensors = read_safetensors(dst / "model.safetensors")
    for k in tensors:
        if k.endswith(EXPERT_KEYS):
            tensors[k] = np.ascontiguousarray(np.swapaxes(tensors[k], 1, 2))
    write_safetensors(dst / "model.safetensors", tensors)


def assert_same_tensors(a_path, b_path):
    a, b = read_safetensors(a_path), read_safetensors(b_path)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), f"{k} differs"


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_src")
    hf = build_hf(parity_hf_config(), path)
    ids, mask, pixels, grids = multimodal_batch(t=160)
    ref = hf_forward(hf, ids, mask, pixels, grids)[0]
    return path, (ids, mask, pixels, grids), ref


def test_both_expert_layouts_load(hf_ckpt, tmp_path):
    path, batch, ref = hf_ckpt
    model, cfg = load_hf(path)
    assert cfg.hf_expert_layout == "out_in"
    to_published_layout(path, tmp_path / "published")
    model_pub, cfg_pub = load_hf(tmp_path / "published")
    assert cfg_pub.hf_expert_layout == "in_out"
    a, b = np.asarray(model(*batch)), np.asarray(model_pub(*batch))
    assert np.array_equal(a, b)
    assert rel_err(a, ref) < 2e-4
    # Export keeps each source's layout, so both round trips are exact.
    save_hf(model_pub, tmp_path / "pub_rt")
    assert_same_tensors(tmp_path / "published" / "model.safetensors", tmp_path / "pub_rt" / "model.safetensors")


def test_ambiguous_layout_needs_flag(tmp_path):
    # hidden_size == 2 * moe_intermediate_size: gate_up_proj is [E, 48, 48] either way.
    d = parity_hf_config(moe_intermediate_size=24, num_hidden_layers=2, mlp_only_layers=[])
    hf = build_hf(d, tmp_path)
    with pytest.raises(CheckpointError, match="ambiguous.*expert_layout"):
        load_hf(tmp_path)
    model, _ = load_hf(tmp_path, expert_layout="transformers")
    ids = np.random.default_rng(0).integers(10, 512, (1, 64))
    ref = hf_forward(hf, ids, np.ones_like(ids))[0]
    assert rel_err(model(ids), ref) < 2e-4
    # A flag that contradicts an unambiguous tensor (down_proj [E, H, I]) is an error, not a guess.
    with pytest.raises(CheckpointError, match="was given"):
        load_hf(tmp_path, expert_layout="published")


def test_pickle_checkpoint_refused(hf_ckpt, tmp_path):
    path, _, _ = hf_ckpt
    shutil.copy(path / "config.json", tmp_path / "config.json")
    torch.save({"x": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        load_hf(tmp_path)


def test_roundtrip_bit_exact_and_transformers_loads_export(hf_ckpt, tmp_path):
    from transformers import Qwen3VLMoeForConditionalGeneration
    path, batch, ref = hf_ckpt
    model, _ = load_hf(path)
    save_hf(model, tmp_path / "export")
    assert_same_tensors(path / "model.safetensors", tmp_path / "export" / "model.safetensors")
    reloaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    logits = hf_forward(reloaded, *batch)[0]
    assert np.array_equal(logits, ref)


def test_convert_cli_roundtrip_through_orbax(hf_ckpt, tmp_path):
    from launch.convert import hf_to_orbax, orbax_to_hf, orbax_to_model
    path, batch, ref = hf_ckpt
    ckpt = hf_to_orbax(path, tmp_path / "orbax")
    model, _ = orbax_to_model(ckpt)
    assert rel_err(model(*batch), ref) < 2e-4
    orbax_to_hf(ckpt, tmp_path / "back")
    assert_same_tensors(path / "model.safetensors", tmp_path / "back" / "model.safetensors")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["text_config"]["num_experts"] == 7


def _text_only_parity(path, ids):
    from transformers import Qwen3VLMoeForConditionalGeneration
    hf = Qwen3VLMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    mask = np.ones_like(ids)
    return rel_err(load_hf(path)[0](ids, mask), hf_forward(hf, ids, mask)[0])


def test_checkpoint_quirks_load_as_transformers_reads_them(tmp_path):
    """What transformers does with odd but real checkpoints, we do too:
    - H == I: down_proj's shape cannot tell the layout, gate_up's can (no flag needed);
    - norm_topk_prob=false: Qwen3-VL-MoE's router renormalizes anyway;
    - a tied config whose checkpoint stores a different lm_head.weight is loaded untied;
    - a stale rope_scaling dict wins over rope_parameters, and a text-level rope_theta fills it."""
    cfg = parity_hf_config(hidden_size=40, moe_intermediate_size=40, num_hidden_layers=2, mlp_only_layers=[],
                           norm_topk_prob=False, tie_word_embeddings=True)
    cfg["vision_config"].update(depth=1, deepstack_visual_indexes=[0], out_hidden_size=40)
    path = tmp_path / "quirks"
    build_hf(cfg, path)
    tensors = read_safetensors(path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = np.random.default_rng(3).standard_normal(
        tensors["model.language_model.embed_tokens.weight"].shape).astype(np.float32)
    write_safetensors(path / "model.safetensors", tensors)
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"].update(rope_theta=999.0, rope_scaling=dict(
        rope_type="default", mrope_section=[4, 2, 2], mrope_interleaved=True))
    (path / "config.json").write_text(json.dumps(raw))
    ids = np.random.default_rng(1).integers(10, 512, (2, 48))
    assert _text_only_parity(path, ids) < 2e-4
    model, loaded = load_hf(path)
    assert not loaded.tie_word_embeddings and loaded.text.rope_theta == 999.0
    assert loaded.hf_expert_layout == "out_in"


def test_each_tensor_exports_in_its_own_dtype(hf_ckpt, tmp_path):
    """fp32 norms among bf16 weights (and no top-level "dtype" in config.json) round-trip bit for bit."""
    import ml_dtypes
    path, _, _ = hf_ckpt
    mixed = tmp_path / "mixed"
    shutil.copytree(path, mixed)
    tensors = read_safetensors(mixed / "model.safetensors")
    for k in tensors:
        if "norm" not in k:
            tensors[k] = tensors[k].astype(ml_dtypes.bfloat16)
    write_safetensors(mixed / "model.safetensors", tensors)
    raw = json.loads((mixed / "config.json").read_text())
    raw.pop("dtype", None)
    (mixed / "config.json").write_text(json.dumps(raw))
    model, _ = load_hf(mixed)
    save_hf(model, tmp_path / "export")
    assert_same_tensors(mixed / "model.safetensors", tmp_path / "export" / "model.safetensors")


def test_broken_checkpoints_get_clear_errors(hf_ckpt, tmp_path):
    path, _, _ = hf_ckpt
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated or corrupt safetensors"):
        load_hf(bad)
    (bad / "model.safetensors").write_bytes(data)
    raw = json.loads((bad / "config.json").read_text())
    del raw["text_config"]["num_hidden_layers"]
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="text_config.num_hidden_layers is missing"):
        load_hf(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_hf(bad)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_hf(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="floating dtype"):
        load_hf(path, dtype="int8")


def test_sharded_export_is_bit_exact_with_a_correct_index(hf_ckpt, tmp_path):
    """A small max_shard_bytes forces several shards: together they hold the source tensors bit
    for bit, the index maps every key to its file and gives the total size, and transformers
    loads the export to the same logits."""
    from transformers import Qwen3VLMoeForConditionalGeneration
    path, batch, ref = hf_ckpt
    model, _ = load_hf(path)
    out = save_hf(model, tmp_path / "export", max_shard_bytes=64 << 10)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) >= 4 and files == sorted(p.name for p in out.glob("*.safetensors"))
    assert not list(out.glob("*.partial")) and not (out / "model.safetensors").exists()
    got = {}
    for f in files:
        tensors = read_safetensors(out / f)
        assert all(index["weight_map"][k] == f for k in tensors)
        got.update(tensors)
    src = read_safetensors(path / "model.safetensors")
    assert sorted(got) == sorted(src) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in src.values())
    for k in src:
        assert got[k].dtype == src[k].dtype and np.array_equal(got[k].view(np.uint8), src[k].view(np.uint8)), k
    reloaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    assert np.array_equal(hf_forward(reloaded, *batch)[0], ref)


def test_export_streams_shards_with_host_memory_bounded_by_one_shard(tiny_cfg, tmp_path):
    """save_hf writes each shard as soon as it is gathered: an ~87 MB fp32 model exported as
    43 MB of bf16 in 4 MB shards holds about one shard of host arrays at a time, where the same
    export as one shard (the control) holds the whole export.

    Measured with tracemalloc, which counts numpy's buffers exactly. (The process RSS is
    blurred by allocator retention and by XLA compiling the per-layer slices on first use.) bf16 from fp32 master weights is the 30B export: every tensor
    is a fresh host array, as a device-to-host copy is on GPU."""
    import tracemalloc

    from flax import nnx

    from rm_jax.model import registry
    from rm_jax.run_config import model_config, parse
    cfg = tiny_cfg.copy_and_resolve_references()
    t = cfg.model.text_config
    t.hidden_size, t.moe_intermediate_size, t.intermediate_size, t.num_hidden_layers = 256, 256, 512, 12
    model = registry.init_model(model_config(parse(cfg)), seed=0)
    export_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))) // 2

    def peak(max_shard: int, name: str) -> tuple[int, int]:
        tracemalloc.start()
        try:
            out = save_hf(model, tmp_path / name, max_shard_bytes=max_shard, dtype="bfloat16")
            return tracemalloc.get_traced_memory()[1], len(list(out.glob("*.safetensors")))
        finally:
            tracemalloc.stop()

    (streamed, n_files), (whole, n_whole) = peak(4 << 20, "streamed"), peak(1 << 40, "whole")
    print(f"export {export_bytes / 2**20:.1f} MiB: peak host arrays {streamed / 2**20:.1f} MiB in {n_files} "
          f"shards of <= 4 MiB, {whole / 2**20:.1f} MiB as one shard")
    assert export_bytes > 40 << 20 and n_files >= 10 and n_whole == 1
    assert whole > 0.9 * export_bytes
    # one shard plus the tensor in flight (its fp32 gather and a transpose)
    assert streamed < 4 * (4 << 20) < 0.5 * export_bytes
    for name in ("streamed", "whole"):
        assert (tmp_path / name / "config.json").exists()
