"""The Qwen3-VL-MoE judge: vision tower + MRoPE text decoder (dense/sparse layers) + LM head.

Design choices:

* **Two entry points.** ``prepare_inputs`` (numpy, outside jit) turns what a Qwen-VL processor
  produces (input_ids, attention_mask, pixel_values, image_grid_thw) into a ``JudgeInputs`` pytree
  of static-shaped arrays: 3-D MRoPE positions (a port of transformers' ``get_rope_index``), the
  index of each image token's feature row, and the vision tower's index arrays. ``forward_arrays``
  is the pure, jittable model on that pytree; the trainer calls it under its own ``jax.jit``.
  ``model(...)``/``model.forward(...)`` glue the two together with a cached jit for interactive
  use, tests and scoring.
* **Positions follow transformers exactly**: with ``image_grid_thw`` the 3-D positions come from
  the token-type runs of the unpadded tokens (padding gets 0); without it positions are
  ``arange(T)`` on all three axes, whatever the padding (that is what HF does too).
* **Image features are spliced with a gather**, not a boolean-mask scatter: ``image_index_bt``
  holds, for every image token, its row in the concatenated image features (-1 elsewhere), in
  row-major (batch, time) order -- the order of ``masked_scatter``. The same index adds the
  deepstack features after the first ``len(deepstack)`` decoder layers.
* **Layer segments.** Decoder layers are grouped into maximal runs of the same kind (dense MLP vs
  sparse MoE); a deepstack-receiving layer is its own run. Each run is one ``LayerStack``
  (scanned), so a 48-layer all-MoE model with 3 deepstack layers compiles 4 + 1 layer bodies,
  not 48. ``layer_segments`` is the single place that defines the mapping, and ``hf.py`` uses it
  to place checkpoint layers.
* **Outputs.** ``__call__`` returns logits only. ``forward(..., return_hidden=True)`` returns a
  ``JudgeOutput`` with every decoder layer's output (before the deepstack addition, as transformers'
  layer hooks see it), the vision features and the MoE aux of every sparse layer.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rm_jax.model.config import ModelConfig
from rm_jax.model.layers import (MLP, Attention, AttentionMask, LayerStack, RMSNorm, as_dtype, causal_padding_mask,
                                 mrope_cos_sin, normal, param)
from rm_jax.model.moe import MoeAux, MoeConfig, SparseMoeBlock
from rm_jax.model.vision import VisionInputs, VisionModel, vision_inputs
from rm_jax.sharding import constrain


# ---------------------------------------------------------------------------------------------
# Inputs (numpy, outside jit)
# ---------------------------------------------------------------------------------------------

@flax.struct.dataclass
class JudgeInputs:
    input_ids_bt: jax.Array
    attention_mask_bt: jax.Array
    positions_3bt: jax.Array
    image_index_bt: jax.Array | None = None     # row of the image features, -1 for other tokens
    # Valid length of each row when every row's mask is a prefix of ones (right padding): then
    # attention runs as causal + key lengths (the cuDNN flash path) instead of a [B,1,T,T] mask.
    kv_lengths_b: jax.Array | None = None
    vision: VisionInputs | None = None


@flax.struct.dataclass
class JudgeOutput:
    logits_btv: jax.Array | None                # None with forward_arrays(logits=False)
    layer_hidden_lbtd: jax.Array | None = None  # output of each decoder layer (pre-deepstack)
    inputs_embeds_btd: jax.Array | None = None  # after image splicing
    final_hidden_btd: jax.Array | None = None   # after the final norm
    image_embeds_nd: jax.Array | None = None    # merged image features [N/m^2, D]
    deepstack_embeds: tuple | None = None       # one [N/m^2, D] per deepstack tap
    moe_aux: MoeAux | None = None               # stacked over sparse layers, in layer order
    kv_lbtkh: tuple | None = None               # (k, v) of every decoder layer, forward_arrays(return_kv=True)


def rope_index(cfg: ModelConfig, input_ids_bt: np.ndarray, image_grid_thw: np.ndarray | None,
               attention_mask_bt: np.ndarray | None) -> np.ndarray:
    """3-D MRoPE positions [3, B, T]: transformers' ``get_rope_index`` for images, in numpy."""
    b, t = input_ids_bt.shape
    if image_grid_thw is None:
        return np.broadcast_to(np.arange(t, dtype=np.int32), (3, b, t)).copy()
    m = cfg.vision.spatial_merge_size
    grids = iter(np.asarray(image_grid_thw, np.int64).reshape(-1, 3).tolist())
    positions = np.zeros((3, b, t), np.int64)
    for row in range(b):
        keep = np.ones(t, bool) if attention_mask_bt is None else attention_mask_bt[row].astype(bool)
        is_image = input_ids_bt[row][keep] == cfg.image_token_id
        # Runs of text / image tokens (vectorized: a Python loop per token costs ~0.5 ms a row).
        cuts = np.flatnonzero(is_image[1:] != is_image[:-1]) + 1
        starts, ends = np.r_[0, cuts], np.r_[cuts, len(is_image)]
        row_pos = np.zeros((3, len(is_image)), np.int64)
        pos = 0
        for start, end in zip(starts.tolist(), ends.tolist()):
            n = end - start
            if n == 0:
                continue
            if not is_image[start]:
                row_pos[:, start:end] = np.arange(n) + pos
                pos += n
                continue
            try:
                gt, gh, gw = next(grids)
            except StopIteration:
                raise ValueError("input_ids contain more image-token runs than image_grid_thw rows") from None
            lt, lh, lw = gt, gh // m, gw // m
            if lt * lh * lw != n:
                raise ValueError(f"an image-token run of length {n} in batch row {row} does not match "
                                 f"its grid {(gt, gh, gw)} (expects {lt * lh * lw} tokens)")
            tt, hh, ww = np.meshgrid(np.arange(lt), np.arange(lh), np.arange(lw), indexing="ij")
            row_pos[:, start:end] = np.stack([tt, hh, ww]).reshape(3, -1) + pos
            pos += max(gh, gw) // m
        positions[:, row, keep] = row_pos
    return positions.astype(np.int32)


def _to_numpy(x):
    return None if x is None else np.asarray(jax.device_get(x))


def check_processor_extras(cfg: ModelConfig, input_ids, mm_token_type_ids=None, pixel_values_videos=None,
                           video_grid_thw=None) -> None:
    """The processor outputs the judge does not consume: videos are refused; ``mm_token_type_ids``
    (Qwen3-VL processors return it by default) must agree with the types derived from the ids."""
    if pixel_values_videos is not None or video_grid_thw is not None:
        raise ValueError("video inputs (pixel_values_videos / video_grid_thw) are not supported: the judge "
                         "reads images only")
    if mm_token_type_ids is None:
        return
    ids = _to_numpy(input_ids)
    types = _to_numpy(mm_token_type_ids)
    if types.shape != ids.shape:
        raise ValueError(f"mm_token_type_ids has shape {types.shape} but input_ids has {ids.shape}")
    derived = np.where(ids == cfg.image_token_id, 1, np.where(ids == cfg.video_token_id, 2, 0))
    if not np.array_equal(types, derived):
        bad = tuple(int(i) for i in np.argwhere(types != derived)[0])
        raise ValueError(f"mm_token_type_ids disagrees with input_ids at {bad}: type {int(types[bad])}, but the "
                         f"token {int(ids[bad])} gives {int(derived[bad])} (image token id {cfg.image_token_id}, "
                         f"video {cfg.video_token_id}); the processor and the model config name different tokens")


def prepare_inputs(cfg: ModelConfig, input_ids, attention_mask=None, pixel_values=None,
                   image_grid_thw=None, *, attention: str = "mask",
                   frame_capacity: int | None = None) -> JudgeInputs:
    """Processor tensors (numpy, jax or torch-converted arrays) -> static-shaped ``JudgeInputs``.

    ``attention`` picks the text-attention masking: "mask" (a [B,1,T,T] causal+padding mask, any
    padding), "lengths" (causal + per-row key lengths; requires right padding; cuDNN-flash
    eligible) or "auto" (lengths when every row is right-padded). It changes the pytree structure
    of the result, so a training loop should pick one value and keep it. ``frame_capacity`` is
    the vision tower's static patches-per-frame budget (``vision.vision_inputs``); a training loop
    passes one so that every batch has the same shapes.
    """
    if attention not in ("mask", "lengths", "auto"):
        raise ValueError(f"attention={attention!r}; expected 'mask', 'lengths' or 'auto'")
    ids = _to_numpy(input_ids).astype(np.int32)
    if ids.ndim == 1:
        ids = ids[None]
    mask = np.ones_like(ids) if attention_mask is None else _to_numpy(attention_mask).astype(np.int32).reshape(ids.shape)
    grid = None if image_grid_thw is None else _to_numpy(image_grid_thw).astype(np.int64).reshape(-1, 3)
    positions = rope_index(cfg, ids, grid, None if attention_mask is None else mask)
    if (pixel_values is None) != (grid is None):
        raise ValueError("pixel_values and image_grid_thw must be given together")
    image_index, vin = None, None
    n_img_tokens = int(np.sum(ids == cfg.image_token_id))
    if grid is not None:
        n_feats = int(np.sum(np.prod(grid, -1))) // cfg.vision.spatial_merge_size ** 2
        if n_img_tokens != n_feats:
            raise ValueError(f"input_ids hold {n_img_tokens} image tokens (id {cfg.image_token_id}) but "
                             f"image_grid_thw {grid.tolist()} gives {n_feats} image features")
        flat = (ids == cfg.image_token_id).reshape(-1)
        image_index = np.where(flat, np.cumsum(flat) - 1, -1).reshape(ids.shape).astype(np.int32)
        pv = pixel_values if isinstance(pixel_values, jax.Array) else _to_numpy(pixel_values)
        vin = vision_inputs(cfg.vision, pv, grid, frame_capacity)
    lengths = mask.sum(-1).astype(np.int32)
    is_prefix = bool(np.all(mask == (np.arange(mask.shape[1])[None, :] < lengths[:, None])))
    if attention == "lengths" and not is_prefix:
        raise ValueError("attention='lengths' needs right padding (each attention_mask row a prefix of ones)")
    use_lengths = attention == "lengths" or (attention == "auto" and is_prefix)
    return JudgeInputs(input_ids_bt=ids, attention_mask_bt=mask, positions_3bt=positions,
                       image_index_bt=image_index, kv_lengths_b=lengths if use_lengths else None, vision=vin)


# ---------------------------------------------------------------------------------------------
# Decoder
# ---------------------------------------------------------------------------------------------

def layer_segments(cfg: ModelConfig) -> list[tuple[int, int, bool]]:
    """Decoder runs (start, end, sparse): same MLP kind, deepstack-receiving layers alone."""
    t = cfg.text
    n_deepstack = len(cfg.vision.deepstack_visual_indexes)
    out: list[tuple[int, int, bool]] = []
    for i in range(t.num_hidden_layers):
        sparse = t.is_sparse(i)
        if out and out[-1][2] == sparse and out[-1][1] == i and i >= n_deepstack and out[-1][0] >= n_deepstack:
            out[-1] = (out[-1][0], i + 1, sparse)
        else:
            out.append((i, i + 1, sparse))
    return out


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, sparse: bool, *, rngs: nnx.Rngs):
        t, rt = cfg.text, cfg.runtime
        dtype, pdtype = as_dtype(rt.dtype), as_dtype(rt.param_dtype)
        self.sparse = sparse
        self.input_norm = RMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=pdtype)
        self.attn = Attention(t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
                              t.rms_norm_eps, rngs=rngs, dtype=dtype, param_dtype=pdtype, impl=rt.attention)
        self.post_norm = RMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=pdtype)
        if sparse:
            moe_cfg = MoeConfig(d_model=t.hidden_size, d_ff=t.moe_intermediate_size,
                                num_experts=t.num_experts, top_k=t.num_experts_per_tok,
                                norm_topk_prob=t.norm_topk_prob, backend=rt.moe_backend,
                                ragged_dot=rt.ragged_dot)
            self.mlp = SparseMoeBlock(moe_cfg, rngs=rngs, dtype=dtype, param_dtype=pdtype)
        else:
            self.mlp = MLP(t.hidden_size, t.intermediate_size, rngs=rngs, dtype=dtype, param_dtype=pdtype)

    def __call__(self, x_btd, cos_btd, sin_btd, attn_mask, attention_mask_bt, *, return_kv: bool = False):
        """``(y_btd, aux)``, or ``(y_btd, aux, (k_btkh, v_btkh))`` with ``return_kv`` (cache prefill)."""
        h_btd, kv = self.attn(self.input_norm(x_btd), cos_btd, sin_btd, attn_mask, return_kv=True)
        y_btd, aux = self._ffn(x_btd + h_btd, attention_mask_bt)
        return (y_btd, aux, kv) if return_kv else (y_btd, aux)

    def _ffn(self, x_btd, attention_mask_bt):
        # Shared by the full forward and the cached decode step, so the two cannot drift apart.
        h_btd = self.post_norm(x_btd)
        if self.sparse:
            y_btd, aux = self.mlp(h_btd, mask_bt=attention_mask_bt)
        else:
            y_btd, aux = self.mlp(h_btd), None
        return constrain(x_btd + y_btd, ("batch", "length", "act_embed")), aux

    def decode(self, x_bnd, cos_bnd, sin_bnd, k_cache_bskh, v_cache_bskh, write_b, kv_lengths_b):
        """N cached new tokens through this layer -> ``(y_bnd, (k_bnkh, v_bnkh))`` (rm_jax.model.decode)."""
        h_bnd, k_bnkh, v_bnkh = self.attn.decode(self.input_norm(x_bnd), cos_bnd, sin_bnd, k_cache_bskh,
                                                 v_cache_bskh, write_b, kv_lengths_b)
        y_bnd, _ = self._ffn(x_bnd + h_bnd, None)
        return y_bnd, (k_bnkh, v_bnkh)


class Qwen3VLMoeJudge(nnx.Module):
    """Qwen3VLMoeForConditionalGeneration in NNX. ``model(input_ids, ...) -> logits [B, T, V]``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        t, rt = cfg.text, cfg.runtime
        dtype, pdtype = as_dtype(rt.dtype), as_dtype(rt.param_dtype)
        self.cfg, self.dtype = cfg, dtype
        self.mesh = None  # set by load_hf(mesh=...); forward then runs under jax.set_mesh(mesh)
        self.embed_vd = param(normal(rngs, (t.vocab_size, t.hidden_size), pdtype), ("vocab", "embed"))
        self.vision = VisionModel(cfg.vision, rngs=rngs, dtype=dtype, param_dtype=pdtype,
                                  scan=rt.scan_layers, remat=rt.remat, attention=rt.attention)
        self.segments = tuple(layer_segments(cfg))
        self.decoder = nnx.List([
            LayerStack(functools.partial(lambda sp, r: DecoderLayer(cfg, sp, rngs=r), sparse),
                       end - start, rngs=rngs)
            for start, end, sparse in self.segments])
        self.final_norm = RMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=pdtype)
        self.lm_head_dv = (None if cfg.tie_word_embeddings else
                           param(normal(rngs, (t.hidden_size, t.vocab_size), pdtype, t.hidden_size),
                                 ("embed", "vocab")))

    # -- pure forward on prepared arrays --------------------------------------------------------

    def head_dv(self) -> jax.Array:
        """The LM head as [D, V] (the transposed embedding when tied)."""
        return self.embed_vd[...].T if self.lm_head_dv is None else self.lm_head_dv[...]

    def forward_arrays(self, inputs: JudgeInputs, *, return_hidden: bool = False,
                       logits: bool = True, return_kv: bool = False) -> JudgeOutput:
        """Pure forward. ``logits=False`` skips the [B, T, V] head (a chunked loss uses
        ``final_hidden_btd`` and ``head_dv()`` instead, which is then always returned).
        ``return_hidden`` adds every layer's output ([L, B, T, D]: memory, so not for training).
        ``return_kv`` adds every layer's rotated keys and values ``kv_lbtkh`` (a KV-cache prefill,
        rm_jax.model.decode)."""
        cfg, dt = self.cfg, self.dtype
        ids_bt = constrain(jnp.asarray(inputs.input_ids_bt), ("batch", "length"))
        mask_bt = jnp.asarray(inputs.attention_mask_bt)
        x_btd = jnp.take(self.embed_vd[...], ids_bt, axis=0).astype(dt)
        x_btd = constrain(x_btd, ("batch", "length", "act_embed"))

        image_nd, deepstack, gather_bt, is_image_bt1 = None, [], None, None
        if inputs.vision is not None:
            image_nd, deepstack = self.vision(inputs.vision)
            image_nd = image_nd.astype(dt)
            index_bt = jnp.asarray(inputs.image_index_bt)
            is_image_bt1 = (index_bt >= 0)[..., None]
            gather_bt = jnp.maximum(index_bt, 0)
            x_btd = jnp.where(is_image_bt1, jnp.take(image_nd, gather_bt, axis=0), x_btd)
        inputs_embeds = x_btd

        t = cfg.text
        cos_btd, sin_btd = mrope_cos_sin(jnp.asarray(inputs.positions_3bt), t.head_dim, t.rope_theta,
                                         t.mrope_section, dt)
        if inputs.kv_lengths_b is not None:
            attn_mask = AttentionMask(kv_lengths_b=jnp.asarray(inputs.kv_lengths_b))
        else:
            attn_mask = AttentionMask(mask_b1ts=causal_padding_mask(mask_bt))

        def body(layer, x, _):
            y, aux, kv = layer(x, cos_btd, sin_btd, attn_mask, mask_bt, return_kv=True)
            return y, (y if return_hidden else None, aux, kv if return_kv else None)

        hidden, auxes, kvs = [], [], []
        for (start, end, _), stack in zip(self.segments, self.decoder):
            x_btd, (h_lbtd, aux, kv) = stack.apply(body, x_btd, scan=cfg.runtime.scan_layers,
                                                   remat=cfg.runtime.remat)
            hidden.append(h_lbtd)
            auxes.append(aux)
            kvs.append(kv)
            if start < len(deepstack):
                # Layer `start` is alone in its segment (layer_segments guarantees it).
                feats_nd = deepstack[start].astype(dt)
                x_btd = x_btd + jnp.where(is_image_bt1, jnp.take(feats_nd, gather_bt, axis=0), 0)

        final_btd = self.final_norm(x_btd)
        if logits:
            logits = jnp.einsum("btd,dv->btv", final_btd, self.head_dv().astype(dt))
            logits = constrain(logits.astype(jnp.float32), ("batch", "length", "act_vocab"))
        else:
            logits = None

        auxes = [a for a in auxes if a is not None]
        moe_aux = jax.tree.map(lambda *a: jnp.concatenate(a), *auxes) if auxes else None
        kv_lbtkh = jax.tree.map(lambda *a: jnp.concatenate(a), *kvs) if return_kv else None
        if not return_hidden:
            # Without logits the caller needs the normed hidden states for its own (chunked) head.
            return JudgeOutput(logits_btv=logits, final_hidden_btd=None if logits is not None else final_btd,
                               moe_aux=moe_aux, kv_lbtkh=kv_lbtkh)
        return JudgeOutput(
            logits_btv=logits, layer_hidden_lbtd=jnp.concatenate(hidden), inputs_embeds_btd=inputs_embeds,
            final_hidden_btd=final_btd, image_embeds_nd=image_nd,
            deepstack_embeds=tuple(deepstack) if deepstack else None, moe_aux=moe_aux, kv_lbtkh=kv_lbtkh)

    # -- convenience API (numpy or jax in, jitted) ----------------------------------------------

    def __setattr__(self, name, value):
        _SPLIT_CACHE.pop(self, None)       # a new attribute may change the graph: split again
        super().__setattr__(name, value)

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
        inputs = prepare_inputs(self.cfg, input_ids, attention_mask, pixel_values, image_grid_thw,
                                attention="auto")
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


_SPLIT_CACHE: "weakref.WeakKeyDictionary[Qwen3VLMoeJudge, tuple]" = weakref.WeakKeyDictionary()


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


@functools.partial(jax.jit, static_argnums=(0, 3))
def _jit_forward(graph: StaticGraph, state, inputs: JudgeInputs, return_hidden: bool) -> JudgeOutput:
    return graph.merge(state).forward_arrays(inputs, return_hidden=return_hidden)


def init_model(cfg: ModelConfig, seed: int = 0) -> Qwen3VLMoeJudge:
    """A randomly initialized model (tests, benchmarks); real runs use ``load_hf``."""
    return Qwen3VLMoeJudge(cfg, rngs=nnx.Rngs(seed))


def abstract_model(cfg: ModelConfig) -> Qwen3VLMoeJudge:
    """Shapes and metadata only: no memory is allocated (the loader fills it)."""
    return nnx.eval_shape(lambda: Qwen3VLMoeJudge(cfg, rngs=nnx.Rngs(0)))
