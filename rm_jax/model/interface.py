"""What train, score, decode, serve and convert need from a judge model, whatever its architecture.

Design choices:

* **One small surface.** ``JudgeModel`` is a ``typing.Protocol`` (checkable with ``isinstance``)
  listing exactly what the pipeline calls: ``cfg``, ``dtype``, ``mesh``, ``forward_arrays`` on a
  ``JudgeInputs`` pytree, ``head_dv`` and ``final_norm`` for a chunked / sliced LM head, ``decode_tokens`` for cached decoding and ``param_shardings``. Architectures
  (``rm_jax.model.qwen3_vl_moe``, ``rm_jax.model.qwen3_5_moe``) implement it; nothing outside
  their packages names a model class.
* **Records between stages** (``JudgeInputs``, ``JudgeOutput``, the decode state) are pytrees
  shared by every architecture, in ``rm_jax.model.records``; how a decode state grows is
  ``rm_jax.model.decode_state``.
* **StaticGraph** makes an NNX GraphDef a cheap ``jax.jit`` static argument (hashed once, interned).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
from flax import nnx

from rm_jax.model.records import DecodeState, JudgeInputs, JudgeOutput, NewTokenState


@runtime_checkable
class JudgeModel(Protocol):
    """A judge as the pipeline uses it (an ``nnx.Module``; see ``JudgeModule`` for the shared part)."""

    cfg: Any                                  # the architecture's typed config (``model_type`` names it)
    dtype: Any                                # activation dtype
    mesh: Any                                 # the mesh forward runs under (None: no mesh)

    def forward_arrays(self, inputs: JudgeInputs, *, return_hidden: bool = False, logits: bool = True,
                       return_kv: bool = False) -> JudgeOutput:
        """The pure, jittable forward. ``logits=False`` skips the [B, T, V] head and returns
        ``final_hidden_btd``; ``return_kv`` adds the decode-state prefill (``kv_lbtkh`` of the
        attention layers, ``recurrent`` of the GDN layers)."""

    def head_dv(self) -> jax.Array:
        """The LM head as [D, V]."""

    def final_norm(self, x_btd: jax.Array) -> jax.Array:
        """The norm before the LM head."""

    def decode_tokens(self, state: DecodeState, tokens_bn: jax.Array,
                      valid_bn: jax.Array | None = None) -> tuple[jax.Array, NewTokenState]:
        """``N`` new text tokens per row after the cached ones: the last layer's output ``x_bnd``
        (before the final norm) and what each layer kind adds to the state (the caller writes it,
        rm_jax.model.decode). ``valid_bn`` False marks right padding the recurrent state skips."""

    def param_shardings(self, mesh) -> nnx.State:
        """A NamedSharding per variable, from its logical axis names."""


class StaticGraph:
    """An NNX GraphDef as a ``jax.jit`` static argument that is hashed once.

    jit hashes its static arguments on every call, and a GraphDef hashes by walking the whole
    module graph: ~1.5 ms per call at the tiny size, 10-30% of a scoring call. Instances are
    interned (``StaticGraph.of``), so equal graphdefs -- every checkpoint of one run -- share one
    object and one jit cache entry, and the per-call lookup compares by identity."""

    _interned: "dict[StaticGraph, StaticGraph]" = {}

    def __init__(self, graphdef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    @classmethod
    def of(cls, graphdef) -> "StaticGraph":
        key = cls(graphdef)
        return cls._interned.setdefault(key, key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, StaticGraph) and self.graphdef == other.graphdef)

    def merge(self, state):
        return nnx.merge(self.graphdef, state)
