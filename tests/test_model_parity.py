"""rm_jax Qwen3-VL-MoE == transformers' Qwen3VLMoeForConditionalGeneration, fp32, random weights.

The config is deliberately lopsided so layout bugs cannot cancel out: H != 2I, one KV head
(GQA 4:1), 7 experts with top-3, a dense layer among sparse ones, two deepstack levels, two
non-square images of different sizes in different batch rows, right padding, and >= 600 tokens
(short prompts hide RoPE bugs).
"""

import numpy as np
import pytest

from hf_reference import build_hf, hf_forward, multimodal_batch, parity_hf_config, rel_err
from rm_jax.model import LayerSpec, load_hf


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_parity")
    hf = build_hf(parity_hf_config(), path)
    batch = multimodal_batch()
    ref = hf_forward(hf, *batch)
    model, cfg = load_hf(path)
    return model, cfg, batch, ref


def test_config_structure(multimodal):
    model, cfg, _, _ = multimodal
    assert [cfg.text.is_sparse(i) for i in range(5)] == [True, True, False, True, True]
    # layers 0 and 1 receive deepstack features -> alone; layer 2 dense; 3-4 one scanned run.
    moe, dense = LayerSpec("attention", "moe"), LayerSpec("attention", "dense")
    assert cfg.layer_specs() == (moe, moe, dense, moe, moe)
    assert [(g.start, g.end, g.spec) for g in model.layer_groups] == [(0, 1, moe), (1, 2, moe), (2, 3, dense),
                                                                     (3, 5, moe)]


def test_multimodal_logits_hidden_and_vision(multimodal):
    model, cfg, (ids, mask, pixels, grids), (ref_logits, ref_hidden, (ref_img, ref_ds)) = multimodal
    out = model.forward(ids, mask, pixels, grids, return_hidden=True)
    errs = {
        "image_embeds": rel_err(out.image_embeds_nd, ref_img),
        **{f"deepstack{k}": rel_err(a, b) for k, (a, b) in enumerate(zip(out.deepstack_embeds, ref_ds))},
        **{f"layer{k}": rel_err(out.layer_hidden_lbtd[k], ref_hidden[k]) for k in range(len(ref_hidden))},
        "logits": rel_err(out.logits_btv, ref_logits),
    }
    print("parity errors (max abs / max(1, max|ref|)):", errs)
    assert len(out.deepstack_embeds) == 2
    assert all(e < 2e-4 for e in errs.values()), errs
    # __call__ returns logits only, and accepts jax arrays as well as numpy.
    import jax.numpy as jnp
    logits = model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(pixels), jnp.asarray(grids))
    assert rel_err(logits, ref_logits) < 2e-4
    assert out.moe_aux.expert_counts.shape == (4, 7)


def test_text_only_tied_sparse_step(tmp_path):
    """Tied embeddings, decoder_sparse_step=2 (dense layers 0, 2), no images, left padding
    (the explicit-mask attention path), loop vs scan."""
    d = parity_hf_config(tie_word_embeddings=True, decoder_sparse_step=2, mlp_only_layers=[],
                         num_hidden_layers=4)
    hf = build_hf(d, tmp_path, seed=1)
    rng = np.random.default_rng(1)
    ids = rng.integers(10, 512, (2, 96))
    mask = np.ones_like(ids)
    mask[0, 80:] = 0
    mask[1, :9] = 0
    valid = mask.astype(bool)   # fully masked query rows are undefined in both implementations
    ref_logits, ref_hidden, _ = hf_forward(hf, ids, mask)
    model, cfg = load_hf(tmp_path)
    assert cfg.tie_word_embeddings and model.lm_head_dv is None
    out = model.forward(ids, mask, return_hidden=True)
    assert rel_err(np.asarray(out.logits_btv)[valid], ref_logits[valid]) < 2e-4
    assert max(rel_err(np.asarray(out.layer_hidden_lbtd[k])[valid], ref_hidden[k][valid]) for k in range(4)) < 2e-4
    from rm_jax.model import RuntimeOptions
    looped, _ = load_hf(tmp_path, runtime=RuntimeOptions(scan_layers=False, remat="full"))
    np.testing.assert_allclose(np.asarray(looped(ids, mask))[valid], np.asarray(out.logits_btv)[valid],
                               rtol=0, atol=1e-5)
