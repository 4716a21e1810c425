"""Gated DeltaNet: kernels and layer against transformers' Qwen3.5-MoE reference, fp32.

Errors are max-abs differences relative to the reference's max-abs value. The reference kernels
agree with each other (chunked vs recurrent) to ~5e-7 at these sizes, so 1e-5 leaves room for
summation-order differences only; a wrong decay, mask or head mapping is O(1).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_mod
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

from rm_jax.model import gated_deltanet as gdn
from rm_jax.model.layers import GatedRMSNorm, ZeroCenteredRMSNorm
from rm_jax.sharding import logical_to_spec

TOL = 1e-5
B, G, H, K, V = 2, 2, 4, 16, 24      # value heads share key heads (R = 2); K != V


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def kernel_inputs(t, seed=0, b=B, state=True):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    x = dict(q=f(b, t, G, K), k=f(b, t, G, K), v=f(b, t, H, V),
             # log-decays like the layer's: -A * softplus(.), some strong, some near 0
             g=(-np.exp(f(b, t, H)) * np.logaddexp(0, f(b, t, H)) * 0.3).astype(np.float32),
             beta=(1 / (1 + np.exp(-f(b, t, H)))).astype(np.float32))
    s0 = 0.3 * f(b, H, K, V) if state else None
    return x, s0


def run_jax(fn, x, s0, **kw):
    out = jax.jit(lambda q, k, v, g, beta, s0: fn(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                  use_qk_l2norm=True, **kw))(**x, s0=s0)
    return [np.asarray(o) for o in out]


def run_torch(fn, x, s0, **kw):
    t = lambda a: None if a is None else torch.from_numpy(a)
    with torch.no_grad():
        o, s = fn(*(t(x[n]) for n in ("q", "k", "v", "g", "beta")), initial_state=t(s0),
                  output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
    return o.numpy(), s.numpy()


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("t,state", [(601, True), (640, False)])
def test_chunk_matches_transformers_and_recurrent(t, state):
    x, s0 = kernel_inputs(t, state=state)
    o, s = run_jax(gdn.chunk_gated_delta_rule, x, s0)
    o_ref, s_ref = run_torch(hf_mod.torch_chunk_gated_delta_rule, x, s0)
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL, (rel_err(o, o_ref), rel_err(s, s_ref))
    o_r, s_r = run_jax(gdn.recurrent_gated_delta_rule, x, s0)
    assert rel_err(o, o_r) < TOL and rel_err(s, s_r) < TOL, (rel_err(o, o_r), rel_err(s, s_r))


def test_recurrent_matches_transformers():
    x, s0 = kernel_inputs(520, seed=1)
    o, s = run_jax(gdn.recurrent_gated_delta_rule, x, s0)
    o_ref, s_ref = run_torch(hf_mod.torch_recurrent_gated_delta_rule, x, s0)
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL, (rel_err(o, o_ref), rel_err(s, s_ref))


def test_chunk_size_32_matches_recurrent():
    x, s0 = kernel_inputs(601, seed=2)
    o, s = run_jax(gdn.chunk_gated_delta_rule, x, s0, chunk_size=32)
    o_r, s_r = run_jax(gdn.recurrent_gated_delta_rule, x, s0)
    assert rel_err(o, o_r) < TOL and rel_err(s, s_r) < TOL, (rel_err(o, o_r), rel_err(s, s_r))


@pytest.mark.parametrize("fn", [gdn.chunk_gated_delta_rule, gdn.recurrent_gated_delta_rule])
def test_pads_are_identity_on_the_state(fn):
    """With pads anywhere (not only right), valid outputs and the final state equal a run over the
    valid tokens alone (by the recurrent rule, tested against both forms above): pads leave the
    state unchanged."""
    t = 300
    x, s0 = kernel_inputs(t, seed=3, b=1)
    rng = np.random.default_rng(4)
    valid = rng.random((1, t)) > 0.3
    valid[0, -20:] = False                                      # a right-padded tail as well
    both = np.concatenate([valid, np.ones_like(valid)])         # row 1: the same tokens, no mask
    x2 = {n: np.concatenate([a, a]) for n, a in x.items()}
    o, s = run_jax(fn, x2, np.concatenate([s0, s0]), valid_bt=jnp.asarray(both))
    keep = valid[0]
    xc = {n: a[:, keep] for n, a in x.items()}
    o_c, s_c = run_jax(gdn.recurrent_gated_delta_rule, xc, s0)
    assert rel_err(o[:1, keep], o_c) < TOL and rel_err(s[:1], s_c) < TOL
    assert rel_err(s[1:], s_c) > 1e-2                           # the check can fail: pads do move it


def test_unit_lower_inverse():
    rng = np.random.default_rng(5)
    a = np.tril(rng.standard_normal((3, 64, 64)), -1).astype(np.float32) * 0.1
    inv = np.asarray(jax.jit(gdn.unit_lower_inverse)(jnp.asarray(a)))
    ref = np.linalg.inv(np.eye(64) + a.astype(np.float64))
    assert rel_err(inv, ref) < TOL


def test_gradients_match_sequential():
    """jax.grad through the chunked form equals it through the token-by-token rule (with a pad
    mask, an initial state, and a loss on both outputs and final state)."""
    t = 150
    x, s0 = kernel_inputs(t, seed=6)
    valid = jnp.asarray(np.arange(t)[None, :] < np.array([[t], [101]]))
    rng = np.random.default_rng(7)
    w_o = jnp.asarray(rng.standard_normal((B, t, H, V)), jnp.float32)
    w_s = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)

    def loss(fn, args):
        o, s = fn(*args[:5], initial_state=args[5], output_final_state=True, use_qk_l2norm=True,
                  valid_bt=valid)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)

    args = tuple(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")) + (jnp.asarray(s0),)
    grads = jax.jit(jax.grad(lambda a: loss(gdn.chunk_gated_delta_rule, a)))(args)
    grads_ref = jax.jit(jax.grad(lambda a: loss(gdn.recurrent_gated_delta_rule, a)))(args)
    for name, gr, gr_ref in zip(("q", "k", "v", "g", "beta", "state"), grads, grads_ref):
        assert np.all(np.isfinite(np.asarray(gr))), name
        assert rel_err(gr, gr_ref) < TOL, (name, rel_err(gr, gr_ref))


# ---------------------------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------------------------

def test_norms_match_transformers():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 5, 24)).astype(np.float32)
    z = rng.standard_normal((3, 5, 24)).astype(np.float32)
    w = rng.standard_normal(24).astype(np.float32)

    ref = hf_mod.Qwen3_5MoeRMSNorm(24, eps=1e-6)
    ours = ZeroCenteredRMSNorm(24, 1e-6)
    gated_ref = hf_mod.Qwen3_5MoeRMSNormGated(24, eps=1e-6)
    gated = GatedRMSNorm(24, 1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w))
        gated_ref.weight.copy_(torch.from_numpy(w))
        y_ref = ref(torch.from_numpy(x)).numpy()
        yg_ref = gated_ref(torch.from_numpy(x), torch.from_numpy(z)).numpy()
    ours.weight[...] = jnp.asarray(w)
    gated.weight[...] = jnp.asarray(w)
    assert rel_err(ours(jnp.asarray(x)), y_ref) < 1e-6
    assert rel_err(gated(jnp.asarray(x), jnp.asarray(z)), yg_ref) < 1e-6


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------

D = 40


@pytest.fixture(scope="module")
def layers():
    """transformers' layer with random weights (incl. A_log, dt_bias, norm) and ours loaded from it."""
    hf_cfg = Qwen3_5MoeTextConfig(hidden_size=D, linear_num_key_heads=G, linear_num_value_heads=H,
                                  linear_key_head_dim=K, linear_value_head_dim=V, linear_conv_kernel_dim=4,
                                  num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    ref = hf_mod.Qwen3_5MoeGatedDeltaNet(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name in ("A_log", "dt_bias", "norm.weight"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name == "norm.weight" else 0.0))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    cfg = gdn.GatedDeltaNetConfig.from_hf(hf_cfg)
    ours = nnx.eval_shape(lambda: gdn.GatedDeltaNet(cfg, rngs=nnx.Rngs(0)))   # every param is loaded
    gdn.load_hf_tensors(ours, {k: v.detach().numpy() for k, v in ref.state_dict().items()})
    return ref, ours


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, params, x, valid, state):
    return nnx.merge(graphdef, params)(x, valid_bt=valid, state=state, return_state=True)


def _forward(layer, x, valid=None, state=None):
    """One jitted signature for every prefill in these tests (state and mask always passed), so
    equal shapes share one compile."""
    graphdef, params = nnx.split(layer)
    x = jnp.asarray(x)
    valid = jnp.ones(x.shape[:2], bool) if valid is None else jnp.asarray(valid)
    state = gdn.GatedDeltaNetState.zeros(layer.cfg, x.shape[0]) if state is None else state
    return _apply(graphdef, params, x, valid, state)


def test_layer_matches_transformers_right_padded(layers):
    ref, ours = layers
    t, lengths = 600, np.array([600, 300])
    rng = np.random.default_rng(9)
    x = rng.standard_normal((B, t, D)).astype(np.float32)      # pads hold garbage, not zeros
    mask = (np.arange(t)[None, :] < lengths[:, None])
    with torch.no_grad():
        y_ref = ref(torch.from_numpy(x), attention_mask=torch.from_numpy(mask.astype(np.int64))).numpy()
    y, st = _forward(ours, x, mask)
    y = np.asarray(y)
    for i, n in enumerate(lengths):
        assert rel_err(y[i, :n], y_ref[i, :n]) < TOL, (i, rel_err(y[i, :n], y_ref[i, :n]))
    # The padded row equals the unpadded row alone: outputs, recurrent state and conv state.
    y1, st1 = _forward(ours, x[[1, 1], :lengths[1]])   # [2, 300]: the prefill test's compile
    assert rel_err(y[1, :lengths[1]], np.asarray(y1)[0]) < TOL
    assert rel_err(st.recurrent_bhkv[1], st1.recurrent_bhkv[0]) < TOL
    np.testing.assert_array_equal(np.asarray(st.conv_bwc[1]), np.asarray(st1.conv_bwc[0]))


def test_prefill_continuation_and_decode_equal_full_forward(layers):
    """Right-padded prefixes of different lengths, then a chunked continuation from their state
    (shared-prefix prefill), then token-by-token decode steps: all equal one full forward."""
    _, ours = layers
    t, n_dec, seg = 594, 6, 300                # prefix and continuation both padded to `seg`
    prefix = np.array([300, 257])
    rng = np.random.default_rng(10)
    x = rng.standard_normal((B, t + n_dec, D)).astype(np.float32)
    y_full = np.asarray(_forward(ours, x)[0])

    x_pre = rng.standard_normal((B, seg, D)).astype(np.float32)
    for i, p in enumerate(prefix):
        x_pre[i, :p] = x[i, :p]
    _, st = _forward(ours, x_pre, np.arange(seg)[None, :] < prefix[:, None])

    cont = np.minimum(t - prefix, seg)                           # row 0 reaches t, row 1 stops short
    x_cont = rng.standard_normal((B, seg, D)).astype(np.float32)
    for i, p in enumerate(prefix):
        x_cont[i, :cont[i]] = x[i, p:p + cont[i]]
    y_cont, st = _forward(ours, x_cont, np.arange(seg)[None, :] < cont[:, None], st)
    y_cont = np.asarray(y_cont)
    for i, p in enumerate(prefix):
        assert rel_err(y_cont[i, :cont[i]], y_full[i, p:p + cont[i]]) < TOL, i

    # Decode continues each row from where its continuation stopped.
    pos = prefix + cont
    graphdef, params = nnx.split(ours)
    step = jax.jit(lambda params, x, st, valid: nnx.merge(graphdef, params).step(x, st, valid_b=valid))
    every = jnp.ones((B,), bool)
    rows = np.arange(B)
    for j in range(n_dec):
        y_j, st = step(params, jnp.asarray(x[rows, pos + j]), st, every)
        assert rel_err(y_j, y_full[rows, pos + j]) < TOL, j
    # A row that is not valid this step (finished) keeps its state exactly.
    _, st2 = step(params, jnp.asarray(x[:, 0]), st, jnp.asarray([True, False]))
    np.testing.assert_array_equal(np.asarray(st2.recurrent_bhkv[1]), np.asarray(st.recurrent_bhkv[1]))
    np.testing.assert_array_equal(np.asarray(st2.conv_bwc[1]), np.asarray(st.conv_bwc[1]))
    assert rel_err(st2.recurrent_bhkv[0], st.recurrent_bhkv[0]) > 1e-3


@pytest.mark.slow
def test_layer_gradients_chunked_equal_recurrent(layers):
    """Parameter gradients of the whole layer (right-padded batch) through the chunked kernel
    equal those through the token-by-token rule."""
    _, ours = layers
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal((B, 130, D)), jnp.float32)
    valid = jnp.asarray(np.arange(130)[None, :] < np.array([[130], [99]]))
    w = jnp.asarray(rng.standard_normal((B, 130, D)), jnp.float32)
    graphdef, params = nnx.split(ours)

    def grads(backend):
        def loss(p):
            layer = nnx.merge(graphdef, p)
            layer.cfg = dataclasses.replace(layer.cfg, backend=backend)   # same params, other kernel
            return jnp.sum(layer(x, valid_bt=valid) * w * valid[..., None])
        return jax.jit(jax.grad(loss))(params)

    g_chunk, g_rec = grads("xla"), grads("recurrent")
    flat, flat_ref = jax.tree.leaves(g_chunk), jax.tree.leaves(g_rec)
    assert len(flat) == 9
    for a, b in zip(flat, flat_ref):
        assert np.all(np.isfinite(np.asarray(a)))
        assert rel_err(a, b) < TOL, rel_err(a, b)


def test_param_layout_and_logical_axes(layers):
    """Every HF tensor has one param; every param's logical names are in the rules table."""
    _, ours = layers
    params = nnx.state(ours, nnx.Param)
    paths = {".".join(str(p) for p in path) for path, _ in nnx.to_flat_state(params)}
    assert paths == set(gdn.HF_PARAMS)
    for path, var in nnx.to_flat_state(params):
        names = var.get_metadata()["out_sharding"]
        assert len(names) == len(var.shape)
        logical_to_spec(names)                                  # raises on a name not in the table
    assert logical_to_spec(ours.in_proj_z_dhv.get_metadata()["out_sharding"])[0] == ("fsdp", "expert")


@pytest.mark.slow
def test_layer_sharded_equals_unsharded(layers, devices8):
    """Params placed by their logical names on (data=2, fsdp=4), activations constrained inside:
    the forward and its state equal the single-device run."""
    from jax.sharding import NamedSharding
    from rm_jax.sharding import MeshShape, make_mesh

    _, ours = layers
    rng = np.random.default_rng(13)
    x = rng.standard_normal((4, 200, D)).astype(np.float32)
    valid = np.arange(200)[None, :] < np.array([[200], [150], [77], [200]])
    y_ref, st_ref = _forward(ours, x, valid)

    mesh = make_mesh(MeshShape(data=2, fsdp=4), devices=devices8)
    graphdef, params = nnx.split(ours)
    placed = jax.tree.map(
        lambda v: jax.device_put(v[...], NamedSharding(mesh, logical_to_spec(v.get_metadata()["out_sharding"]))),
        params, is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert placed["in_proj_qkv_dc"].sharding.spec[0] == ("fsdp", "expert")   # D=40 splits 4 ways
    with jax.set_mesh(mesh):
        state0 = gdn.GatedDeltaNetState.zeros(ours.cfg, 4)
        y, st = _apply(graphdef, placed, jnp.asarray(x), jnp.asarray(valid), state0)
    assert rel_err(y, y_ref) < TOL
    assert rel_err(st.recurrent_bhkv, st_ref.recurrent_bhkv) < TOL
    assert rel_err(st.conv_bwc, st_ref.conv_bwc) < TOL
