"""Mesh from config, early errors that name the numbers, and the logical-axis rules table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rm_jax import sharding


@pytest.mark.parametrize("shape", [dict(data=8), dict(fsdp=8), dict(data=2, expert=4), dict(expert=8),
                                   dict(data=2, fsdp=2, tensor=2)])
def test_mesh_from_config(devices8, shape):
    mesh = sharding.make_mesh(shape, num_experts=8)
    assert mesh.axis_names == sharding.MESH_AXES
    assert dict(mesh.shape) == {a: shape.get(a, 1) for a in sharding.MESH_AXES}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_mesh_errors_name_the_numbers(devices8):
    with pytest.raises(sharding.MeshConfigError, match=r"data=2, expert=2\).*= 4 devices but 8 devices"):
        sharding.make_mesh(dict(data=2, expert=2))
    with pytest.raises(sharding.MeshConfigError, match="num_experts=6 is not divisible by the mesh 'expert' axis size 4"):
        sharding.make_mesh(dict(data=2, expert=4), num_experts=6)
    with pytest.raises(sharding.MeshConfigError, match="batch 12 per step .* is not divisible by data\\*fsdp\\*expert"):
        sharding.make_mesh(dict(data=8), global_batch=12)


def test_wildcard_axis(devices8):
    assert dict(sharding.make_mesh(dict(data=-1, expert=2)).shape)["data"] == 4
    with pytest.raises(sharding.MeshConfigError, match="other axes multiply to 3"):
        sharding.make_mesh(dict(data=-1, expert=3))
    with pytest.raises(sharding.MeshConfigError, match="at most one axis may be -1"):
        sharding.make_mesh(dict(data=-1, expert=-1))


def test_rules_table():
    assert sharding.logical_to_spec(("exp", "embed", "mlp")) == P("expert", "fsdp", "tensor")
    assert sharding.logical_to_spec(("batch", "length", "act_embed")) == P(("data", "fsdp", "expert"), None, None)
    # a mesh axis is never used twice within one spec
    assert sharding.logical_to_spec(("batch", "exp")) == P(("data", "fsdp", "expert"), None)
    with pytest.raises(KeyError, match="not in the rules table"):
        sharding.logical_to_spec(("nonsense",))
    names = [n for n, _ in sharding.LOGICAL_RULES]
    assert len(names) == len(set(names)), "one entry per logical name"


def test_constrain_shards_and_tolerates_indivisible(devices8):
    mesh = sharding.make_mesh(dict(data=2, expert=4))
    with jax.set_mesh(mesh):
        f = jax.jit(lambda x: sharding.constrain(x * 2, ("batch", "length", "act_embed")))
        y = f(jnp.ones((8, 5, 3)))
        assert y.sharding.spec[0] == ("data", "fsdp", "expert") or y.sharding.spec[0] == ("data", "expert")
        z = jax.jit(lambda x: sharding.constrain(x, ("batch", "act_embed")))(jnp.ones((3, 4)))  # 3 % 8 != 0
        np.testing.assert_array_equal(np.asarray(z), np.ones((3, 4)))
    assert sharding.constrain(jnp.ones(2), ("batch",)).shape == (2,)   # no mesh: a no-op


def test_scoring_mesh_falls_back_when_the_run_mesh_does_not_fit(tiny_cfg):
    """A run trained on more devices than the scoring host has is scored data-parallel."""
    import jax
    from rm_jax.run_config import parse
    from rm_jax.score.checkpoints import scoring_mesh
    cfg = tiny_cfg.copy_and_resolve_references()
    cfg.mesh.data = 2 * jax.device_count()
    mesh = scoring_mesh(parse(cfg))
    assert mesh.devices.size == jax.device_count() and mesh.shape["data"] == jax.device_count()
