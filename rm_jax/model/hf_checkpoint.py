"""transformers checkpoint <-> rm_jax params: the one load and save loop over an architecture's
key table (``rm_jax.model.hf_table``'s words), with the architecture's hooks in a
``CheckpointFormat``.

Design choices:

* **One loop, per-architecture hooks.** What differs between architectures is data: the key
  table, the embedding key (for the tied-head check), the names ``expert_layout=`` accepts, the
  layout export writes by default, whether experts may come one tensor per expert, and key
  prefixes that are not part of the judge (Qwen3.5's ``mtp.*`` head). Nothing here names an
  architecture; ``rm_jax.model.convert`` picks the format by ``model_type``.
* **Per-expert checkpoints** (``experts.{e}.{gate,up,down}_proj.weight``, what transformers 5.x's
  ``save_pretrained`` writes for Qwen3.5) are gathered on the host into the fused ``out_in``
  tensors and then go through the same fused transform, so there is one expert conversion;
  export splits them back when that is the checkpoint's layout.
* **Memory.** Each tensor (from a memory-mapped safetensors file: ``safetensors_io``) is
  transformed on the host and put straight onto its target sharding; stacked (scanned) params are
  allocated sharded and filled layer by layer with a donated ``dynamic_update_index_in_dim``, so
  no device ever holds the whole model. Export streams shards of bounded size.
* **Bit-exact round trips.** Load records each tensor's dtype and the expert layout; export writes
  both back unless told otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from rm_jax.model.hf_table import Rule, Target
from rm_jax.model.placement import param_shardings
from rm_jax.model.safetensors_io import (_ST_DTYPES, CheckpointError, SafetensorsFile, checkpoint_files,
                                         write_safetensors)

KeyTable = dict[str, tuple[Rule, tuple[Target, ...]]]


@dataclasses.dataclass(frozen=True)
class CheckpointFormat:
    """How one architecture's checkpoints are laid out, beyond its key table."""
    key_table: Callable[[Any], KeyTable]         # cfg -> every concrete (fused-layout) HF key
    embed_key: Callable[[Any], str]              # cfg -> HF key of the input embedding
    expert_layouts: Mapping[str, str]            # names ``expert_layout=`` accepts -> the layout
    export_layout: str                           # written when neither the flag nor the load says
    head_key: str = "lm_head.weight"
    per_expert: bool = False                     # experts may be stored one tensor per expert
    # Key prefixes that are not part of the judge -> what they hold (skipped, counted in the log).
    ignored_prefixes: Mapping[str, str] = dataclasses.field(default_factory=dict)


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
    filled exactly."""

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

    def model(self, hf_dir, table: KeyTable):
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
# Per-expert keys <-> the fused form
# ---------------------------------------------------------------------------------------------

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class _ExpertGather:
    """Collects one layer's per-expert tensors (possibly spread over shards) and, once all 3*E
    are in, emits the fused ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""

    def __init__(self, num_experts: int):
        self.e = num_experts
        self.parts: dict[str, dict[tuple[int, str], np.ndarray]] = {}

    def add(self, key: str, array: np.ndarray):
        prefix, e, which = _PER_EXPERT.match(key).groups()
        if int(e) >= self.e:
            raise CheckpointError(f"{key}: expert {e} but the config has num_experts={self.e}")
        got = self.parts.setdefault(prefix, {})
        got[(int(e), which)] = np.asarray(array)
        if len(got) < 3 * self.e:
            return []
        del self.parts[prefix]
        gate_up = np.stack([np.concatenate([got[(e, "gate")], got[(e, "up")]], 0) for e in range(self.e)])
        down = np.stack([got[(e, "down")] for e in range(self.e)])
        return [(prefix + ".gate_up_proj", gate_up), (prefix + ".down_proj", down)]

    def check_complete(self, hf_dir):
        if self.parts:
            prefix, got = next(iter(self.parts.items()))
            raise CheckpointError(f"{hf_dir}: {prefix}.* holds {len(got)} of the {3 * self.e} per-expert tensors")


def _split_experts(key: str, tensor: np.ndarray, cfg):
    """A fused ``out_in`` expert tensor -> its per-expert keys and tensors (the gather's inverse)."""
    if key.endswith("mlp.experts.gate_up_proj"):
        i = cfg.text.moe_intermediate_size
        prefix = key[:-len(".gate_up_proj")]
        for e in range(cfg.text.num_experts):
            yield f"{prefix}.{e}.gate_proj.weight", np.ascontiguousarray(tensor[e, :i])
            yield f"{prefix}.{e}.up_proj.weight", np.ascontiguousarray(tensor[e, i:])
    elif key.endswith("mlp.experts.down_proj"):
        prefix = key[:-len(".down_proj")]
        for e in range(cfg.text.num_experts):
            yield f"{prefix}.{e}.down_proj.weight", np.ascontiguousarray(tensor[e])
    else:
        yield key, tensor


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------

def _header_index(files) -> dict[str, tuple[Path, tuple, str]]:
    """{key: (file, shape, safetensors dtype)} from the shard headers alone (no tensor data)."""
    index = {}
    for file in files:
        st = SafetensorsFile(file)
        index.update({k: (Path(file), st.shape(k), st.header[k]["dtype"]) for k in st.keys()})
    return index


def _fused_layout_from_headers(index, cfg, given: str | None) -> str | None:
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


def _expert_layout(index, cfg, fmt: CheckpointFormat, given: str | None) -> str | None:
    """"per_expert" when the checkpoint stores experts one tensor each (and the format allows it),
    else the fused layout (``_fused_layout_from_headers``)."""
    if fmt.per_expert and any(_PER_EXPERT.match(k) for k in index):
        if given not in (None, "per_expert"):
            raise CheckpointError(f"the checkpoint stores per-expert tensors, but expert_layout={given!r}")
        return "per_expert"
    return _fused_layout_from_headers(index, cfg, given)


def _stored_head_differs(index, cfg, keys: tuple[str, str]) -> bool:
    """A tied config, yet the checkpoint stores an ``lm_head.weight`` that differs from the
    embedding: transformers then does not tie them (it warns), so neither do we."""
    if not cfg.tie_word_embeddings or not all(k in index for k in keys):
        return False
    head, embed = (SafetensorsFile(index[k][0]).get(k) for k in keys)
    return head.shape != embed.shape or head.dtype != embed.dtype or not np.array_equal(head.view(np.uint8),
                                                                                         embed.view(np.uint8))


def load_params(hf_dir, cfg, fmt: CheckpointFormat, abstract_model: Callable[[Any], Any], *, mesh, pdtype,
                expert_layout: str | None = None):
    """Fill ``abstract_model(cfg)`` from the safetensors in ``hf_dir`` -> (model, cfg), the config
    recording the expert layout and each tensor's dtype (export writes them back)."""
    if expert_layout is not None and expert_layout not in fmt.expert_layouts:
        raise ValueError(f"expert_layout={expert_layout!r}; expected one of {sorted(fmt.expert_layouts)}")
    files = checkpoint_files(hf_dir)
    index = _header_index(files)
    if _stored_head_differs(index, cfg, (fmt.head_key, fmt.embed_key(cfg))):
        logging.warning("%s: config.json ties the LM head to the embedding, but the checkpoint stores a "
                        "different lm_head.weight: loading it untied, as transformers does", hf_dir)
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    filler = ParamFiller(abstract_model(cfg), mesh, pdtype)
    table = fmt.key_table(cfg)
    layout = _expert_layout(index, cfg, fmt, fmt.expert_layouts[expert_layout] if expert_layout else None)
    # Gathered per-expert tensors are in the fused out_in form.
    ctx = {"expert_layout": "out_in" if layout == "per_expert" else layout}
    gather = _ExpertGather(cfg.text.num_experts) if layout == "per_expert" else None
    read: list[str] = []          # checkpoint keys whose tensors went into params
    seen: set[str] = set()        # table keys filled
    unknown: list[str] = []
    ignored = {prefix: 0 for prefix in fmt.ignored_prefixes}

    def put(key, array, file):
        rule, targets = table[key]
        ctx["key"], ctx["file"] = key, str(file)
        filler.put(file, key, rule.transform.to_ours(array, cfg, ctx), targets)
        seen.add(key)

    for file in files:
        st = SafetensorsFile(file)
        for key in st.keys():
            if key in table:
                put(key, st.get(key), file)
            elif gather is not None and _PER_EXPERT.match(key):
                for fused_key, arr in gather.add(key, st.get(key)):
                    put(fused_key, arr, file)
            elif key == fmt.head_key and cfg.tie_word_embeddings:
                continue  # tied: the head is the embedding
            elif key.startswith(tuple(ignored)):
                ignored[next(p for p in ignored if key.startswith(p))] += 1
                continue
            else:
                unknown.append(key)
                continue
            read.append(key)
        del st
    for prefix, count in ignored.items():
        if count:
            logging.info("%s: ignoring %d %s* tensors (%s is not part of the judge)", hf_dir, count, prefix,
                         fmt.ignored_prefixes[prefix])
    if gather is not None:
        gather.check_complete(hf_dir)
    if unknown:
        raise CheckpointError(f"{hf_dir}: {len(unknown)} checkpoint keys have no rm_jax param, e.g. "
                              f"{sorted(unknown)[:5]}")
    missing = sorted(k for k in table if k not in seen)
    if missing:
        raise CheckpointError(f"{hf_dir}: {len(missing)} params missing from the checkpoint, e.g. {missing[:5]}")
    model = filler.model(hf_dir, table)
    cfg = dataclasses.replace(cfg, hf_expert_layout=layout if layout == "per_expert" else
                              ctx.get("detected_layout") or ctx["expert_layout"],
                              hf_tensor_dtypes={k: index[k][2] for k in read})
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


def save_params(model, out_dir, fmt: CheckpointFormat, *, dtype=None, expert_layout: str | None = None,
                max_shard_bytes: int = 4 << 30) -> Path:
    """Write ``model`` as safetensors + config.json that transformers' ``from_pretrained`` (of the
    class the config names) loads. ``expert_layout`` defaults to the layout the model was loaded
    from, else the format's ``export_layout``."""
    cfg = model.cfg
    layout = fmt.expert_layouts[expert_layout or cfg.hf_expert_layout or fmt.export_layout]
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
    ctx = {"expert_layout": "out_in" if layout == "per_expert" else layout}

    def stored(key: str, tensor: np.ndarray) -> np.ndarray:
        want = forced or (np.dtype(_ST_DTYPES[recorded[key]]) if key in recorded else fallback)
        return tensor.astype(want, copy=False)

    # Host memory holds one shard plus one key's tensors in flight: a key's arrays live in its own
    # generator frame, freed when the next key starts.
    def key_tensors(key: str, rule: Rule, targets: tuple[Target, ...]):
        ours = []
        for target in targets:
            arr = flat[target.path][...]
            ours.append(np.asarray(jax.device_get(arr if target.index is None else arr[target.index])))
        hf_tensor = np.ascontiguousarray(rule.transform.to_hf(tuple(ours), cfg, ctx))
        del ours
        if layout == "per_expert":
            for expert_key, piece in _split_experts(key, hf_tensor, cfg):
                yield expert_key, stored(expert_key, piece)
        else:
            yield key, stored(key, hf_tensor)

    def tensors():
        for key, (rule, targets) in fmt.key_table(cfg).items():
            yield from key_tensors(key, rule, targets)

    dtypes = write_sharded(out, tensors(), max_shard_bytes)
    hf_cfg = cfg.to_hf_dict()
    if forced is not None or not any(k in hf_cfg for k in ("dtype", "torch_dtype")):
        # The dtype most tensors have (the source config's own entry is kept otherwise).
        common = forced or max(set(dtypes), key=dtypes.count)
        hf_cfg.pop("torch_dtype", None)
        hf_cfg["dtype"] = "bfloat16" if common == np.dtype(ml_dtypes.bfloat16) else str(common)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    return out
