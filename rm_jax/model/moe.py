"""Sparse Mixture-of-Experts block (Qwen3-VL-MoE / Qwen3-MoE), one interface, three backends.

The block computes exactly what transformers' ``Qwen3VLMoeTextSparseMoeBlock`` computes: router
logits, softmax over experts, top-k on the probabilities, top-k weights renormalized
(``norm_topk_prob``), expert MLP ``down(silu(gate(x)) * up(x))``, weighted sum over the k picks.
``SparseMoeBlock(x_btd) -> (y_btd, MoeAux)``; the backend is a config field with a per-call
override, so model code never branches on it.

Design choices:

* **Router in fp32.** Logits, softmax, top-k and renormalization run in fp32 whatever the
  activation dtype: in bf16 near-tied experts flip between runs and between backends, which makes
  routing (a discrete choice) irreproducible, and the z-loss squares the logsumexp so it needs the
  range. transformers computes the logits in the activation dtype and only the softmax in fp32;
  in fp32 (the parity tests) the two agree bit for bit on the routing.
* **Dropless sorted grouped matmul ("ragged", the default).** Each token is repeated top_k
  times, the assignments are stably sorted by expert id, and each expert's contiguous group goes
  through one grouped matmul. Shapes stay static (``tokens * top_k`` rows whatever the routing)
  and nothing is dropped: no capacity factor means no token silently loses an expert, so training
  equals inference equals transformers. The grouped matmul (``MoeConfig.ragged_dot``) is chosen
  per platform by default ("auto"): ``tokamax.ragged_dot`` off CPU (a Mosaic/Triton kernel on
  GPU); on CPU the tiled loop below, because XLA's CPU ``ragged_dot`` (which tokamax falls back
  to) is a masked dense matmul over all experts, E times the FLOPs. "tokamax", "lax"
  (``jax.lax.ragged_dot``) and "tiled" can be forced anywhere.
* **Tiled grouped matmul ("tiled", the CPU default).** Each expert's sorted group is padded to a
  multiple of ``tile_rows`` and covered by row windows of one expert each (sizes ``tile_rows`` ..
  ``max_tile_rows``); loops over the windows in use run the expert MLP on ``[rows, H]`` blocks with
  that expert's weights, under a custom VJP whose backward is the same loops. Exact, dropless,
  static buffers (``T*k + E*(tile_rows-1)`` rows); the work is the useful work plus under one small
  tile of padding per expert (``benchmarks/moe_flops.py`` measures it against a dense matmul).
* **Token-local sorting under a mesh.** A global argsort over batch-sharded tokens would gather
  every token on every device. Under a mesh the ragged computation therefore runs inside
  ``jax.shard_map``: each device sorts only its own tokens. Without expert parallelism the expert
  weights are all-gathered at use (FSDP-only experts, the measured winner on one 8-GPU host).
* **Ring expert parallelism ("ep_ring").** Each rank of the mesh axis ``expert`` holds E/ep
  experts. Tokens are all-gathered over ``expert``, every rank runs its local experts on the
  assignments routed to them (the others sort past the last group and contribute zero), and
  ``psum_scatter`` sums the partial outputs while handing each rank back its own tokens. Two
  bandwidth-optimal collectives with static shapes and no capacity: unlike an all-to-all
  dispatch it cannot drop tokens and needs no per-step size exchange. ``ragged_all_to_all`` is
  an experiment, not a default (docs/operations.md, "Meshes").
* **Tensor parallelism** splits the expert intermediate dim over ``tensor`` (logical ``mlp``);
  partial down-projections are summed with one ``psum``.
* **"dense"** evaluates every expert on every token: E/k times the FLOPs, but no sorting,
  gathering or collectives, so it is the oracle the other backends are tested against.

Aux statistics (load-balancing loss, z-loss, per-expert counts) are computed from the global
router outputs outside any ``shard_map``, so they are identical for every backend and mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
import tokamax
from absl import flags
from flax import nnx
from jax.sharding import PartitionSpec as P

from rm_jax.sharding import constrain, logical_to_spec

BACKENDS = ("dense", "ragged", "ep_ring")
# "auto": "tiled" when JAX's default backend is the CPU, "tokamax" otherwise.
RAGGED_DOT_IMPLS = ("auto", "tiled", "tokamax", "lax")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    d_model: int          # hidden size H
    d_ff: int             # per-expert intermediate size I (HF moe_intermediate_size)
    num_experts: int      # E
    top_k: int            # k (HF num_experts_per_tok)
    norm_topk_prob: bool = True
    backend: str = "ragged"         # "dense" (test oracle only) | "ragged" | "ep_ring"
    # Grouped-matmul implementation: "auto" (CPU -> "tiled", else "tokamax") | "tiled" | "tokamax"
    # | "lax". "tiled" pads groups to tile_rows and runs windows of up to max_tile_rows rows
    # (powers of two; 0 = chosen from the shapes, see tile_sizes).
    ragged_dot: str = "auto"
    tile_rows: int = 0
    max_tile_rows: int = 0

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"MoeConfig.backend={self.backend!r}; expected one of {BACKENDS}")
        if self.ragged_dot not in RAGGED_DOT_IMPLS:
            raise ValueError(f"MoeConfig.ragged_dot={self.ragged_dot!r}; expected one of {RAGGED_DOT_IMPLS}")
        for name in ("tile_rows", "max_tile_rows"):
            v = getattr(self, name)
            if v < 0 or v & (v - 1):
                raise ValueError(f"MoeConfig.{name}={v} must be 0 (auto) or a power of two")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoeConfig.top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")


@flax.struct.dataclass
class MoeAux:
    lb_loss: jax.Array          # scalar, unscaled Switch/Qwen load-balancing loss of this layer
    z_loss: jax.Array           # scalar, mean over tokens of logsumexp(router_logits)^2
    expert_counts: jax.Array    # [E] int32, token-assignments per expert (top-k counted)
    # [E] fp32 mean router probability per expert. transformers' loss for a whole model is
    # E * sum_e mean_l(counts_le / T) * mean_l(prob_le), not the mean of per-layer losses;
    # expert_counts and router_prob_mean of every layer reproduce it exactly.
    router_prob_mean: jax.Array | None = None


# --------------------------------------------------------------------------------------------
# Routing and aux statistics
# --------------------------------------------------------------------------------------------

def route(x_td: jax.Array, router_de: jax.Array, top_k: int, norm_topk_prob: bool):
    """fp32 logits [T, E], probabilities [T, E], top-k weights [T, k] and expert ids [T, k]."""
    logits_te = jnp.dot(x_td.astype(jnp.float32), router_de.astype(jnp.float32))
    logits_te = constrain(logits_te, ("tokens", None))
    probs_te = jax.nn.softmax(logits_te, axis=-1)
    # Top-k on the probabilities as transformers does. lax.top_k breaks exact ties towards the
    # lower expert id; torch.topk's tie order is unspecified (not index order, even on CPU), so
    # exactly tied experts (e.g. an all-zero router) may be picked differently, with equal weights.
    weights_tk, experts_tk = jax.lax.top_k(probs_te, top_k)
    if norm_topk_prob:
        weights_tk = weights_tk / jnp.sum(weights_tk, axis=-1, keepdims=True)
    return logits_te, probs_te, weights_tk, experts_tk.astype(jnp.int32)


def aux_stats(logits_te, probs_te, experts_tk, mask_t=None) -> MoeAux:
    """Aux losses over real tokens; ``mask_t`` (1 = token, 0 = padding) matches HF's masked branch."""
    num_experts = logits_te.shape[-1]
    mask_t = jnp.ones(logits_te.shape[:1], jnp.float32) if mask_t is None else mask_t.astype(jnp.float32)
    n_tokens = jnp.maximum(jnp.sum(mask_t), 1.0)
    mask_tk = jnp.broadcast_to(mask_t[:, None], experts_tk.shape)
    counts_e = jnp.zeros((num_experts,), jnp.float32).at[experts_tk.reshape(-1)].add(mask_tk.reshape(-1))
    prob_mean_e = jnp.sum(probs_te * mask_t[:, None], axis=0) / n_tokens
    lb_loss = num_experts * jnp.sum(counts_e / n_tokens * prob_mean_e)
    z_loss = jnp.sum(jax.nn.logsumexp(logits_te, axis=-1) ** 2 * mask_t) / n_tokens
    return MoeAux(lb_loss=lb_loss, z_loss=z_loss, expert_counts=counts_e.astype(jnp.int32),
                  router_prob_mean=prob_mean_e)


# --------------------------------------------------------------------------------------------
# Expert computation
# --------------------------------------------------------------------------------------------

def _ragged_dot(lhs_mk, rhs_ekn, group_sizes_e, impl: str):
    if impl == "tokamax":
        # tokamax reads absl flags and, if nothing parsed them yet, parses sys.argv itself, which
        # raises under non-absl entry points (pytest, notebooks). Its defaults are what we want;
        # an absl app.run started later still parses its own flags.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        return tokamax.ragged_dot(lhs_mk, rhs_ekn, group_sizes_e)
    return jax.lax.ragged_dot(lhs_mk, rhs_ekn, group_sizes_e)


def dense_experts(x_td, weights_tk, experts_tk, wi_gate_edf, wi_up_edf, wo_efd):
    """Oracle: every expert on every token, combined with the (mostly zero) routing weights."""
    gate_etf = jnp.einsum("td,edf->etf", x_td, wi_gate_edf)
    up_etf = jnp.einsum("td,edf->etf", x_td, wi_up_edf)
    out_etd = jnp.einsum("etf,efd->etd", jax.nn.silu(gate_etf) * up_etf, wo_efd)
    onehot_tke = jax.nn.one_hot(experts_tk, wi_gate_edf.shape[0], dtype=out_etd.dtype)
    combine_te = jnp.einsum("tk,tke->te", weights_tk.astype(out_etd.dtype), onehot_tke)
    return jnp.einsum("te,etd->td", combine_te, out_etd)


def sorted_experts(x_td, weights_tk, experts_tk, wi_gate_edf, wi_up_edf, wo_efd, *,
                   first_expert=0, impl: str = "auto", tile_rows: int = 0, max_tile_rows: int = 0):
    """Dropless grouped matmul over the experts held here: ids [first_expert, first_expert + E_local).

    Assignments to other experts get the sentinel key E_local, so the stable sort puts them after
    every local group. Those rows lie past sum(group_sizes): XLA's ragged_dot zero-fills them but a
    kernel need not, so they are zeroed explicitly. ``impl="tiled"`` hands over to ``tiled_experts``.
    """
    impl = resolve_ragged_dot(impl)
    if impl == "tiled":
        return tiled_experts(x_td, weights_tk, experts_tk, wi_gate_edf, wi_up_edf, wo_efd,
                             first_expert=first_expert, tile_rows=tile_rows, max_tile_rows=max_tile_rows)
    n_tokens, top_k = experts_tk.shape
    n_local = wi_gate_edf.shape[0]
    local_m = experts_tk.reshape(-1) - first_expert
    is_local_m = (local_m >= 0) & (local_m < n_local)
    key_m = jnp.where(is_local_m, local_m, n_local)
    order_m = jnp.argsort(key_m, stable=True)
    group_sizes_e = jnp.bincount(key_m, length=n_local + 1)[:n_local].astype(jnp.int32)

    x_md = x_td[order_m // top_k]
    gate_mf = _ragged_dot(x_md, wi_gate_edf, group_sizes_e, impl)
    up_mf = _ragged_dot(x_md, wi_up_edf, group_sizes_e, impl)
    out_md = _ragged_dot(jax.nn.silu(gate_mf) * up_mf, wo_efd, group_sizes_e, impl)
    out_md = jnp.where(is_local_m[order_m][:, None], out_md, 0)

    # Unsort with the inverse permutation (a gather) rather than a scatter-add of duplicates.
    n_rows = order_m.shape[0]
    inverse_m = jnp.zeros_like(order_m).at[order_m].set(jnp.arange(n_rows, dtype=order_m.dtype))
    out_tkd = out_md[inverse_m].reshape(n_tokens, top_k, -1)
    return jnp.einsum("tkd,tk->td", out_tkd, weights_tk.astype(out_tkd.dtype))


# --------------------------------------------------------------------------------------------
# Tiled grouped matmul (the CPU implementation)
# --------------------------------------------------------------------------------------------
#
# XLA's CPU ragged_dot multiplies every row by every expert and masks (E times the work). The tiled
# form pads each expert's sorted group up to a multiple of ``m`` rows (the smallest tile) and covers
# it with row windows that each belong to one expert: as many of the largest size (up to 512 rows)
# as fit, then at most one of each smaller power-of-two size (the binary digits of the rest). One
# loop per size runs the whole expert MLP on [size, H] @ W[e] with dynamically sliced weights, over
# the windows in use only (traced counts), so the work is the useful work plus < m padding rows per
# expert, and most of it runs as large matmuls (the CPU's matmul is ~1.5x faster at 512 rows than
# at 128). Buffers are static: T*k + E*(m-1) rows whatever the routing. Row movement (dispatch into
# the padded layout, combine back) is a gather both ways: the backward of each is a gather through
# the inverse map, never a scatter-add (XLA's CPU scatter is a serial loop). The loops have a custom
# VJP (a reverse-mode loop with a traced trip count cannot be derived automatically) that reuses
# the forward's gate/up activations and accumulates weight gradients per expert in fp32.

def resolve_ragged_dot(impl: str) -> str:
    """``"auto"`` -> ``"tiled"`` on CPU (XLA's CPU ragged_dot does E times the work), else ``"tokamax"``."""
    if impl == "auto":
        return "tiled" if jax.default_backend() == "cpu" else "tokamax"
    return impl


def tile_sizes(n_rows: int, n_groups: int, tile_rows: int = 0, max_tile_rows: int = 0) -> tuple[int, int]:
    """(smallest, largest) tile rows, powers of two; 0 = chosen from the mean group size g.

    Groups are padded to the smallest tile (about g/16, within [8, 64]: padding costs half a tile
    per expert on average); the largest (about g, within [smallest, 512]) carries most rows, since
    the CPU's matmul gets markedly faster up to ~512 rows while the loop step costs ~10-20 us.
    """
    pow2_floor = lambda v: 1 << (max(int(v), 1).bit_length() - 1)
    mean = max(n_rows // max(n_groups, 1), 1)
    small = tile_rows or min(max(pow2_floor(mean // 16), 8), 64)
    large = max_tile_rows or min(max(pow2_floor(mean), small), 512)
    return small, max(large, small)


def _varying_axes(a) -> frozenset:
    aval = jax.typeof(a)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", frozenset())
    return frozenset(vma)


def _match_varying(*arrays):
    """Cast every array to the union of their varying manual mesh axes.

    Inside ``shard_map`` loop carries and custom-VJP cotangents must carry the same varying-axes
    type as the values they meet; outside one (or with nothing varying) this is the identity.
    Autodiff transposes the cast into the ``psum`` that sums, e.g., per-token-shard weight
    gradients.
    """
    union = frozenset().union(*map(_varying_axes, arrays))
    out = []
    for a in arrays:
        missing = union - _varying_axes(a)
        out.append(jax.lax.pcast(a, tuple(sorted(missing)), to="varying") if missing else a)
    return tuple(out)


@jax.custom_vjp
def _dispatch_rows(x_td, row_token_p, pos_tk):
    """x_pd[p] = x_td[row_token_p[p]]; the index n_tokens (padding rows) gives a zero row."""
    x_td = jnp.concatenate([x_td, jnp.zeros_like(x_td[:1])])
    return jnp.take(x_td, row_token_p, axis=0, mode="clip")  # cheaper than mode="fill" on CPU


def _dispatch_rows_fwd(x_td, row_token_p, pos_tk):
    return _dispatch_rows(x_td, row_token_p, pos_tk), pos_tk


def _dispatch_rows_bwd(pos_tk, dx_pd):
    n_tokens = pos_tk.shape[0]
    # Every token's k assignments sit at pos_tk[t] (the zero last row for another rank's expert):
    # gather them and sum, no scatter-add.
    dx_tkd = jnp.take(dx_pd, pos_tk.reshape(-1), axis=0, mode="clip")
    return dx_tkd.reshape(n_tokens, -1, dx_pd.shape[-1]).sum(axis=1), None, None


_dispatch_rows.defvjp(_dispatch_rows_fwd, _dispatch_rows_bwd)


@jax.custom_vjp
def _combine_rows(y_pd, pos_m, assign_p):
    """y_md[a] = y_pd[pos_m[a]]; positions are in range and the last row of y_pd is zero."""
    return jnp.take(y_pd, pos_m, axis=0, mode="clip")


def _combine_rows_fwd(y_pd, pos_m, assign_p):
    return _combine_rows(y_pd, pos_m, assign_p), assign_p


def _combine_rows_bwd(assign_p, dy_md):
    # pos_m is injective on the rows it hits: the transpose is the gather through its inverse
    # (assign_p = n_assign, out of range, for padding rows: zero).
    return jnp.take(dy_md, assign_p, axis=0, mode="fill", fill_value=0), None, None


_combine_rows.defvjp(_combine_rows_fwd, _combine_rows_bwd)


def _tiled_mlp_loop(sizes, x_pd, wgu_edf, wo_efd, plan, save_hidden):
    """One loop per tile size over that size's windows (start row, expert), chained on the carry."""
    n_rows = x_pd.shape[0]
    f = wo_efd.shape[1]
    # The output overwrites the input window by window (windows are disjoint and each reads its
    # rows before writing them), so no zero-filled output buffer is written first; rows outside
    # every window are padding, zero in x_pd, and stay zero.
    y_pd, *hidden = _match_varying(x_pd, *((jnp.zeros((n_rows, 2 * f), x_pd.dtype),) if save_hidden else ()))
    carry = (y_pd, hidden)
    for m, (start_w, expert_w, count) in zip(sizes, plan):
        def body(i, carry, m=m, start_w=start_w, expert_w=expert_w):
            y_pd, hidden = carry
            e, row = expert_w[i], start_w[i]
            hu_mf = jax.lax.dynamic_slice_in_dim(y_pd, row, m) @ wgu_edf[e]
            y_md = (jax.nn.silu(hu_mf[:, :f]) * hu_mf[:, f:]) @ wo_efd[e]
            y_pd = jax.lax.dynamic_update_slice_in_dim(y_pd, y_md, row, 0)
            if save_hidden:
                hidden = [jax.lax.dynamic_update_slice_in_dim(hidden[0], hu_mf, row, 0)]
            return y_pd, hidden

        carry = jax.lax.fori_loop(0, count, body, carry)
    return carry


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def tiled_expert_mlp(sizes, x_pd, wgu_edf, wo_efd, plan):
    """``down(silu(gate) * up)``, ``[gate | up] = x @ wgu[e]``, on row windows of ``x_pd``.

    ``plan[j] = (start_w, expert_w, count)``: windows ``[start_w[i], start_w[i] + sizes[j])``,
    i < count, belong to expert ``expert_w[i]``. Rows outside every window pass through unchanged
    (identity, gradient included); ``tiled_experts`` keeps them zero (padding).
    """
    return _tiled_mlp_loop(sizes, x_pd, wgu_edf, wo_efd, plan, False)[0]


def _tiled_expert_mlp_fwd(sizes, x_pd, wgu_edf, wo_efd, plan):
    y_pd, (hu_pf,) = _tiled_mlp_loop(sizes, x_pd, wgu_edf, wo_efd, plan, True)
    return y_pd, (x_pd, wgu_edf, wo_efd, plan, hu_pf)


def _tiled_expert_mlp_bwd(sizes, res, dy_pd):
    x_pd, wgu_edf, wo_efd, plan, hu_pf = res
    f = wo_efd.shape[1]
    f32 = jnp.float32
    # dx overwrites dy window by window, as y overwrites x in the forward (outside the windows the
    # map is the identity, so dx = dy there). x_pd joins only to unify the varying mesh axes.
    dx_pd, _, *dw = _match_varying(dy_pd, x_pd, *(jnp.zeros(w.shape, f32) for w in (wgu_edf, wo_efd)))
    carry = (dx_pd, *dw)
    for m, (start_w, expert_w, count) in zip(sizes, plan):
        def body(i, carry, m=m, start_w=start_w, expert_w=expert_w):
            dx_pd, dwgu, dwo = carry
            e, row = expert_w[i], start_w[i]
            x_md, hu_mf, dy_md = (jax.lax.dynamic_slice_in_dim(a, row, m) for a in (x_pd, hu_pf, dx_pd))
            h_mf, u_mf = hu_mf[:, :f], hu_mf[:, f:]
            sig_mf = jax.nn.sigmoid(h_mf)
            act_mf = h_mf * sig_mf
            da_mf = dy_md @ wo_efd[e].T
            dsilu_mf = sig_mf * (1 + h_mf * (1 - sig_mf))
            dhu_mf = jnp.concatenate([da_mf * u_mf * dsilu_mf, da_mf * act_mf], -1)
            dx_pd = jax.lax.dynamic_update_slice_in_dim(dx_pd, dhu_mf @ wgu_edf[e].T, row, 0)
            acc = lambda dw, a, b: jax.lax.dynamic_update_index_in_dim(
                dw, dw[e] + jnp.dot(a.T, b, preferred_element_type=f32), e, 0)
            return dx_pd, acc(dwgu, x_md, dhu_mf), acc(dwo, act_mf * u_mf, dy_md)

        carry = jax.lax.fori_loop(0, count, body, carry)
    dx_pd, dwgu, dwo = carry
    return dx_pd, dwgu.astype(wgu_edf.dtype), dwo.astype(wo_efd.dtype), jax.tree.map(lambda _: None, plan)


tiled_expert_mlp.defvjp(_tiled_expert_mlp_fwd, _tiled_expert_mlp_bwd)


def tile_plan(units_e, row_start_e, tile_rows: int, n_levels: int, max_units: int):
    """Cover every expert's padded group (``units_e`` tiles of ``tile_rows`` from ``row_start_e``)
    with windows of ``tile_rows * 2**j`` rows, j < n_levels: as many of the largest as fit, then
    the binary digits of the rest, so at most one window per expert of every smaller size.

    Returns (window sizes, per size (start row [W], expert [W], count)); W is static:
    ``max_units // 2**(n_levels-1) + E`` for the largest size (``max_units`` bounds sum(units_e)),
    E for the others.
    """
    n_groups = units_e.shape[0]
    top = n_levels - 1
    sizes, plan = [], []
    # Largest windows: units_e >> top of them per expert, back to back from the group start.
    n_top_e = units_e >> top
    end_e = jnp.cumsum(n_top_e)
    w = jnp.arange(max_units // (1 << top) + n_groups, dtype=jnp.int32)
    e_w = jnp.minimum(jnp.searchsorted(end_e, w, side="right"), n_groups - 1).astype(jnp.int32)
    start_w = row_start_e[e_w] + (w - (end_e[e_w] - n_top_e[e_w])) * (tile_rows << top)
    sizes.append(tile_rows << top)
    plan.append((start_w.astype(jnp.int32), e_w, end_e[-1]))
    # Smaller windows: bit j of units_e, placed after the bits above it.
    for j in reversed(range(top)):
        has_e = (units_e >> j) & 1
        # Experts that have one, first (a stable sort on 1 - has keeps expert order).
        e_w = jnp.argsort(1 - has_e, stable=True).astype(jnp.int32)
        start_e = row_start_e + ((units_e >> (j + 1)) << (j + 1)) * tile_rows
        sizes.append(tile_rows << j)
        plan.append((start_e[e_w].astype(jnp.int32), e_w, jnp.sum(has_e)))
    return tuple(sizes), tuple(plan)


def tiled_experts(x_td, weights_tk, experts_tk, wi_gate_edf, wi_up_edf, wo_efd, *,
                  first_expert=0, tile_rows: int = 0, max_tile_rows: int = 0):
    """``sorted_experts`` with the tiled grouped matmul: same contract, exact, static shapes."""
    n_tokens, top_k = experts_tk.shape
    n_local = wi_gate_edf.shape[0]
    n_assign = n_tokens * top_k
    m, m_max = tile_sizes(n_assign, n_local, tile_rows, max_tile_rows)
    n_levels = (m_max // m).bit_length()
    max_units = -(-(n_assign + n_local * (m - 1)) // m)
    n_rows = max_units * m  # the buffers have one more row, always zero: the target of "nowhere"

    local_m = experts_tk.reshape(-1) - first_expert
    key_m = jnp.where((local_m >= 0) & (local_m < n_local), local_m, n_local)
    arange_m = jnp.arange(n_assign, dtype=jnp.int32)
    if (n_local + 1) * n_assign < 2 ** 31:
        # Stable sort by expert as one unstable sort of unique int32 keys (several times faster
        # on CPU than a two-operand stable argsort).
        packed_m = jax.lax.sort(key_m * n_assign + arange_m)
        order_m, key_sorted_m = packed_m % n_assign, packed_m // n_assign
    else:
        order_m = jnp.argsort(key_m, stable=True)
        key_sorted_m = key_m[order_m]
    sizes_e = jnp.bincount(key_m, length=n_local + 1)[:n_local].astype(jnp.int32)
    units_e = (sizes_e + m - 1) // m
    start_e = jnp.cumsum(sizes_e) - sizes_e
    pstart_e = (jnp.cumsum(units_e) - units_e) * m
    # Padded-layout row of every assignment; assignments to other ranks' experts go to the zero row.
    key_c = jnp.minimum(key_sorted_m, n_local - 1)
    pos_sorted_m = jnp.where(key_sorted_m < n_local, pstart_e[key_c] + arange_m - start_e[key_c], n_rows)
    pos_m = jnp.zeros((n_assign,), jnp.int32).at[order_m].set(pos_sorted_m, unique_indices=True)
    # Inverse map: assignment of every padded row (n_assign = none, whose token n_tokens is the zero row).
    # Other ranks' assignments (pos n_rows) are dropped, so the shared last row stays "none": zero
    # in x_pd, hence in y_pd (which overwrites x_pd in place), and zero in the cotangent.
    assign_p = jnp.full((n_rows + 1,), n_assign, jnp.int32).at[
        jnp.where(pos_m < n_rows, pos_m, n_rows + 1)].set(arange_m, mode="drop", unique_indices=True)
    sizes, plan = tile_plan(units_e, pstart_e, m, n_levels, max_units)

    x_pd = _dispatch_rows(*_match_varying(x_td, assign_p // top_k, pos_m.reshape(n_tokens, top_k)))
    # Gate and up as one [H, 2I] matmul per tile (one concatenation per call, split by autodiff).
    wgu_edf = jnp.concatenate([wi_gate_edf, wi_up_edf], axis=-1)
    x_pd, wgu_edf, wo_efd, *plan_flat = _match_varying(x_pd, wgu_edf, wo_efd, *jax.tree.leaves(plan))
    plan = jax.tree.unflatten(jax.tree.structure(plan), plan_flat)
    y_pd = tiled_expert_mlp(sizes, x_pd, wgu_edf, wo_efd, plan)
    y_tkd = _combine_rows(*_match_varying(y_pd, pos_m, assign_p)).reshape(n_tokens, top_k, -1)
    return jnp.einsum("tkd,tk->td", y_tkd, weights_tk.astype(y_tkd.dtype))

def _mesh_or_none():
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return None
    return mesh


def sharded_experts(x_td, weights_tk, experts_tk, wi_gate_edf, wi_up_edf, wo_efd, *, mesh,
                    expert_parallel: bool, impl: str, tile_rows: int = 0, max_tile_rows: int = 0):
    """Run ``sorted_experts`` per token shard under ``shard_map``; optionally ring EP over ``expert``."""
    num_experts, _, d_ff = wi_gate_edf.shape
    token_axes = logical_to_spec(("tokens",))[0]
    token_axes = (token_axes,) if isinstance(token_axes, str) else tuple(token_axes)
    ep = mesh.shape["expert"] if expert_parallel else 1
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by the mesh 'expert' axis size {ep}")
    # The intermediate dim is split over `tensor` only when it divides; otherwise each tensor rank
    # computes the full expert (correct, merely redundant).
    tp_axis = logical_to_spec(("mlp",))[0]
    tp = mesh.shape[tp_axis] if tp_axis is not None and d_ff % mesh.shape[tp_axis] == 0 else 1
    tp_axis = tp_axis if tp > 1 else None
    exp_axis = "expert" if ep > 1 else None

    # Pad the token count to the number of token shards; padded rows carry zero routing weight.
    n_shards = math.prod(mesh.shape[a] for a in token_axes)
    n_tokens = x_td.shape[0]
    pad = -n_tokens % n_shards
    if pad:
        x_td = jnp.pad(x_td, ((0, pad), (0, 0)))
        weights_tk = jnp.pad(weights_tk, ((0, pad), (0, 0)))
        experts_tk = jnp.pad(experts_tk, ((0, pad), (0, 0)))

    def local(x_td, weights_tk, experts_tk, wi_gate_edf, wi_up_edf, wo_efd):
        first_expert = 0
        if exp_axis:
            x_td, weights_tk, experts_tk = (jax.lax.all_gather(a, exp_axis, axis=0, tiled=True)
                                            for a in (x_td, weights_tk, experts_tk))
            first_expert = jax.lax.axis_index(exp_axis) * (num_experts // ep)
        y_td = sorted_experts(x_td, weights_tk, experts_tk, wi_gate_edf, wi_up_edf, wo_efd,
                              first_expert=first_expert, impl=impl, tile_rows=tile_rows,
                              max_tile_rows=max_tile_rows)
        if exp_axis:
            y_td = jax.lax.psum_scatter(y_td, exp_axis, scatter_dimension=0, tiled=True)
        if tp_axis:
            y_td = jax.lax.psum(y_td, tp_axis)
        return y_td

    tokens = P(token_axes, None)
    y_td = jax.shard_map(
        local, mesh=mesh,
        in_specs=(tokens, tokens, tokens, P(exp_axis, None, tp_axis), P(exp_axis, None, tp_axis),
                  P(exp_axis, tp_axis, None)),
        out_specs=tokens,
    )(x_td, weights_tk, experts_tk, wi_gate_edf, wi_up_edf, wo_efd)
    return y_td[:n_tokens]


# --------------------------------------------------------------------------------------------
# Module
# --------------------------------------------------------------------------------------------

def _param(init, key, shape, param_dtype, names):
    # Logical names stay in the metadata; sharding_rules lets flax map them to mesh axes
    # (nnx.get_partition_spec gives the jit shardings). The rules are this parameter's names
    # resolved once through the one table by logical_to_spec, which never uses a mesh axis twice
    # (`embed` maps to (fsdp, expert), and expert weights take `expert` for `exp` first); flax's
    # own mapping would repeat it. Created under a mesh, the value is sharded at once; without one
    # there is nothing to shard onto.
    rules = tuple((n, a) for n, a in zip(names, logical_to_spec(names)) if n is not None)
    return nnx.Param(init(key, shape, param_dtype), out_sharding=names, sharding_rules=rules,
                     eager_sharding=_mesh_or_none() is not None)


class SparseMoeBlock(nnx.Module):
    """Qwen3-VL-MoE sparse MoE block: ``(y_btd, MoeAux) = block(x_btd)``.

    HF layout (transformers 5.x, ``Qwen3VLMoeTextExperts``) -> ours:
      mlp.gate.weight           [E, H]     -> router_de   = weight.T                    [H, E]
      mlp.experts.gate_up_proj  [E, 2I, H] -> wi_gate_edf = gate_up_proj[:, :I, :].mT   [E, H, I]
                                              wi_up_edf   = gate_up_proj[:, I:, :].mT   [E, H, I]
      mlp.experts.down_proj     [E, H, I]  -> wo_efd      = down_proj.mT                [E, I, H]
    (gate rows first: HF does ``linear(x, gate_up_proj[e]).chunk(2, dim=-1)`` -> gate, up.)
    Published Qwen3-VL-MoE safetensors store gate_up_proj as [E, H, 2I] (x @ W orientation):
    there wi_gate_edf = W[..., :I] and wi_up_edf = W[..., I:], and down_proj [E, I, H] is wo_efd.
    """

    def __init__(self, cfg: MoeConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        h, f, e = cfg.d_model, cfg.d_ff, cfg.num_experts
        # Fan-in scaling per expert (dims 0 is the expert batch axis) keeps activations O(1).
        init = jax.nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        router_init = jax.nn.initializers.lecun_normal(in_axis=0, out_axis=1)
        self.router_de = _param(router_init, rngs.params(), (h, e), param_dtype, ("embed", None))
        self.wi_gate_edf = _param(init, rngs.params(), (e, h, f), param_dtype, ("exp", "embed", "mlp"))
        self.wi_up_edf = _param(init, rngs.params(), (e, h, f), param_dtype, ("exp", "embed", "mlp"))
        self.wo_efd = _param(init, rngs.params(), (e, f, h), param_dtype, ("exp", "mlp", "embed"))

    def __call__(self, x_btd: jax.Array, *, backend: str | None = None,
                 mask_bt: jax.Array | None = None) -> tuple[jax.Array, MoeAux]:
        """``mask_bt`` (optional, 1 = real token) only restricts the aux statistics, as HF does."""
        cfg = self.cfg
        backend = backend or cfg.backend
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
        b, t, d = x_btd.shape
        x_td = constrain(x_btd.reshape(b * t, d), ("tokens", "act_embed"))
        logits_te, probs_te, weights_tk, experts_tk = route(
            x_td, self.router_de[...], cfg.top_k, cfg.norm_topk_prob)
        aux = aux_stats(logits_te, probs_te, experts_tk, None if mask_bt is None else mask_bt.reshape(-1))

        x_td = x_td.astype(self.dtype)
        # HF casts the renormalized routing weights to the activation dtype before weighting.
        weights_tk = weights_tk.astype(self.dtype)
        experts = tuple(w[...].astype(self.dtype) for w in (self.wi_gate_edf, self.wi_up_edf, self.wo_efd))
        mesh = _mesh_or_none()
        if backend == "dense":
            y_td = dense_experts(x_td, weights_tk, experts_tk, *experts)
        elif mesh is None:
            y_td = sorted_experts(x_td, weights_tk, experts_tk, *experts, impl=cfg.ragged_dot,
                                  tile_rows=cfg.tile_rows, max_tile_rows=cfg.max_tile_rows)
        else:
            expert_parallel = backend == "ep_ring" and mesh.shape["expert"] > 1
            y_td = sharded_experts(x_td, weights_tk, experts_tk, *experts, mesh=mesh,
                                   expert_parallel=expert_parallel, impl=cfg.ragged_dot,
                                   tile_rows=cfg.tile_rows, max_tile_rows=cfg.max_tile_rows)
        y_btd = constrain(y_td.reshape(b, t, d), ("batch", "length", "act_embed"))
        return y_btd, aux
