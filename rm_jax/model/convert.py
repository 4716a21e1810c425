"""transformers checkpoint <-> rm_jax params: the engine that applies a per-architecture key table.

Design choices:

* **One table per architecture** (``rm_jax.model.<arch>.params``: ``RULES`` + ``key_table(cfg)``)
  lists every HF key pattern with the rm_jax param path(s) it fills and the transform between
  them. This module applies it: loading reads it forwards, export backwards; nothing else knows
  the HF names. The architecture comes from config.json's ``model_type``
  (``rm_jax.model.registry``); a text-layer rule can be limited to layers of one ``LayerSpec``
  kind (``has_moe``, ``has_attention``, ...).
* **Transforms are pairs of pure numpy functions** (HF -> ours, ours -> HF) and exact inverses of
  each other (transposes and reshapes only), so HF -> rm_jax -> HF reproduces every tensor bit for
  bit in the checkpoint's dtype.
* **Fused expert tensors** come in two on-disk layouts: published checkpoints store
  ``gate_up_proj`` as ``[E, H, 2I]`` and ``down_proj`` as ``[E, I, H]`` ("in_out"); recent
  transformers' ``save_pretrained`` writes ``[E, 2I, H]`` / ``[E, H, I]`` ("out_in"). The layout is
  read off each tensor's shape; when ``H == 2I`` (or ``H == I`` for down_proj) the shape cannot tell
  them apart and loading stops unless ``expert_layout=`` names it. Guessing there would silently
  load transposed experts that still produce plausible-looking text.
* **Memory.** Each tensor (from a memory-mapped safetensors file: ``safetensors_io``) is
  transformed on the host and put straight onto its target sharding; stacked (scanned) params are
  allocated sharded and filled layer by layer with a donated ``dynamic_update_index_in_dim``, so
  no device ever holds the whole model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from rm_jax.model.config import ConfigError, RuntimeOptions
from rm_jax.model.layer_stack import LayerGroup, LayerSpec
from rm_jax.model.placement import param_shardings
from rm_jax.model.safetensors_io import (_ST_DTYPES, CheckpointError, SafetensorsFile, checkpoint_files,
                                         write_safetensors)

if TYPE_CHECKING:
    from rm_jax.model.interface import JudgeModel


EXPERT_LAYOUTS = {"in_out": "in_out", "published": "in_out", "out_in": "out_in", "transformers": "out_in"}

# ---------------------------------------------------------------------------------------------
# Transforms: (to_ours(hf_array, cfg, ctx) -> tuple of arrays, to_hf(tuple, cfg, ctx) -> array)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Transform:
    to_ours: Callable
    to_hf: Callable


def _t(fwd, inv) -> Transform:
    return Transform(fwd, inv)


IDENT = _t(lambda w, c, x: (w,), lambda o, c, x: o[0])
TRANSPOSE = _t(lambda w, c, x: (w.T,), lambda o, c, x: o[0].T)


def _experts_layout(name: str, shape, h: int, i_dim: int, ctx) -> str:
    """Which layout a fused expert tensor is stored in, from its shape (or the explicit flag)."""
    a, b = shape[1], shape[2]
    in_out, out_in = (h, i_dim), (i_dim, h)
    matches = [lay for lay, want in (("in_out", in_out), ("out_in", out_in)) if (a, b) == want]
    if not matches:
        raise CheckpointError(f"{ctx['file']}: {name} has shape {tuple(shape)}; expected [E, {h}, {i_dim}] "
                              f"(published layout) or [E, {i_dim}, {h}] (transformers layout) for this config")
    if len(matches) == 2:
        if ctx.get("expert_layout") is None:
            raise CheckpointError(
                f"{ctx['file']}: {name} has shape {tuple(shape)}: its two matrix dims are equal (hidden_size "
                "== 2*moe_intermediate_size), so its on-disk layout is ambiguous (published [E, H, 2I] vs "
                "transformers [E, 2I, H]). Pass "
                "expert_layout='published' or expert_layout='transformers' (launch.convert "
                "--expert_layout) to say which one this checkpoint uses.")
        return ctx["expert_layout"]
    if ctx.get("expert_layout") not in (None, matches[0]):
        raise CheckpointError(f"{ctx['file']}: {name} has shape {tuple(shape)}, which is the "
                              f"'{matches[0]}' layout, but expert_layout='{ctx['expert_layout']}' was given")
    ctx.setdefault("detected_layout", matches[0])
    return matches[0]


def _gate_up_fwd(w, c, x):
    h, i = c.text.hidden_size, c.text.moe_intermediate_size
    if _experts_layout(x["key"], w.shape, h, 2 * i, x) == "out_in":
        w = np.swapaxes(w, 1, 2)                  # -> [E, H, 2I]
    return w[..., :i], w[..., i:]                 # gate first (HF chunk order)


def _gate_up_inv(o, c, x):
    w = np.concatenate(o, axis=-1)                # [E, H, 2I]
    return np.swapaxes(w, 1, 2) if x["expert_layout"] == "out_in" else w


def _down_fwd(w, c, x):
    h, i = c.text.hidden_size, c.text.moe_intermediate_size
    if _experts_layout(x["key"], w.shape, i, h, x) == "out_in":
        w = np.swapaxes(w, 1, 2)                  # [E, H, I] -> [E, I, H]
    return (w,)


def _down_inv(o, c, x):
    return np.swapaxes(o[0], 1, 2) if x["expert_layout"] == "out_in" else o[0]


EXPERTS_GATE_UP = _t(_gate_up_fwd, _gate_up_inv)
EXPERTS_DOWN = _t(_down_fwd, _down_inv)


# ---------------------------------------------------------------------------------------------
# Rules and their expansion over one model's layers
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Rule:
    hf: str                    # HF key; {i} = layer/block index, {j} = deepstack merger index
    ours: tuple[str, ...]      # our param path(s) within the scope, dotted
    transform: Transform
    scope: str                 # global | text_layer | vision_block | deepstack
    # text_layer only: which decoder layers have this key, by their LayerSpec (None: all).
    layers: Callable[[LayerSpec], bool] | None = None


def has_moe(spec: LayerSpec) -> bool:
    return spec.ffn == "moe"


def has_dense_mlp(spec: LayerSpec) -> bool:
    return spec.ffn == "dense"


def has_attention(spec: LayerSpec) -> bool:
    return spec.mixer == "attention"


def has_gated_deltanet(spec: LayerSpec) -> bool:
    return spec.mixer == "gated_deltanet"


@dataclasses.dataclass(frozen=True)
class Target:
    path: tuple            # nnx state path
    index: int | None      # layer index inside a stacked param, None if not stacked


def expand_rules(rules: Iterable[Rule], *, n_layers: int, layer_groups: Sequence[LayerGroup],
                 vision_groups: Sequence[tuple[int, int]] = (), n_vision_blocks: int = 0, n_deepstack: int = 0,
                 skip: Iterable[str] = ()) -> dict[str, tuple[Rule, tuple[Target, ...]]]:
    """Every concrete HF key of one model -> (rule, our targets). ``layer_groups`` place decoder
    layer ``i`` into its scanned stack (``("decoder", group, "layers")``); ``vision_groups``
    (``(start, end)`` runs) place vision block ``i``; ``skip`` drops global keys (a tied head)."""
    def split(p):
        return tuple(int(s) if s.isdigit() else s for s in p.split("."))

    text_at = {}
    for g, group in enumerate(layer_groups):
        for i in range(group.start, group.end):
            text_at[i] = (g, i - group.start, group.spec)
    if sorted(text_at) != list(range(n_layers)):
        raise ValueError(f"layer groups {layer_groups} do not cover the {n_layers} decoder layers")
    vis_at = {}
    for g, (start, end) in enumerate(vision_groups):
        for i in range(start, end):
            vis_at[i] = (g, i - start)
    skip = frozenset(skip)

    out = {}
    for rule in rules:
        if rule.scope == "global":
            if rule.hf not in skip:
                out[rule.hf] = (rule, tuple(Target(split(o), None) for o in rule.ours))
        elif rule.scope == "text_layer":
            for i in range(n_layers):
                g, j, spec = text_at[i]
                if rule.layers is None or rule.layers(spec):
                    out[rule.hf.format(i=i)] = (rule, tuple(Target(("decoder", g, "layers") + split(o), j)
                                                            for o in rule.ours))
        elif rule.scope == "vision_block":
            for i in range(n_vision_blocks):
                g, j = vis_at[i]
                out[rule.hf.format(i=i)] = (rule, tuple(Target(("vision", "blocks", g, "layers") + split(o), j)
                                                        for o in rule.ours))
        elif rule.scope == "deepstack":
            for j in range(n_deepstack):
                out[rule.hf.format(j=j)] = (rule, tuple(Target(("vision", "deepstack_mergers", j) + split(o), None)
                                                        for o in rule.ours))
        else:
            raise ValueError(f"rule {rule.hf}: unknown scope {rule.scope!r}")
    return out


# ---------------------------------------------------------------------------------------------
# Sharded fills
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _set_layer_fn(sharding):
    return jax.jit(lambda arr, val, i: jax.lax.dynamic_update_index_in_dim(arr, val, i, 0),
                   donate_argnums=0, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


class ParamFiller:
    """Fills an abstract model's params from checkpoint tensors, each placed on its sharding as it
    arrives (a stacked target one layer at a time), and checks at the end that every param was
    filled exactly. Shared by every architecture's loader."""

    def __init__(self, model, mesh, pdtype):
        self.graphdef, state = nnx.split(model)
        self.flat = dict(nnx.to_flat_state(state))
        self.shardings = ({p: v.get_value() for p, v in nnx.to_flat_state(param_shardings(state, mesh))}
                          if mesh is not None else {})
        self.mesh, self.pdtype = mesh, pdtype
        self.values: dict[tuple, jax.Array] = {}
        self.filled: dict[tuple, set] = {p: set() for p in self.flat}

    def put(self, file, key: str, arrays, targets) -> None:
        """``arrays[i]`` (already in rm_jax's layout) goes to ``targets[i]``."""
        for target, arr in zip(targets, arrays):
            var, sharding = self.flat[target.path], self.shardings.get(target.path)
            want = var.shape if target.index is None else var.shape[1:]
            if tuple(arr.shape) != tuple(want):
                raise CheckpointError(f"{file}: {key} gives {tuple(arr.shape)} for "
                                      f"{'.'.join(map(str, target.path))} which needs {tuple(want)}")
            arr = np.asarray(arr).astype(self.pdtype)
            if target.index is None:
                self.values[target.path] = jax.device_put(arr, sharding) if sharding else jnp.asarray(arr)
            else:
                if target.path not in self.values:
                    self.values[target.path] = _zeros_fn(tuple(var.shape), self.pdtype, sharding)()
                layer_sharding = (NamedSharding(self.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
                                  if sharding else None)
                val = jax.device_put(arr, layer_sharding) if layer_sharding else jnp.asarray(arr)
                self.values[target.path] = _set_layer_fn(sharding)(self.values[target.path], val, target.index)
            self.filled[target.path].add(target.index)

    def model(self, hf_dir, table):
        """The filled model; refuses a param that no key (or not every layer's key) filled."""
        stacked = {t.path for _, targets in table.values() for t in targets if t.index is not None}
        for path, var in self.flat.items():
            if self.filled[path] != (set(range(var.shape[0])) if path in stacked else {None}):
                raise CheckpointError(f"{hf_dir}: param {'.'.join(map(str, path))} was not completely filled "
                                      f"(no checkpoint key maps to it)")
        model = nnx.merge(self.graphdef, nnx.from_flat_state([(p, self.flat[p].replace(self.values[p]))
                                                              for p in self.flat]))
        model.mesh = self.mesh
        return model


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------

def read_config(hf_dir, runtime: RuntimeOptions | None = None):
    """config.json -> the typed config of the architecture its ``model_type`` names."""
    from rm_jax.model import registry
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path}: missing (a transformers checkpoint dir needs its config.json)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    try:
        return registry.config_from_hf_dict(raw, runtime)
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _header_index(files) -> dict[str, tuple[Path, tuple, str]]:
    """{key: (file, shape, safetensors dtype)} from the shard headers alone (no tensor data)."""
    index = {}
    for file in files:
        st = SafetensorsFile(file)
        index.update({k: (Path(file), st.shape(k), st.header[k]["dtype"]) for k in st.keys()})
    return index


def _expert_layout_from_headers(index, cfg, given: str | None) -> str | None:
    """The flag, else the layout the fused gate_up tensors show when their shape tells
    (H != 2I). ``down_proj`` is ambiguous when H == I; gate_up then settles it. A gate_up shape
    that does not tell (H == 2I) stays ambiguous: the loader refuses it without the flag."""
    if given is not None or cfg.text.hidden_size == 2 * cfg.text.moe_intermediate_size:
        return given
    dims = (cfg.text.hidden_size, 2 * cfg.text.moe_intermediate_size)
    for key, (_, shape, _) in index.items():
        if key.endswith("mlp.experts.gate_up_proj") and len(shape) == 3 and shape[1:] in (dims, dims[::-1]):
            return "in_out" if shape[1:] == dims else "out_in"
    return None


def _stored_head_differs(index, cfg, keys: tuple[str, str]) -> bool:
    """A tied config, yet the checkpoint stores an ``lm_head.weight`` that differs from the
    embedding: transformers then does not tie them (it warns), so neither do we."""
    if not cfg.tie_word_embeddings or not all(k in index for k in keys):
        return False
    head, embed = (SafetensorsFile(index[k][0]).get(k) for k in keys)
    return head.shape != embed.shape or head.dtype != embed.dtype or not np.array_equal(head.view(np.uint8),
                                                                                         embed.view(np.uint8))


def load_hf(hf_dir, dtype="float32", mesh=None, *, expert_layout: str | None = None,
            runtime: RuntimeOptions | None = None) -> "tuple[JudgeModel, object]":
    """Load a transformers safetensors checkpoint into a (sharded) NNX model -> (model, config),
    the architecture picked by config.json's ``model_type`` (``rm_jax.model.registry``).

    ``expert_layout`` ("published"/"in_out" or "transformers"/"out_in") is needed only when the
    fused-expert shapes are ambiguous (hidden_size == 2 * moe_intermediate_size).
    """
    try:
        pdtype = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype={dtype!r}: not a dtype ({e})") from None
    if not jnp.issubdtype(pdtype, jnp.floating):
        raise ValueError(f"dtype={dtype!r}: parameters need a floating dtype (float32, bfloat16, ...)")
    runtime = runtime or RuntimeOptions()
    runtime = dataclasses.replace(runtime, dtype=str(pdtype), param_dtype=str(pdtype))
    if not Path(hf_dir).is_dir():
        raise CheckpointError(f"{hf_dir}: not a directory")
    from rm_jax.model import registry
    cfg = read_config(hf_dir, runtime)
    arch = registry.architecture_of(cfg)
    if arch.load_hf is not None:
        return arch.load_hf(hf_dir, dtype=dtype, mesh=mesh, expert_layout=expert_layout, runtime=runtime)
    if expert_layout is not None and expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout={expert_layout!r}; expected one of {sorted(EXPERT_LAYOUTS)}")
    files = checkpoint_files(hf_dir)
    index = _header_index(files)
    if _stored_head_differs(index, cfg, (arch.head_key, arch.embed_key)):
        logging.warning("%s: config.json ties the LM head to the embedding, but the checkpoint stores a "
                        "different lm_head.weight: loading it untied, as transformers does", hf_dir)
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    filler = ParamFiller(registry.abstract_model(cfg), mesh, pdtype)
    table = arch.key_table(cfg)
    ctx = {"expert_layout": _expert_layout_from_headers(
        index, cfg, EXPERT_LAYOUTS.get(expert_layout) if expert_layout else None)}

    seen: set[str] = set()
    unknown: list[str] = []
    for file in files:
        st = SafetensorsFile(file)
        ctx["file"] = str(file)
        for key in st.keys():
            if key not in table:
                if key == arch.head_key and cfg.tie_word_embeddings:
                    continue  # tied: the head is the embedding
                unknown.append(key)
                continue
            rule, targets = table[key]
            ctx["key"] = key
            filler.put(file, key, rule.transform.to_ours(st.get(key), cfg, ctx), targets)
            seen.add(key)
        del st
    if unknown:
        raise CheckpointError(f"{hf_dir}: {len(unknown)} checkpoint keys have no rm_jax param, e.g. "
                              f"{sorted(unknown)[:5]}")
    missing = sorted(k for k in table if k not in seen)
    if missing:
        raise CheckpointError(f"{hf_dir}: {len(missing)} params missing from the checkpoint, e.g. {missing[:5]}")
    model = filler.model(hf_dir, table)
    cfg = dataclasses.replace(cfg, hf_expert_layout=ctx.get("detected_layout") or ctx["expert_layout"],
                              hf_tensor_dtypes={k: index[k][2] for k in seen})
    model.cfg = cfg
    return model, cfg


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------

def _np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def write_sharded(out: Path, tensors: Iterable[tuple[str, np.ndarray]], max_shard_bytes: int) -> list:
    """Write (key, array) pairs as safetensors shards of at most ``max_shard_bytes`` (one
    ``model.safetensors``, or numbered shards plus ``model.safetensors.index.json``), streamed: each
    shard is written (under a temporary name, as the shard count is known only at the end) as soon
    as its tensors arrive, then dropped, so host memory peaks at about one shard rather than the
    whole model. Earlier weight files in ``out`` are removed. Returns each tensor's dtype."""
    for old in list(out.glob("*.safetensors")) + list(out.glob("model.safetensors.index.json")) \
            + list(out.glob("*.safetensors.partial")):
        old.unlink()
    shard: dict[str, np.ndarray] = {}
    size, written, dtypes = 0, [], []    # written: (temporary path, its keys, its bytes)

    def flush():
        nonlocal shard, size
        tmp = out / f"shard-{len(written) + 1:05d}.safetensors.partial"
        write_safetensors(tmp, shard)
        written.append((tmp, list(shard), size))
        shard, size = {}, 0

    for key, tensor in tensors:
        if size and size + tensor.nbytes > max_shard_bytes:
            flush()
        shard[key] = tensor
        size += tensor.nbytes
        dtypes.append(tensor.dtype)
        del tensor
    flush()
    if len(written) == 1:
        written[0][0].rename(out / "model.safetensors")
    else:
        weight_map = {}
        for n, (tmp, keys, _) in enumerate(written, 1):
            name = f"model-{n:05d}-of-{len(written):05d}.safetensors"
            tmp.rename(out / name)
            weight_map.update({k: name for k in keys})
        total = sum(nbytes for _, _, nbytes in written)
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return dtypes


def save_hf(model: "JudgeModel", out_dir, *, dtype=None, expert_layout: str | None = None,
            max_shard_bytes: int = 4 << 30) -> Path:
    """Write safetensors + config.json that transformers' ``from_pretrained`` (of the class the
    config names) loads. ``expert_layout`` defaults to the layout the model was loaded from (else
    transformers')."""
    from rm_jax.model import registry
    cfg = model.cfg
    arch = registry.architecture_of(cfg)
    if arch.save_hf is not None:
        return arch.save_hf(model, out_dir, dtype=dtype, expert_layout=expert_layout,
                            max_shard_bytes=max_shard_bytes)
    layout = EXPERT_LAYOUTS[expert_layout or cfg.hf_expert_layout or "out_in"]
    # Each tensor goes back in the dtype it was loaded from (bf16 -> fp32 -> bf16 is exact, and a
    # checkpoint with fp32 norms among bf16 weights keeps them); ``dtype`` forces one for all.
    # Without a record (a model built here), config.json's "dtype", else the runtime's.
    recorded = dict(cfg.hf_tensor_dtypes or {})
    fallback = _np_dtype(str(dtype or cfg.extra.get("dtype") or cfg.extra.get("torch_dtype")
                             or cfg.runtime.param_dtype))
    forced = _np_dtype(str(dtype)) if dtype is not None else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flat = {p: v for p, v in nnx.to_flat_state(nnx.state(model))}
    ctx = {"expert_layout": layout}

    def tensors():
        for key, (rule, targets) in arch.key_table(cfg).items():
            ours = []
            for target in targets:
                arr = flat[target.path][...]
                ours.append(np.asarray(jax.device_get(arr if target.index is None else arr[target.index])))
            want = forced or (np.dtype(_ST_DTYPES[recorded[key]]) if key in recorded else fallback)
            yield key, np.ascontiguousarray(rule.transform.to_hf(tuple(ours), cfg, ctx)).astype(want, copy=False)

    dtypes = write_sharded(out, tensors(), max_shard_bytes)
    hf_cfg = cfg.to_hf_dict()
    if forced is not None or not any(k in hf_cfg for k in ("dtype", "torch_dtype")):
        # The dtype most tensors have (the source config's own entry is kept otherwise).
        common = forced or max(set(dtypes), key=dtypes.count)
        hf_cfg.pop("torch_dtype", None)
        hf_cfg["dtype"] = "bfloat16" if common == np.dtype(ml_dtypes.bfloat16) else str(common)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    return out
