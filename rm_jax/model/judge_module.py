"""The part of a judge model every architecture shares: the cached split and the convenience
forward (processor tensors in, jitted), so an architecture writes only ``forward_arrays`` and
its decode step.

Design choices:

* ``model(...)``/``model.forward(...)`` glue ``prepare_inputs`` (numpy, outside jit) to the
  pure ``forward_arrays`` with a cached jit for interactive use, tests and scoring; the trainer
  calls ``forward_arrays`` under its own ``jax.jit``.
* ``nnx.split`` is cached per model (a traversal costs as much as a small forward); assigning an
  attribute drops the cache.
"""

from __future__ import annotations

import functools
import weakref

import jax
from flax import nnx

from rm_jax.model.inputs import check_processor_extras, prepare_inputs
from rm_jax.model.interface import StaticGraph
from rm_jax.model.records import JudgeInputs, JudgeOutput
from rm_jax.model.placement import param_shardings


class JudgeModule(nnx.Module):
    """Base of the architectures' model classes: they set ``cfg``, ``dtype``, ``mesh`` and
    implement ``forward_arrays``, ``head_dv``, ``final_norm``, ``decode_tokens``
    (``rm_jax.model.interface.JudgeModel``)."""

    def __setattr__(self, name, value):
        _SPLIT_CACHE.pop(self, None)       # a new attribute may change the graph: split again
        super().__setattr__(name, value)

    def param_shardings(self, mesh) -> nnx.State:
        return param_shardings(self, mesh)

    def prepare_inputs(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None,
                       **kw) -> JudgeInputs:
        return prepare_inputs(self.cfg, input_ids, attention_mask, pixel_values, image_grid_thw, **kw)

    def split_cached(self):
        """``nnx.split(self)``, cached: the traversal costs ~2.5 ms per call at the tiny size, as
        much as a small forward. The state holds this model's own Variable objects, so in-place
        value updates (``nnx.update``, an optimizer) are seen; assigning an attribute of the
        model drops the cache. (Replacing a Variable object deep inside a sub-module is not
        detected: call ``nnx.split`` yourself after such surgery.)"""
        return self._split_and_graph()[0]

    def _split_and_graph(self):
        """((graphdef, state), StaticGraph of graphdef), cached together."""
        cached = _SPLIT_CACHE.get(self)
        if cached is None:
            split = nnx.split(self)
            cached = _SPLIT_CACHE[self] = (split, StaticGraph.of(split[0]))
        return cached

    def forward(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None, *,
                mm_token_type_ids=None, pixel_values_videos=None, video_grid_thw=None,
                return_hidden: bool = False) -> JudgeOutput:
        check_processor_extras(self.cfg, input_ids, mm_token_type_ids, pixel_values_videos, video_grid_thw)
        inputs = self.prepare_inputs(input_ids, attention_mask, pixel_values, image_grid_thw, attention="auto")
        (_, state), graph = self._split_and_graph()
        if self.mesh is None:
            return _jit_forward(graph, state, inputs, return_hidden)
        with jax.set_mesh(self.mesh):
            return _jit_forward(graph, state, inputs, return_hidden)

    def __call__(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None, *,
                 mm_token_type_ids=None, pixel_values_videos=None, video_grid_thw=None):
        """Logits [B, T, V]. Takes a Qwen-VL processor's output as is (``model(**inputs)``); the
        token types are derived from the image token id, so ``mm_token_type_ids`` is only checked."""
        return self.forward(input_ids, attention_mask, pixel_values, image_grid_thw,
                            mm_token_type_ids=mm_token_type_ids, pixel_values_videos=pixel_values_videos,
                            video_grid_thw=video_grid_thw).logits_btv


_SPLIT_CACHE: "weakref.WeakKeyDictionary[JudgeModule, tuple]" = weakref.WeakKeyDictionary()


@functools.partial(jax.jit, static_argnums=(0, 3))
def _jit_forward(graph: StaticGraph, state, inputs: JudgeInputs, return_hidden: bool) -> JudgeOutput:
    return graph.merge(state).forward_arrays(inputs, return_hidden=return_hidden)
