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
* **How a stacked leaf enters the scan** is one seam, a ``StackCodec`` named by the config
  (``train.stack_codec``, ``STACK_CODECS``): ``encode`` maps the stacked params before the scan,
  ``decode`` maps each layer's slice inside it. ``"none"`` is the identity; ``"bf16_bits"``
  (``bf16_bit_codec``) scans bf16 leaves as their bits, because XLA:CPU cannot slice a bf16 stack
  in place (it slices an f32 copy of the whole stack; a GPU slices bf16 directly, so there it
  costs nothing and changes nothing). Loss and gradients are bit-identical either way
  (tests/test_layer_stack_codec.py), so the memory plan compiles what training runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, NamedTuple, Sequence

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


@dataclasses.dataclass(frozen=True)
class StackCodec:
    """``encode(stacked_state) -> xs`` before ``lax.scan``; ``decode(layer_xs) -> layer_state`` in it."""
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


IDENTITY_CODEC = StackCodec(encode=lambda s: s, decode=lambda s: s)


def bf16_bit_codec() -> StackCodec:
    """A ``StackCodec`` that scans bf16 stacks as their bits, as a GPU slices them (for CPU plans).

    XLA:CPU has no bf16 data movement: float normalization turns the layer scan's ``dynamic-slice``
    of a bf16 stack into a slice of an f32 copy of the *whole* stack, and loop invariant code
    motion lifts those copies out of the layer and microbatch loops. Here every bf16 leaf whose last dim is even enters the scan packed two bf16 per f32
    word (a bitcast: no arithmetic, the same bytes), and each layer's slice is unpacked in the
    body. Both maps are custom_vjp pairs whose cotangents are the other map, so the weight
    gradients are exactly the unpacked ones (the scan only stacks the packed slices' cotangents;
    nothing adds them in packed form). ``LayerStack.apply`` checkpoints the scan body under a
    codec, so the decoded slices are recomputed in the backward pass instead of saved.
    """
    # The barriers keep XLA's simplifier from folding the bitcast pairs back into a bf16 stack.
    def pack_bits(w):
        p = jax.lax.bitcast_convert_type(w.reshape(*w.shape[:-1], w.shape[-1] // 2, 2), jnp.float32)
        return jax.lax.optimization_barrier(p)

    def unpack_bits(p):
        w = jax.lax.bitcast_convert_type(jax.lax.optimization_barrier(p), jnp.bfloat16)
        return w.reshape(*p.shape[:-1], p.shape[-1] * 2)

    pack, unpack = jax.custom_vjp(pack_bits), jax.custom_vjp(unpack_bits)
    pack.defvjp(lambda w: (pack_bits(w), None), lambda _, g: (unpack_bits(g),))
    unpack.defvjp(lambda p: (unpack_bits(p), None), lambda _, g: (pack_bits(g),))

    class Packed(NamedTuple):      # marks a leaf that travels packed (a pytree node, so scan slices it)
        bits: Any

    def packable(x) -> bool:
        return x.dtype == jnp.bfloat16 and x.ndim >= 2 and x.shape[-1] % 2 == 0

    def encode(state):
        return jax.tree.map(lambda x: Packed(pack(x)) if packable(x) else x, state)

    def decode(layer_state):
        return jax.tree.map(lambda x: unpack(x.bits) if isinstance(x, Packed) else x, layer_state,
                            is_leaf=lambda x: isinstance(x, Packed))

    return StackCodec(encode=encode, decode=decode)


# train.stack_codec -> codec (built once: jit caches key on the functions' identity)
STACK_CODECS: dict[str, StackCodec] = {"none": IDENTITY_CODEC, "bf16_bits": bf16_bit_codec()}


def stack_codec(name: str) -> StackCodec:
    if name not in STACK_CODECS:
        raise ValueError(f"train.stack_codec={name!r}; expected one of {sorted(STACK_CODECS)}")
    return STACK_CODECS[name]


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

    def apply(self, body: Callable, carry, xs=None, *, scan: bool = True, remat: str = "none",
              codec: str = "none"):
        """``body(layer, carry, x) -> (carry, y)`` over the stacked layers, like ``lax.scan``.

        ``xs`` is an optional pytree with a leading layer axis. Returns ``(carry, ys)`` with ys
        stacked on a leading layer axis (or None when body returns None). ``codec`` names how the
        stacked params enter the scan (``STACK_CODECS``; unrolled stacks need none).
        """
        graphdef, state = nnx.split(self.layers)
        codec = stack_codec(codec) if scan and self.n > 1 else IDENTITY_CODEC

        def step(carry, inputs):
            layer_state, x = inputs
            return body(nnx.merge(graphdef, codec.decode(layer_state)), carry, x)

        if codec is not IDENTITY_CODEC and remat == "none":
            # The decoded slice is recomputed in the backward pass, not saved: the scan's residuals
            # are then the encoded stack itself, not a second, decoded stack.
            step = jax.checkpoint(step, prevent_cse=False)

        if remat != "none":
            if remat not in REMAT_POLICIES:
                raise ValueError(f"remat={remat!r}; expected 'none' or one of {sorted(REMAT_POLICIES)}")
            step = jax.checkpoint(step, policy=REMAT_POLICIES[remat], prevent_cse=not scan)
        if scan and self.n > 1:
            return jax.lax.scan(step, carry, (codec.encode(state), xs))
        ys = []
        for i in range(self.n):
            sl = jax.tree.map(lambda a: a[i], (state, xs))
            carry, y = step(carry, sl)
            ys.append(y)
        ys = None if ys[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *ys)
        return carry, ys
