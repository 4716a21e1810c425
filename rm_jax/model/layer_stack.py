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
* **Gradients summed inside the scan** (``GradSink``, ``train.expert_grad_in_scan``): a stacked
  leaf may arrive as its master (e.g. fp32) together with a gradient accumulator. The scan casts
  one layer's master slice at a time, and its backward pass adds that layer's gradient into the
  accumulator's row in place, so a step holds neither a cast copy of the whole stack nor a
  gradient stack beside the accumulator (tests/test_grad_sink.py: equal to the plain path).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import flax.struct
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


@flax.struct.dataclass
class GradSink:
    """A stacked weight as ``LayerStack.apply`` takes it to sum its gradient into ``acc``.

    Differentiated with respect to ``acc``, the stack's gradient is ``acc`` + the loss's gradient
    for the weight: each layer's slice of ``master`` is cast to ``dtype`` inside the scan body (the
    cast the model would make at use), and the backward pass adds the slice's gradient (in
    ``dtype``, converted to ``acc``'s dtype) into ``acc``'s row, which the scan carries. ``master``
    itself gets no gradient."""
    master: jax.Array      # [L, ...] the stored weight
    acc: jax.Array         # [L, ...] the running gradient sum
    dtype: str = flax.struct.field(pytree_node=False)

    def __getitem__(self, _):
        raise TypeError("a GradSink weight is read only inside LayerStack.apply (train.expert_grad_in_scan needs "
                        "every routed-expert weight in a layer stack)")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _sink_slice(master_k, acc_lk, i, dtype):
    """Layer ``i``'s weight (its master slice cast to ``dtype``); ``acc_lk`` passes through, and
    the backward pass adds the weight's gradient into its row ``i``."""
    return master_k.astype(dtype), acc_lk


def _sink_slice_fwd(master_k, acc_lk, i, dtype):
    return (master_k.astype(dtype), acc_lk), i


def _sink_slice_bwd(dtype, i, cts):
    g_k, ct_lk = cts
    row = jax.lax.dynamic_index_in_dim(ct_lk, i, 0, keepdims=False)
    return None, jax.lax.dynamic_update_index_in_dim(ct_lk, row + g_k.astype(ct_lk.dtype), i, 0), None


_sink_slice.defvjp(_sink_slice_fwd, _sink_slice_bwd)


@jax.custom_vjp
def _seed_sinks(carry, accs):
    """``carry``; the accumulators' cotangent starts as their own value, so the backward scan's
    additions leave ``acc + gradient`` (no zero-initialised gradient stack beside ``acc``)."""
    return carry


_seed_sinks.defvjp(lambda carry, accs: (carry, accs), lambda accs, ct: (ct, accs))


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
        # GradSink leaves: the scan slices their masters; their accumulators ride in the carry.
        is_sink = lambda x: isinstance(x, GradSink)
        leaves, treedef = jax.tree.flatten(state, is_leaf=is_sink)
        sinks = [(k, x) for k, x in enumerate(leaves) if is_sink(x)]
        state = treedef.unflatten([x.master if is_sink(x) else x for x in leaves])

        def step(carry, inputs):
            layer_state, x, i = inputs
            layer_state = codec.decode(layer_state)
            if sinks:
                carry, accs = carry
                layer_leaves = treedef.flatten_up_to(layer_state)
                accs = list(accs)
                for j, (k, sink) in enumerate(sinks):
                    layer_leaves[k], accs[j] = _sink_slice(layer_leaves[k], accs[j], i, sink.dtype)
                carry, y = body(nnx.merge(graphdef, treedef.unflatten(layer_leaves)), carry, x)
                return (carry, tuple(accs)), y
            return body(nnx.merge(graphdef, layer_state), carry, x)

        if (codec is not IDENTITY_CODEC or sinks) and remat == "none":
            # The decoded (or cast) slice is recomputed in the backward pass, not saved: the scan's
            # residuals are then the encoded stack itself, not a second, decoded stack.
            step = jax.checkpoint(step, prevent_cse=False)

        if remat != "none":
            if remat not in REMAT_POLICIES:
                raise ValueError(f"remat={remat!r}; expected 'none' or one of {sorted(REMAT_POLICIES)}")
            step = jax.checkpoint(step, policy=REMAT_POLICIES[remat], prevent_cse=not scan)
        if sinks:
            carry = (carry, tuple(sink.acc for _, sink in sinks))
        layer_i = jnp.arange(self.n, dtype=jnp.int32)
        if scan and self.n > 1:
            carry, ys = jax.lax.scan(step, carry, (codec.encode(state), xs, layer_i))
        else:
            ys = []
            for i in range(self.n):
                carry, y = step(carry, jax.tree.map(lambda a: a[i], (state, xs, layer_i)))
                ys.append(y)
            ys = None if ys[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *ys)
        if sinks:
            carry = _seed_sinks(*carry)
        return carry, ys
