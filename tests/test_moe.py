"""MoE block: every backend equals the dense oracle (outputs and gradients), sharded equals
unsharded on emulated 8-device meshes, and the block and its load-balancing loss equal
transformers' Qwen3-VL-MoE in fp32."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from rm_jax.model.moe import MoeConfig, SparseMoeBlock, resolve_ragged_dot
from rm_jax.sharding import MeshShape, make_mesh

# Odd expert count, H != 2I, and a batch whose token count (2 * 6 = 12) no mesh here divides.
H, I = 24, 20
B, T = 2, 6
TOL = dict(rtol=1e-5, atol=1e-5)


def _routed_inputs(num_experts: int, seed: int = 0):
    """x and a router that starve expert E-1 and favour expert 0 (uneven, one zero-load expert).

    Feature 0 of x is a positive constant, so router row 0 acts as a per-expert bias.
    """
    kx, kr = jax.random.split(jax.random.key(seed))
    x_btd = jax.random.normal(kx, (B, T, H)).at[..., 0].set(2.0)
    router_de = 0.5 * jax.random.normal(kr, (H, num_experts))
    router_de = router_de.at[0, num_experts - 1].set(-20.0).at[0, 0].set(1.5)
    return x_btd, router_de


def _block(cfg: MoeConfig, router_de, seed: int = 1) -> SparseMoeBlock:
    block = SparseMoeBlock(cfg, rngs=nnx.Rngs(seed))
    block.router_de[...] = router_de
    return block


def _loss_fn(graphdef, backend):
    # A scalar that touches every output element differently, plus the aux losses.
    def loss(state, x_btd):
        y_btd, aux = nnx.merge(graphdef, state)(x_btd, backend=backend)
        probe_btd = jnp.sin(jnp.arange(y_btd.size, dtype=y_btd.dtype)).reshape(y_btd.shape)
        return jnp.sum(y_btd * probe_btd) + 0.1 * aux.lb_loss + 0.01 * aux.z_loss, (y_btd, aux)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _assert_trees_close(a, b):
    for (path, la), lb in zip(jax.tree.leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(la), np.asarray(lb), **TOL, err_msg=jax.tree_util.keystr(path))


def _reference(cfg, x_btd, router_de):
    """Dense backend without a mesh: outputs, aux and gradients every other case is held to."""
    graphdef, state = nnx.split(_block(cfg, router_de))
    (_, (y, aux)), grads = _loss_fn(graphdef, "dense")(state, x_btd)
    return y, aux, grads


@pytest.mark.parametrize("ragged_dot,tile_rows,max_tile_rows", [
    ("tokamax", 0, 0), ("lax", 0, 0),
    # Tiled: the automatic sizes (one 8-row tile per expert here); 1-row padding with windows of
    # 1, 2 and 4 rows (the largest fitting the mean group) or of up to 8 (several sizes per
    # expert, no padding); 2-row padding with one window size (groups spanning several windows).
    ("tiled", 0, 0), ("tiled", 1, 0), ("tiled", 1, 8), ("tiled", 2, 2),
], ids=lambda v: str(v))
def test_ragged_equals_dense(ragged_dot, tile_rows, max_tile_rows):
    cfg = MoeConfig(d_model=H, d_ff=I, num_experts=7, top_k=3, ragged_dot=ragged_dot, tile_rows=tile_rows,
                    max_tile_rows=max_tile_rows)
    x_btd, router_de = _routed_inputs(cfg.num_experts)
    y_ref, aux_ref, grads_ref = _reference(cfg, x_btd, router_de)

    counts = np.asarray(aux_ref.expert_counts)
    assert counts[-1] == 0, counts
    assert counts.sum() == B * T * cfg.top_k and counts.max() > 2 * counts[counts > 0].min(), counts

    graphdef, state = nnx.split(_block(cfg, router_de))
    (_, (y, aux)), grads = _loss_fn(graphdef, "ragged")(state, x_btd)
    np.testing.assert_allclose(y, y_ref, **TOL)
    _assert_trees_close(aux, aux_ref)
    _assert_trees_close(grads, grads_ref)
    # The starved expert receives no gradient; every other weight does.
    assert not np.any(grads[0]["wi_gate_edf"][...][-1]) and np.all(np.any(grads[0]["wo_efd"][...][:-1], axis=(1, 2)))


@pytest.mark.parametrize("shape", [
    MeshShape(expert=8),
    MeshShape(data=2, expert=4),
    MeshShape(fsdp=2, expert=4),
    MeshShape(data=2, expert=2, tensor=2),
    MeshShape(data=2, fsdp=4),              # FSDP-only experts: ep_ring falls back to ragged
], ids=str)
@pytest.mark.parametrize("ragged_dot", ["tiled", "tokamax"])
def test_sharded_equals_unsharded(devices8, shape, ragged_dot):
    cfg = MoeConfig(d_model=H, d_ff=I, num_experts=8, top_k=3, backend="ep_ring", ragged_dot=ragged_dot,
                    tile_rows=2 if ragged_dot == "tiled" else 0)
    x_btd, router_de = _routed_inputs(cfg.num_experts, seed=2)
    y_ref, aux_ref, grads_ref = _reference(cfg, x_btd, router_de)
    assert np.asarray(aux_ref.expert_counts)[-1] == 0

    mesh = make_mesh(shape, devices=devices8, num_experts=cfg.num_experts)
    with jax.set_mesh(mesh):
        graphdef, state = nnx.split(_block(cfg, router_de))
        # Weights are created sharded by their logical names through the one rules table.
        spec = nnx.get_partition_spec(state)["wi_gate_edf"].get_value()
        assert spec == P("expert", "fsdp", "tensor")
        assert state["wi_gate_edf"][...].sharding.spec == spec
        step = _loss_fn(graphdef, "ep_ring")
        # Ring EP is really used when the mesh has an expert axis (not the ragged fallback).
        assert ("reduce_scatter" in step.lower(state, x_btd).as_text()) == (shape.expert > 1)
        (_, (y, aux)), grads = step(state, x_btd)
    np.testing.assert_allclose(y, y_ref, **TOL)
    _assert_trees_close(aux, aux_ref)
    _assert_trees_close(grads, grads_ref)


def test_jit_with_param_shardings_under_mesh(devices8):
    """The train-step pattern: split once, jit a pure function with in_shardings from metadata."""
    cfg = MoeConfig(d_model=H, d_ff=I, num_experts=8, top_k=2, backend="ep_ring")
    x_btd, router_de = _routed_inputs(cfg.num_experts, seed=3)
    y_ref, _ = _block(cfg, router_de)(x_btd, backend="dense")
    mesh = make_mesh(MeshShape(fsdp=2, expert=4), devices=devices8, num_experts=cfg.num_experts)
    with jax.set_mesh(mesh):
        graphdef, state = nnx.split(_block(cfg, router_de))
        shardings = jax.tree.map(lambda p: jax.NamedSharding(mesh, p), nnx.get_partition_spec(state))
        x_sharding = jax.NamedSharding(mesh, P(("data", "fsdp"), None, None))
        fwd = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0], in_shardings=(shardings, x_sharding))
        y = fwd(state, jax.device_put(x_btd, x_sharding))
    np.testing.assert_allclose(y, y_ref, **TOL)


@pytest.mark.slow   # ~30 s of eager dispatch; the jitted sharded paths are tested by default
def test_eager_call_under_mesh(devices8):
    cfg = MoeConfig(d_model=H, d_ff=I, num_experts=8, top_k=3, backend="ep_ring")
    x_btd, router_de = _routed_inputs(cfg.num_experts, seed=4)
    y_ref, _ = _block(cfg, router_de)(x_btd, backend="dense")
    with jax.set_mesh(make_mesh(MeshShape(data=2, expert=4), devices=devices8)):
        y, _ = _block(cfg, router_de)(x_btd)
    np.testing.assert_allclose(y, y_ref, **TOL)


# --------------------------------------------------------------------------------------------
# transformers parity
# --------------------------------------------------------------------------------------------

def _torch():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return torch


def test_block_equals_transformers():
    torch = _torch()
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as hf
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig

    cfg = MoeConfig(d_model=H, d_ff=I, num_experts=7, top_k=3)
    x_btd, router_de = _routed_inputs(cfg.num_experts, seed=5)
    block = _block(cfg, router_de)

    hf_cfg = Qwen3VLMoeTextConfig(hidden_size=H, moe_intermediate_size=I, num_experts=cfg.num_experts,
                                  num_experts_per_tok=cfg.top_k, hidden_act="silu")
    hf_block = hf.Qwen3VLMoeTextSparseMoeBlock(hf_cfg).float()
    # Mapping (also documented on SparseMoeBlock): HF computes linear(x, W) = x @ W.T.
    #   gate.weight [E, H] = router_de.T; experts.gate_up_proj [E, 2I, H] = concat(gate, up).mT
    #   with gate rows first; experts.down_proj [E, H, I] = wo_efd.mT.
    as_t = lambda a: torch.from_numpy(np.array(a, dtype=np.float32))
    gate_up_efd = jnp.concatenate([block.wi_gate_edf[...], block.wi_up_edf[...]], axis=-1)
    with torch.no_grad():
        hf_block.gate.weight.copy_(as_t(block.router_de[...].T))
        hf_block.experts.gate_up_proj.copy_(as_t(jnp.swapaxes(gate_up_efd, 1, 2)))
        hf_block.experts.down_proj.copy_(as_t(jnp.swapaxes(block.wo_efd[...], 1, 2)))
        y_hf = hf_block(as_t(x_btd)).numpy()
        hf_logits, _, hf_experts = hf_block.gate(as_t(x_btd).reshape(-1, H))

    y, aux = block(x_btd)
    np.testing.assert_allclose(y, y_hf, **TOL)
    counts_hf = np.bincount(hf_experts.numpy().reshape(-1), minlength=cfg.num_experts)
    np.testing.assert_array_equal(aux.expert_counts, counts_hf)
    assert counts_hf[-1] == 0
    z_hf = torch.logsumexp(hf_logits, dim=-1).pow(2).mean().item()
    np.testing.assert_allclose(aux.z_loss, z_hf, rtol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_lb_loss_equals_transformers(masked):
    torch = _torch()
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    cfg = MoeConfig(d_model=H, d_ff=I, num_experts=7, top_k=3)
    x_btd, router_de = _routed_inputs(cfg.num_experts, seed=6)
    mask_bt = jnp.ones((B, T), jnp.int32).at[1, T - 2:].set(0) if masked else None
    block = _block(cfg, router_de)
    _, aux = block(x_btd, mask_bt=mask_bt)

    logits_te = np.array(x_btd.reshape(-1, H) @ router_de, dtype=np.float32)
    lb_hf = load_balancing_loss_func((torch.from_numpy(logits_te),), cfg.num_experts, cfg.top_k,
                                     None if mask_bt is None else torch.from_numpy(np.array(mask_bt)))
    np.testing.assert_allclose(aux.lb_loss, lb_hf.item(), rtol=1e-5)


def test_cross_layer_lb_loss_from_aux():
    """HF's model-level loss pools all layers; per-layer counts and prob means reproduce it."""
    torch = _torch()
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    cfg = MoeConfig(d_model=H, d_ff=I, num_experts=7, top_k=3)
    auxes, logits = [], []
    for seed in (7, 8):
        x_btd, router_de = _routed_inputs(cfg.num_experts, seed=seed)
        auxes.append(_block(cfg, router_de)(x_btd)[1])
        logits.append(torch.from_numpy(np.array(x_btd.reshape(-1, H) @ router_de, dtype=np.float32)))
    frac_e = jnp.mean(jnp.stack([a.expert_counts for a in auxes]), axis=0) / (B * T)
    prob_e = jnp.mean(jnp.stack([a.router_prob_mean for a in auxes]), axis=0)
    lb_hf = load_balancing_loss_func(tuple(logits), cfg.num_experts, cfg.top_k)
    np.testing.assert_allclose(cfg.num_experts * jnp.sum(frac_e * prob_e), lb_hf.item(), rtol=1e-5)


def test_tiled_is_the_cpu_default_and_exact_at_scale():
    """On CPU "auto" is the tiled grouped matmul (no XLA ragged_dot, which would do E times the
    work); on a larger, skewed routing with multi-tile groups and empty experts it equals the
    dense oracle, outputs and gradients."""
    assert MoeConfig(d_model=H, d_ff=I, num_experts=7, top_k=3).ragged_dot == "auto"
    assert resolve_ragged_dot("auto") == ("tiled" if jax.default_backend() == "cpu" else "tokamax")
    # The tiled matmul is named explicitly so this runs on any backend (on CPU it is "auto" too).
    cfg = MoeConfig(d_model=32, d_ff=16, num_experts=16, top_k=4, ragged_dot="tiled")
    kx, kr = jax.random.split(jax.random.key(9))
    x_btd = jax.random.normal(kx, (2, 64, 32)).at[..., 0].set(2.0)
    # Expert e gets bias -e/2 on the constant feature: loads fall off steeply; 12..15 get none.
    router_de = 0.3 * jax.random.normal(kr, (32, 16))
    router_de = router_de.at[0].set(-0.5 * jnp.arange(16.0)).at[0, 12:].set(-30.0)
    graphdef, state = nnx.split(_block(cfg, router_de))
    (_, (y_ref, aux_ref)), grads_ref = _loss_fn(graphdef, "dense")(state, x_btd)
    counts = np.asarray(aux_ref.expert_counts)
    assert np.all(counts[12:] == 0) and counts.max() > 4 * counts[counts > 0].min(), counts
    step = _loss_fn(graphdef, "ragged").lower(state, x_btd).compile()
    hlo = step.as_text().lower()  # XLA's CPU ragged_dot expansion would show up as ragged-dot ops
    assert "ragged" not in hlo and "while" in hlo
    (_, (y, aux)), grads = step(state, x_btd)
    np.testing.assert_allclose(y, y_ref, **TOL)
    _assert_trees_close(aux, aux_ref)
    _assert_trees_close(grads, grads_ref)
    assert not np.any(grads[0]["wi_up_edf"][...][12:])


def test_config_validation():
    with pytest.raises(ValueError, match="backend"):
        MoeConfig(d_model=H, d_ff=I, num_experts=7, top_k=3, backend="capacity")
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(MoeConfig(d_model=H, d_ff=I, num_experts=7, top_k=3), top_k=8)
    with pytest.raises(ValueError, match="ragged_dot"):
        MoeConfig(d_model=H, d_ff=I, num_experts=7, top_k=3, ragged_dot="megablocks")
    with pytest.raises(ValueError, match="tile_rows"):
        MoeConfig(d_model=H, d_ff=I, num_experts=7, top_k=3, tile_rows=6)
    with pytest.raises(ValueError, match="max_tile_rows"):
        MoeConfig(d_model=H, d_ff=I, num_experts=7, top_k=3, max_tile_rows=12)
