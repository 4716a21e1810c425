"""Sharded == unsharded: the jitted forward on 8 emulated CPU devices under the meshes we run.

The params are loaded straight into their shardings (hf.load_hf(mesh=...)); the assertions on
``.sharding`` check that the logical rules really put experts on ``expert`` and weights on ``fsdp``.
"""

import numpy as np
import pytest

from rm_jax.model import RuntimeOptions, load_hf
from rm_jax.sharding import MeshShape, make_mesh
from hf_reference import IMAGE, VEND, VSTART, build_hf, parity_hf_config

MESHES = [
    (MeshShape(data=8), "ragged"),
    (MeshShape(fsdp=8), "ragged"),
    (MeshShape(data=2, expert=4), "ep_ring"),
    (MeshShape(expert=8), "ep_ring"),
]


def batch8(t=96):
    rng = np.random.default_rng(3)
    ids = rng.integers(10, 512, (8, t))
    grids = np.array([[1, 8, 4], [1, 4, 12]])      # two non-square images, rows 1 and 6
    for row, (_, h, w) in zip((1, 6), grids):
        n = h * w // 4
        ids[row, 19], ids[row, 20:20 + n], ids[row, 20 + n] = VSTART, IMAGE, VEND
    mask = np.ones_like(ids)
    mask[3, 70:] = 0
    pixels = rng.standard_normal((int(np.prod(grids, -1).sum()), 96)).astype(np.float32)
    return ids, mask, pixels, grids


@pytest.fixture(scope="module")
def setup(tmp_path_factory, devices8):
    path = tmp_path_factory.mktemp("hf_shard")
    build_hf(parity_hf_config(num_experts=8, num_hidden_layers=4), path)
    batch = batch8()
    model, _ = load_hf(path)
    ref = np.asarray(model(*batch))
    return path, batch, ref


@pytest.mark.parametrize("shape,backend", MESHES, ids=[str(m) + "-" + b for m, b in MESHES])
def test_sharded_equals_unsharded(setup, devices8, shape, backend):
    path, batch, ref = setup
    mesh = make_mesh(shape, devices=devices8, num_experts=8, global_batch=8)
    model, _ = load_hf(path, mesh=mesh, runtime=RuntimeOptions(moe_backend=backend))
    experts = model.decoder[-1].layers.mlp.wi_gate_edf[...]
    embed = model.embed_vd[...]
    def axes(spec):
        return {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}

    if shape.expert > 1:
        assert experts.sharding.spec[1] == "expert", experts.sharding
        assert "expert" in axes(embed.sharding.spec), embed.sharding   # ZeRO over the expert axis too
    if shape.fsdp > 1:
        assert "fsdp" in axes(embed.sharding.spec), embed.sharding
    out = model(*batch)
    assert out.shape == ref.shape
    np.testing.assert_allclose(np.asarray(out), ref, rtol=0, atol=2e-5 * max(1.0, np.abs(ref).max()))
