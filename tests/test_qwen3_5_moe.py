"""rm_jax Qwen3.5-MoE == transformers' Qwen3_5MoeForConditionalGeneration / ForCausalLM, fp32.

The multimodal config is lopsided so layout bugs cannot cancel out: H != 2I, a shared expert of
another width, GQA 4:1, 7 experts top-3, GDN value heads != key heads and K != V, partial rotary
with MRoPE sections on all three axes, and a layer pattern with no repeat. The batch is 640 tokens
(ten GDN chunks of 64) with two non-square images in different rows and right padding. Both
expert layouts are loaded: per-expert (what ``save_pretrained`` writes) and fused (published).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from flax import nnx

from rm_jax.model.config import ConfigError, RuntimeOptions
from rm_jax.model.safetensors_io import SafetensorsFile
from rm_jax.model.inputs import prepare_inputs
from rm_jax.model.qwen3_5_moe.config import Qwen35MoeConfig
from rm_jax.model import decode
from rm_jax.model.qwen3_5_moe.model import layer_period
# The generic entry points: they dispatch on config.json's model_type (rm_jax.model.registry).
from rm_jax.model import load_hf, save_hf
from hf_reference import IMAGE, VEND, VSTART, multimodal_batch, rel_err

PATTERN = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]


def text_config(**overrides):
    text = dict(vocab_size=512, hidden_size=48, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=1,
                head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=12, linear_conv_kernel_dim=4, moe_intermediate_size=20,
                shared_expert_intermediate_size=28, num_experts=7, num_experts_per_tok=3, layer_types=PATTERN,
                rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                     mrope_section=[2, 1, 1], mrope_interleaved=True))
    text.update(overrides)
    return text


def multimodal_config():
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=48, num_position_embeddings=36)
    return dict(model_type="qwen3_5_moe", image_token_id=IMAGE, video_token_id=6, vision_start_token_id=VSTART,
                vision_end_token_id=VEND, tie_word_embeddings=False, text_config=text_config(),
                vision_config=vision)


def randomize(model, seed):
    """HF initialises norms to 0/1, biases to 0 and A_log/dt_bias to fixed values: perturb every
    parameter so each mapping is tested."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def hf_logits(model, ids, mask, pixels=None, grids=None):
    kw = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    if pixels is not None:
        kw.update(pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grids),
                  mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64)))
    with torch.no_grad():
        return model(**kw).logits.numpy()


def fused_state_dict(model, n_mtp=2):
    """The in-memory (fused ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]) tensors, as
    published checkpoints store them, plus a few ``mtp.*`` tensors the loader must skip."""
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    for i in range(n_mtp):
        sd[f"mtp.layers.{i}.input_layernorm.weight"] = torch.zeros(48)
    return sd


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    per_expert = tmp_path_factory.mktemp("q35_per_expert")
    fused = tmp_path_factory.mktemp("q35_fused")
    torch.manual_seed(0)
    hf = randomize(Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(**multimodal_config())).float(), 1)
    hf.save_pretrained(per_expert)
    save_file(fused_state_dict(hf), str(fused / "model.safetensors"), metadata={"format": "pt"})
    (fused / "config.json").write_text((per_expert / "config.json").read_text())
    batch = multimodal_batch(t=640)
    return hf, per_expert, fused, batch, hf_logits(hf, *batch)


def jitted(fn, model, *static):
    graphdef, state = nnx.split(model)
    f = jax.jit(lambda state, *a: fn(nnx.merge(graphdef, state), *a, *static))
    return lambda *a: f(state, *a)


def valid_rel_err(ours, ref, mask):
    m = mask.astype(bool)
    return rel_err(np.asarray(ours)[m], ref[m])


def test_config_parses_pattern_and_refuses_bad_types(multimodal):
    _, per_expert, *_ = multimodal
    cfg = Qwen35MoeConfig.from_hf_dict(json.loads((per_expert / "config.json").read_text()))
    assert cfg.text.layer_types == tuple(PATTERN) and cfg.text.rotary_dim == 8
    assert cfg.text.shared_expert_intermediate_size == 28 and cfg.vision.deepstack_visual_indexes == ()
    assert layer_period(cfg.text.layer_types) == 5 and layer_period(["linear_attention"] * 3 + ["full_attention"]) == 4
    assert Qwen35MoeConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    bad = multimodal_config()
    bad["text_config"]["layer_types"] = PATTERN[:-1] + ["sliding_attention"]
    with pytest.raises(ConfigError, match="sliding_attention"):
        Qwen35MoeConfig.from_hf_dict(bad)
    bad["text_config"]["layer_types"] = PATTERN[:-1]
    with pytest.raises(ConfigError, match="4 entries"):
        Qwen35MoeConfig.from_hf_dict(bad)
    # Without layer_types, transformers' default: every 4th layer full attention.
    default = text_config(num_hidden_layers=8, layer_types=None, model_type="qwen3_5_moe_text")
    kinds = Qwen35MoeConfig.from_hf_dict(default).text.layer_types
    assert [i for i, k in enumerate(kinds) if k == "full_attention"] == [3, 7]


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_multimodal_parity_both_expert_layouts(multimodal, layout, caplog):
    hf, per_expert, fused, (ids, mask, pixels, grids), ref = multimodal
    # absl's logger: its level follows --verbosity once a test in this worker parsed absl flags
    with caplog.at_level("INFO", logger="absl"):
        model, cfg = load_hf(per_expert if layout == "per_expert" else fused)
    assert cfg.hf_expert_layout == ("per_expert" if layout == "per_expert" else "out_in")
    if layout == "fused":
        assert any("ignoring 2 mtp.*" in r.getMessage() for r in caplog.records)
    out = model.forward(ids, mask, pixels, grids, return_hidden=True)
    err = valid_rel_err(out.logits_btv, ref, mask)
    assert err <= 2e-4, err
    with torch.no_grad():
        ref_img = torch.cat(hf.model.get_image_features(torch.tensor(pixels), torch.tensor(grids)).pooler_output)
    assert rel_err(out.image_embeds_nd, ref_img.numpy()) <= 2e-4
    assert out.layer_hidden_lbtd.shape[0] == 5 and out.moe_aux.expert_counts.shape == (5, 7)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_round_trip_bit_exact_and_transformers_loads_export(multimodal, layout, tmp_path):
    from transformers import Qwen3_5MoeForConditionalGeneration
    hf, per_expert, fused, (ids, mask, pixels, grids), ref = multimodal
    src = per_expert if layout == "per_expert" else fused
    model, _ = load_hf(src)
    save_hf(model, tmp_path)
    a, b = SafetensorsFile(src / "model.safetensors"), SafetensorsFile(tmp_path / "model.safetensors")
    assert set(b.keys()) == {k for k in a.keys() if not k.startswith("mtp.")}
    for key in b.keys():
        assert a.header[key]["dtype"] == b.header[key]["dtype"], key
        assert np.array_equal(a.get(key).view(np.uint8), b.get(key).view(np.uint8)), key
    if layout == "per_expert":
        back = Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
        np.testing.assert_array_equal(hf_logits(back, ids, mask, pixels, grids), ref)
    else:
        # streamed in shards (with an index) when over max_shard_bytes: same tensors, and it loads back
        shards = tmp_path / "sharded"
        save_hf(model, shards, max_shard_bytes=64 << 10)
        index = json.loads((shards / "model.safetensors.index.json").read_text())
        files = sorted(shards.glob("model-*-of-*.safetensors"))
        assert len(files) > 2 and set(index["weight_map"].values()) == {f.name for f in files}
        assert set(index["weight_map"]) == set(b.keys()) and not (shards / "model.safetensors").exists()
        for f in files:
            part = SafetensorsFile(f)
            for key in part.keys():
                assert np.array_equal(part.get(key).view(np.uint8), b.get(key).view(np.uint8)), key
        again, _ = load_hf(shards)
        for x, y in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again))):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_padding_never_reaches_gdn_state(multimodal):
    """A right-padded row's GDN states and attention KV equal those of the same row run alone."""
    _, per_expert, *_ = multimodal
    # The dense MoE oracle and XLA attention: the same math, a fraction of the compile time.
    model, cfg = load_hf(per_expert, runtime=RuntimeOptions(moe_backend="dense", attention="xla"))
    rng = np.random.default_rng(3)
    ids = rng.integers(10, 512, (2, 200))
    mask = np.ones_like(ids)
    mask[1, 130:] = 0
    states_of = jitted(lambda m, inputs: (lambda o: (o.kv_lbtkh, o.recurrent))(m.forward_arrays(inputs, return_kv=True)),
                       model)
    (k_lbtkh, _), gdn = states_of(prepare_inputs(cfg, ids, mask, attention="lengths"))
    (alone_k, _), alone_gdn = states_of(prepare_inputs(cfg, ids[1:, :130], mask[1:, :130]))
    np.testing.assert_allclose(gdn.recurrent_bhkv[:, 1], alone_gdn.recurrent_bhkv[:, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gdn.conv_bwc[:, 1], alone_gdn.conv_bwc[:, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(k_lbtkh[:, 1, :130], alone_k[:, 0], rtol=1e-5, atol=1e-5)
    assert gdn.recurrent_bhkv.shape[0] == 3 and k_lbtkh.shape[0] == 2


@pytest.fixture(scope="module")
def text_only(tmp_path_factory):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    path = tmp_path_factory.mktemp("q35_text")
    text = text_config(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2)
    torch.manual_seed(0)
    hf = randomize(Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text)).float(), 2)
    hf.save_pretrained(path)
    return hf, path


def test_text_only_causal_lm_periodic_pattern(text_only, tmp_path):
    """Qwen3_5MoeForCausalLM (``model.layers.*``, no vision), a periodic pattern (scanned by block)."""
    from transformers import Qwen3_5MoeForCausalLM
    hf, src = text_only
    model, cfg = load_hf(src)
    assert cfg.vision is None and model.period == 2
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 512, (2, 150))
    mask = np.ones_like(ids)
    mask[0, 97:] = 0
    ref = hf_logits(hf, ids, mask)
    assert valid_rel_err(model(ids, mask), ref, mask) <= 2e-4
    save_hf(model, tmp_path / "out")
    back = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    np.testing.assert_array_equal(hf_logits(back, ids, mask), ref)


@pytest.mark.slow   # six compiles of the text model: ~80 s on a loaded 2-core host
def test_cached_decode_and_shared_prefix_equal_full_forward(text_only):
    """KV + GDN-state decoding: prefill then one step, and a shared prefix extended by
    right-padded suffixes, equal the full re-forward at the same positions."""
    _, src = text_only
    model, cfg = load_hf(src, runtime=RuntimeOptions(moe_backend="dense", attention="xla"))
    full = jitted(lambda m, inputs: m.forward_arrays(inputs).logits_btv, model)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 512, (2, 41))
    lengths = np.array([40, 29])
    mask = (np.arange(41)[None] < lengths[:, None] + 1).astype(np.int64)     # prompt + the next token
    ref = np.asarray(full(prepare_inputs(cfg, ids, mask, attention="lengths")))
    prompt_mask = (np.arange(41)[None] < lengths[:, None]).astype(np.int64)
    logits_bv, cache = jitted(decode.prefill_fn, model, 48)(prepare_inputs(cfg, ids, prompt_mask, attention="lengths"))
    np.testing.assert_allclose(logits_bv, ref[[0, 1], lengths - 1], rtol=1e-4, atol=1e-4)
    step_logits_bv, cache = jitted(decode.step_fn, model)(cache, jnp.asarray(ids[[0, 1], lengths]))
    np.testing.assert_allclose(step_logits_bv, ref[[0, 1], lengths], rtol=1e-4, atol=1e-4)
    assert np.array_equal(cache.length_b, lengths + 1)

    # Shared prefix: one 25-token prefix row, two continuations of 15 and 9 tokens.
    prefix = ids[:1, :25]
    _, pcache = jitted(decode.prefill_fn, model, 48)(prepare_inputs(cfg, prefix, np.ones_like(prefix),
                                                                    attention="lengths"))
    suffix = rng.integers(0, 512, (2, 15))
    n_b = np.array([15, 9])
    whole = np.concatenate([np.repeat(prefix, 2, 0), suffix], 1)
    whole_mask = (np.arange(40)[None] < 25 + n_b[:, None]).astype(np.int64)
    ref2 = np.asarray(full(prepare_inputs(cfg, whole, whole_mask, attention="lengths")))[[0, 1], 24 + n_b]
    lp, lf, lse = jitted(decode.extend_slot_logits_fn, model, 7, 11)(
        pcache, jnp.zeros(2, jnp.int32), jnp.asarray(suffix), jnp.asarray(n_b))
    np.testing.assert_allclose(lp, ref2[:, 7], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(lf, ref2[:, 11], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(ref2, axis=-1), rtol=1e-5, atol=1e-5)


def test_35b_config_has_the_published_sizes():
    """configs/qwen3_5_35b_a3b.py parses, and its text sizes are transformers' Qwen3_5MoeConfig
    defaults (which are Qwen/Qwen3.5-35B-A3B's)."""
    from transformers import Qwen3_5MoeTextConfig

    from configs import qwen3_5_35b_a3b
    from rm_jax.model.config import hf_config_dict
    cfg = Qwen35MoeConfig.from_hf_dict(hf_config_dict(qwen3_5_35b_a3b.hf_model_config().to_dict()))
    ref = Qwen3_5MoeTextConfig()
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size"):
        assert getattr(cfg.text, key) == getattr(ref, key), key
    assert cfg.text.layer_types == tuple(ref.layer_types) and cfg.text.attention_layers == tuple(range(3, 40, 4))
    assert cfg.text.rotary_dim == 64 and cfg.vision.out_hidden_size == 2048 and not cfg.vision.deepstack_visual_indexes


@pytest.mark.slow   # the scorer's prompt buckets and shared-prefix path compiled on the hybrid decoder
def test_scorer_p_pass_equals_transformers(renderer, synth_dir, tmp_path):
    """rm_jax.score.Scorer on a tiny Qwen3.5 (loaded through the registry) reads P(pass) at the
    verdict slot equal to transformers' softmax over {pass, fail} there (1e-5), images included;
    the shared-prefix rows go through decode_tokens on the KV + GDN state."""
    import os

    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    from configs.tiny import hf_model_config
    from rm_jax.data.schema import Sample, read_samples
    from rm_jax.data.target import VERDICT_FIRST
    from rm_jax.score.scorer import Scorer
    tiny = hf_model_config().to_dict()
    vision = {k: tiny["vision_config"][k] for k in ("depth", "hidden_size", "intermediate_size", "num_heads",
                                                    "in_channels", "patch_size", "spatial_merge_size",
                                                    "temporal_patch_size", "num_position_embeddings")}
    d = dict(multimodal_config(), vision_config=dict(vision, out_hidden_size=48),
             text_config=text_config(vocab_size=len(renderer.tokenizer)),
             **{k: tiny[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                     "vision_end_token_id")})
    torch.manual_seed(0)
    hf = randomize(Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(**d)).float(), 4)
    hf.save_pretrained(tmp_path)
    model, cfg = load_hf(tmp_path)
    got = [s for s in read_samples(os.path.join(synth_dir, "samples.jsonl")) if isinstance(s, Sample)]
    samples = [s for s in got if s.images][:2] + [s for s in got if not s.images][:2]
    scorer = Scorer(model, renderer, field_order=VERDICT_FIRST, buckets=(512, 768, 1024), batch_size=2,
                    max_new_tokens=8, progress=False)
    groups, alone = scorer.prefix_groups(scorer.render(samples)[0])
    assert groups, "no shared-prefix group: the decode_tokens path would go untested"
    scores = scorer.p_pass(samples)
    v = renderer.verdict
    for s, score in zip(samples, scores):
        ji = renderer.render(s, with_target=False)
        ids = np.concatenate([ji.input_ids, renderer.scoring_prefix_ids()])[None]
        kw = dict(input_ids=torch.tensor(ids, dtype=torch.long))
        if len(ji.image_grid_thw):
            kw.update(pixel_values=torch.tensor(np.asarray(ji.pixel_values, np.float32)),
                      image_grid_thw=torch.tensor(np.asarray(ji.image_grid_thw, np.int64)),
                      mm_token_type_ids=torch.tensor((ids == cfg.image_token_id).astype(np.int64)))
        with torch.no_grad():
            logits = hf(**kw).logits[0, -1].double().numpy()
        two = np.exp(logits[[v.pass_id, v.fail_id]] - logits[[v.pass_id, v.fail_id]].max())
        assert score.slot_found and score.error is None
        assert abs(score.p_pass - two[0] / two.sum()) < 1e-5, (s.id, score.p_pass, two[0] / two.sum())
