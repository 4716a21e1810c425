"""Decoder layers as records, grouped into scanned stacks.

Design choices:

* **A layer is described by a record**, ``LayerSpec(mixer, ffn)``: the token mixer
  (``"attention"`` or ``"gated_deltanet"``) and the feed-forward kind (``"dense"`` or ``"moe"``).
  Each architecture derives its specs from its config (Qwen3-VL: every layer attention, MoE where
  ``decoder_sparse_step``/``mlp_only_layers`` say; Qwen3.5: ``layer_types``), and nothing
  downstream reads the config's layer keys again.
* **Groups.** ``group_layers`` cuts the layer sequence into maximal runs of equal specs
  (``LayerGroup(start, end, spec)``); a layer listed in ``alone`` (Qwen3-VL's deepstack-receiving
  layers) is a run of its own. Each run is one ``LayerStack`` (scanned), so a 48-layer all-MoE
  model with 3 deepstack layers compiles 4 + 1 layer bodies, not 48, and the checkpoint key
  table places HF layer ``i`` by the same groups.
* **Layer stacks.** ``LayerStack`` holds ``n`` structurally identical layers as one module whose
  params have a leading layer axis (logical name ``None``: layers are never sharded). It applies
  them with ``jax.lax.scan`` over ``nnx.merge``-d slices, so compile time is flat in depth, and
  wraps the body in ``jax.checkpoint`` with a configurable policy. With ``scan=False`` it unrolls
  the same params in a Python loop (same checkpoint layout either way).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

MIXERS = ("attention", "gated_deltanet")
FFNS = ("dense", "moe")


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer is made of."""
    mixer: str       # "attention" | "gated_deltanet"
    ffn: str         # "dense" | "moe"

    def __post_init__(self):
        if self.mixer not in MIXERS:
            raise ValueError(f"LayerSpec.mixer={self.mixer!r}; expected one of {MIXERS}")
        if self.ffn not in FFNS:
            raise ValueError(f"LayerSpec.ffn={self.ffn!r}; expected one of {FFNS}")


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers ``[start, end)``, all with ``spec``: one scanned ``LayerStack``."""
    start: int
    end: int
    spec: LayerSpec

    @property
    def size(self) -> int:
        return self.end - self.start


def group_layers(specs: Sequence[LayerSpec], alone: Iterable[int] = ()) -> tuple[LayerGroup, ...]:
    """Maximal runs of equal consecutive specs; each layer in ``alone`` is a group by itself."""
    alone = frozenset(alone)
    out: list[LayerGroup] = []
    for i, spec in enumerate(specs):
        last = out[-1] if out else None
        if last is not None and last.spec == spec and i not in alone and last.start not in alone:
            out[-1] = LayerGroup(last.start, i + 1, spec)
        else:
            out.append(LayerGroup(i, i + 1, spec))
    return tuple(out)


def kind_offsets(groups: Sequence[LayerGroup]) -> tuple[int, ...]:
    """For each group, the index of its first layer among the layers with the same mixer: where
    its slice starts in a per-mixer stack of decode state (the KV cache holds attention layers
    only, the recurrent state GDN layers only)."""
    seen = {m: 0 for m in MIXERS}
    out = []
    for g in groups:
        out.append(seen[g.spec.mixer])
        seen[g.spec.mixer] += g.size
    return tuple(out)


REMAT_POLICIES: dict[str, Any] = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _prepend_layer_axis(var: nnx.Variable) -> nnx.Variable:
    names = var.get_metadata().get("out_sharding")
    if names:
        var.set_metadata(out_sharding=(None, *names))
    return var


class LayerStack(nnx.Module):
    """``n`` identical layers stored stacked; applied by ``lax.scan`` (or a loop)."""

    def __init__(self, make_layer: Callable[[nnx.Rngs], nnx.Module], n: int, *, rngs: nnx.Rngs):
        layers = [make_layer(rngs) for _ in range(n)]
        graphdef, first = nnx.split(layers[0])
        states = [first] + [nnx.split(layer)[1] for layer in layers[1:]]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
        stacked = jax.tree.map(_prepend_layer_axis, stacked, is_leaf=lambda v: isinstance(v, nnx.Variable))
        self.n = n
        self.layers = nnx.merge(graphdef, stacked)

    def apply(self, body: Callable, carry, xs=None, *, scan: bool = True, remat: str = "none"):
        """``body(layer, carry, x) -> (carry, y)`` over the stacked layers, like ``lax.scan``.

        ``xs`` is an optional pytree with a leading layer axis. Returns ``(carry, ys)`` with ys
        stacked on a leading layer axis (or None when body returns None).
        """
        graphdef, state = nnx.split(self.layers)

        def step(carry, inputs):
            layer_state, x = inputs
            return body(nnx.merge(graphdef, layer_state), carry, x)

        if remat != "none":
            if remat not in REMAT_POLICIES:
                raise ValueError(f"remat={remat!r}; expected 'none' or one of {sorted(REMAT_POLICIES)}")
            step = jax.checkpoint(step, policy=REMAT_POLICIES[remat], prevent_cse=not scan)
        if scan and self.n > 1:
            return jax.lax.scan(step, carry, (state, xs))
        ys = []
        for i in range(self.n):
            sl = jax.tree.map(lambda a: a[i], (state, xs))
            carry, y = step(carry, sl)
            ys.append(y)
        ys = None if ys[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *ys)
        return carry, ys
