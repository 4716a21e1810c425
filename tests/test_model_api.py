"""The convenience API caches its graph split; updates to the model must still be seen."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rm_jax.model import judge


def test_cached_split_sees_in_place_updates_and_attribute_changes(tiny_cfg):
    from rm_jax.train.loop import model_config
    cfg = tiny_cfg.copy_and_resolve_references()
    cfg.model.text_config.num_hidden_layers = 2
    cfg.model.vision_config.depth = 1
    cfg.model.vision_config.deepstack_visual_indexes = (0,)
    model = judge.init_model(model_config(cfg))
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
