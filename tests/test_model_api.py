"""The convenience API caches its graph split; updates to the model must still be seen."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from rm_jax.model import registry


def test_cached_split_sees_in_place_updates_and_attribute_changes(tiny_cfg):
    from rm_jax.run_config import model_config, parse
    cfg = tiny_cfg.copy_and_resolve_references()
    cfg.model.text_config.num_hidden_layers = 2
    cfg.model.vision_config.depth = 1
    cfg.model.vision_config.deepstack_visual_indexes = (0,)
    model = registry.init_model(model_config(parse(cfg)))
    ids = np.arange(20, 52).reshape(2, 16)
    before = np.asarray(model(ids))
    assert model.split_cached() is model.split_cached()

    # In place (what nnx.update and optimizers do): the cached state holds the same Variables.
    head = model.lm_head_dv[...]
    nnx.update(model, nnx.State({"lm_head_dv": nnx.Param(jnp.zeros_like(head))}))
    np.testing.assert_array_equal(np.asarray(model(ids)), 0.0)

    # A new attribute value drops the cache.
    model.lm_head_dv = nnx.Param(head, out_sharding=("embed", "vocab"), eager_sharding=False)
    np.testing.assert_allclose(np.asarray(model(ids)), before, rtol=1e-6, atol=1e-6)


def test_takes_a_qwen_vl_processor_output_as_is(tiny_cfg):
    """``model(**inputs)`` on what a Qwen3-VL processor returns: its image processor's pixel_values
    and image_grid_thw, plus the mm_token_type_ids it adds by default, which the model checks
    against its own derivation. Videos are refused with a clear error."""
    import pytest
    import transformers
    from PIL import Image

    from rm_jax.run_config import model_config, parse
    cfg = tiny_cfg.copy_and_resolve_references()
    cfg.model.text_config.num_hidden_layers = 1
    mcfg = model_config(parse(cfg))
    model = registry.init_model(mcfg)
    vc = mcfg.vision
    image_processor = transformers.Qwen2VLImageProcessor(
        patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size, merge_size=vc.spatial_merge_size,
        size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64})
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, s, dtype=np.uint8)) for s in ((40, 72, 3), (64, 32, 3))]
    vision = image_processor(images=images, return_tensors="np")
    n_tokens = np.prod(vision["image_grid_thw"], -1) // vc.spatial_merge_size ** 2
    row = [30, mcfg.vision_start_token_id, *[mcfg.image_token_id] * n_tokens[0], mcfg.vision_end_token_id, 31,
           mcfg.vision_start_token_id, *[mcfg.image_token_id] * n_tokens[1], mcfg.vision_end_token_id, 32]
    ids = np.asarray([row, [40] * 5 + [0] * (len(row) - 5)])
    inputs = dict(input_ids=ids, attention_mask=(np.arange(len(row)) < np.asarray([[len(row)], [5]])).astype(np.int64),
                  pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"],
                  mm_token_type_ids=(ids == mcfg.image_token_id).astype(np.int64))
    logits = np.asarray(model(**inputs))
    without = {k: v for k, v in inputs.items() if k != "mm_token_type_ids"}
    np.testing.assert_array_equal(logits, np.asarray(model(**without)))
    assert logits.shape == (*ids.shape, mcfg.text.vocab_size) and np.isfinite(logits).all()

    wrong = dict(inputs, mm_token_type_ids=np.zeros_like(ids))
    with pytest.raises(ValueError, match="mm_token_type_ids disagrees"):
        model(**wrong)
    with pytest.raises(ValueError, match="video inputs"):
        model(**inputs, video_grid_thw=np.asarray([[2, 8, 8]]))
