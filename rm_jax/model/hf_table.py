"""The vocabulary of an HF key table: rules, transforms, targets, and their expansion over one
model's layers. Each architecture writes its table in these words (``rm_jax.model.<arch>.params``);
``rm_jax.model.hf_checkpoint`` applies it.

Design choices:

* **A rule is data.** ``Rule`` names one HF key pattern, the rm_jax param path(s) it fills and the
  ``Transform`` between them; ``expand_rules`` turns the patterns into every concrete key of one
  config, each with its ``Target``\\ s (param path, and the layer index inside a scanned stack).
  Where a decoder layer lives in the stack is the architecture's (a ``LayerSlot`` per layer), so
  one expansion serves every layer placement.
* **Transforms are pairs of pure numpy functions** (HF -> ours, ours -> HF) and exact inverses of
  each other (transposes and reshapes only), so HF -> rm_jax -> HF reproduces every tensor bit for
  bit in the checkpoint's dtype. The ones more than one architecture needs (attention heads, the
  fused experts) live here, not in one architecture's table.
* **Fused expert tensors** come in two on-disk layouts: published Qwen3-VL checkpoints store
  ``gate_up_proj`` as ``[E, H, 2I]`` and ``down_proj`` as ``[E, I, H]`` ("in_out"); transformers'
  ``save_pretrained`` and the published Qwen3.5 checkpoints write ``[E, 2I, H]`` / ``[E, H, I]``
  ("out_in"). The layout is read off each tensor's shape; when ``H == 2I`` (or ``H == I`` for
  down_proj) the shape cannot tell them apart and loading stops unless ``expert_layout=`` names
  it. Guessing there would silently load transposed experts that still produce plausible text.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from rm_jax.model.layer_stack import LayerGroup, LayerSpec
from rm_jax.model.safetensors_io import CheckpointError

# ---------------------------------------------------------------------------------------------
# Transforms: (to_ours(hf_array, cfg, ctx) -> tuple of arrays, to_hf(tuple, cfg, ctx) -> array)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Transform:
    to_ours: Callable
    to_hf: Callable


IDENT = Transform(lambda w, c, x: (w,), lambda o, c, x: o[0])
TRANSPOSE = Transform(lambda w, c, x: (w.T,), lambda o, c, x: o[0].T)

# Text attention. Linear [n*h, D] -> [D, n, h] (q/k/v) and back.
Q_HEADS = Transform(lambda w, c, x: (w.T.reshape(w.shape[1], c.text.num_attention_heads, c.text.head_dim),),
                    lambda o, c, x: o[0].reshape(o[0].shape[0], -1).T)
KV_HEADS = Transform(lambda w, c, x: (w.T.reshape(w.shape[1], c.text.num_key_value_heads, c.text.head_dim),),
                     lambda o, c, x: o[0].reshape(o[0].shape[0], -1).T)
# Linear [D, n*h] -> [n, h, D] (o_proj) and back.
O_HEADS = Transform(lambda w, c, x: (w.T.reshape(c.text.num_attention_heads, c.text.head_dim, w.shape[0]),),
                    lambda o, c, x: o[0].reshape(-1, o[0].shape[-1]).T)


def experts_layout(name: str, shape, h: int, i_dim: int, ctx) -> str:
    """Which layout a fused expert tensor is stored in, from its shape (or the explicit flag)."""
    a, b = shape[1], shape[2]
    in_out, out_in = (h, i_dim), (i_dim, h)
    matches = [lay for lay, want in (("in_out", in_out), ("out_in", out_in)) if (a, b) == want]
    if not matches:
        raise CheckpointError(f"{ctx['file']}: {name} has shape {tuple(shape)}; expected [E, {h}, {i_dim}] "
                              f"(published layout) or [E, {i_dim}, {h}] (transformers layout) for this config")
    if len(matches) == 2:
        if ctx["expert_layout"] is None:
            raise CheckpointError(
                f"{ctx['file']}: {name} has shape {tuple(shape)}: its two matrix dims are equal (hidden_size "
                "== 2*moe_intermediate_size), so its on-disk layout is ambiguous (published [E, H, 2I] vs "
                "transformers [E, 2I, H]). Pass "
                "expert_layout='published' or expert_layout='transformers' (launch.convert "
                "--expert_layout) to say which one this checkpoint uses.")
        return ctx["expert_layout"]
    if ctx["expert_layout"] not in (None, matches[0]):
        raise CheckpointError(f"{ctx['file']}: {name} has shape {tuple(shape)}, which is the "
                              f"'{matches[0]}' layout, but expert_layout='{ctx['expert_layout']}' was given")
    ctx.setdefault("detected_layout", matches[0])
    return matches[0]


def _gate_up_fwd(w, c, x):
    h, i = c.text.hidden_size, c.text.moe_intermediate_size
    if experts_layout(x["key"], w.shape, h, 2 * i, x) == "out_in":
        w = np.swapaxes(w, 1, 2)                  # -> [E, H, 2I]
    return w[..., :i], w[..., i:]                 # gate first (HF chunk order)


def _gate_up_inv(o, c, x):
    w = np.concatenate(o, axis=-1)                # [E, H, 2I]
    return np.swapaxes(w, 1, 2) if x["expert_layout"] == "out_in" else w


def _down_fwd(w, c, x):
    h, i = c.text.hidden_size, c.text.moe_intermediate_size
    if experts_layout(x["key"], w.shape, i, h, x) == "out_in":
        w = np.swapaxes(w, 1, 2)                  # [E, H, I] -> [E, I, H]
    return (w,)


def _down_inv(o, c, x):
    return np.swapaxes(o[0], 1, 2) if x["expert_layout"] == "out_in" else o[0]


EXPERTS_GATE_UP = Transform(_gate_up_fwd, _gate_up_inv)
EXPERTS_DOWN = Transform(_down_fwd, _down_inv)


# ---------------------------------------------------------------------------------------------
# Rules and their expansion over one model's layers
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Rule:
    hf: str                    # HF key; {i} = layer/block index, {j} = deepstack merger index
    ours: tuple[str, ...]      # our param path(s) within the scope, dotted
    transform: Transform
    scope: str                 # global | text_layer | vision_block | deepstack
    # text_layer only: which decoder layers have this key, by their ``LayerSlot.kind`` (None: all).
    layers: Callable[[Any], bool] | None = None


def has_moe(spec: LayerSpec) -> bool:
    return spec.ffn == "moe"


def has_dense_mlp(spec: LayerSpec) -> bool:
    return spec.ffn == "dense"


@dataclasses.dataclass(frozen=True)
class Target:
    path: tuple            # nnx state path
    index: int | None      # layer index inside a stacked param, None if not stacked


@dataclasses.dataclass(frozen=True)
class LayerSlot:
    """Where decoder layer ``i`` lives: its params under ``prefix``, at ``index`` of the stack."""
    prefix: tuple
    index: int
    kind: Any              # what ``Rule.layers`` is asked about (a LayerSpec, a layer-type name)


def slots_of_groups(layer_groups: Sequence[LayerGroup], n_layers: int) -> list[LayerSlot]:
    """Layer ``i`` of group ``g`` (one scanned stack per group) -> ``("decoder", g, "layers")``."""
    slots = {}
    for g, group in enumerate(layer_groups):
        for i in range(group.start, group.end):
            slots[i] = LayerSlot(("decoder", g, "layers"), i - group.start, group.spec)
    if sorted(slots) != list(range(n_layers)):
        raise ValueError(f"layer groups {layer_groups} do not cover the {n_layers} decoder layers")
    return [slots[i] for i in range(n_layers)]


def _path(dotted: str) -> tuple:
    return tuple(int(s) if s.isdigit() else s for s in dotted.split("."))


def expand_rules(rules: Iterable[Rule], *, text_layers: Sequence[LayerSlot],
                 vision_groups: Sequence[tuple[int, int]] = (), n_vision_blocks: int = 0, n_deepstack: int = 0,
                 skip: Iterable[str] = ()) -> dict[str, tuple[Rule, tuple[Target, ...]]]:
    """Every concrete HF key of one model -> (rule, our targets). ``text_layers[i]`` places decoder
    layer ``i``; ``vision_groups`` (``(start, end)`` runs, one scanned stack each) place vision
    block ``i``; ``skip`` drops global keys (a tied head)."""
    vis_at = {}
    for g, (start, end) in enumerate(vision_groups):
        for i in range(start, end):
            vis_at[i] = (g, i - start)
    skip = frozenset(skip)

    out = {}
    for rule in rules:
        if rule.scope == "global":
            if rule.hf not in skip:
                out[rule.hf] = (rule, tuple(Target(_path(o), None) for o in rule.ours))
        elif rule.scope == "text_layer":
            for i, slot in enumerate(text_layers):
                if rule.layers is None or rule.layers(slot.kind):
                    out[rule.hf.format(i=i)] = (rule, tuple(Target(slot.prefix + _path(o), slot.index)
                                                            for o in rule.ours))
        elif rule.scope == "vision_block":
            for i in range(n_vision_blocks):
                g, j = vis_at[i]
                out[rule.hf.format(i=i)] = (rule, tuple(Target(("vision", "blocks", g, "layers") + _path(o), j)
                                                        for o in rule.ours))
        elif rule.scope == "deepstack":
            for j in range(n_deepstack):
                out[rule.hf.format(j=j)] = (rule, tuple(Target(("vision", "deepstack_mergers", j) + _path(o), None)
                                                        for o in rule.ours))
        else:
            raise ValueError(f"rule {rule.hf}: unknown scope {rule.scope!r}")
    return out
