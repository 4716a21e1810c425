"""One mesh, one logical-axis rules table.

Every weight and key activation in rm_jax carries *logical* axis names (``embed``, ``mlp``,
``heads``, ``kv``, ``vocab``, ``exp``, ``batch``, ``length``...). Only this module knows how those
names map onto the four physical mesh axes ``data, fsdp, expert, tensor``. Changing a parallelism
layout therefore means changing a mesh shape in the config, never touching model code.

Design choices:

* The mesh axes carry explicit ``axis_types`` (``Auto``): the compiler propagates shardings from
  the constraints we place, which is what the logical-rules style expects. Passing them explicitly
  keeps the behaviour identical across jax 0.10 (CPU here) and jax >= 0.11 (GPU hosts), whose
  defaults differ.
* The ``expert`` axis also shards the batch outside MoE layers (docs/operations.md, "Meshes"), so an EP=8 mesh still
  uses all eight devices for attention.
* A mesh that does not match the device count, or an expert count the ``expert`` axis does not
  divide, fails at start with a message naming the numbers that disagree. The field report lost
  time to exactly this class of error surfacing deep inside a compiled step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert", "tensor")

# The one rules table: logical name -> mesh axis (or tuple of axes, or None = replicated).
# Weights are sharded FSDP-style over `fsdp` on their model dimension; activations shard
# their batch over every axis that is not a model-parallel axis.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_vocab", "tensor"),
    # tokens routed inside an MoE layer (flattened batch*length)
    ("tokens", ("data", "fsdp", "expert")),
    # weights. `embed` is ZeRO-3 sharded over every data-like axis: the `expert` axis carries
    # batch outside MoE layers, so non-expert weights shard over it too (expert weights use it
    # for `exp` first, and a mesh axis is never used twice in one spec).
    ("embed", ("fsdp", "expert")),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("kv", None),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("exp", "expert"),
    ("norm", None),
    # vision tower (~0.5B params at 30B-A3B): FSDP-sharded like the decoder
    ("vis_embed", "fsdp"),
    ("vis_mlp", "tensor"),
    ("vis_heads", "tensor"),
    ("patch", None),
)

_RULES = dict(LOGICAL_RULES)


class MeshConfigError(ValueError):
    """A mesh shape that cannot work on these devices or with this model."""


def _axis(doc: str):
    return dataclasses.field(default=1, metadata={"doc": doc})


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """The mesh section of a run config: devices per axis; one axis may be -1 (the rest)."""
    data: int = _axis("pure data parallelism (replicated weights)")
    fsdp: int = _axis("batch and ZeRO-3 weight sharding")
    expert: int = _axis("expert parallelism for routed experts; batch outside MoE layers")
    tensor: int = _axis("tensor parallelism over heads, mlp and vocab")

    @classmethod
    def from_config(cls, cfg) -> "MeshShape":
        """A mapping of axis sizes (missing axes are 1); an unknown axis is refused."""
        unknown = sorted(set(cfg) - set(MESH_AXES))
        if unknown:
            raise MeshConfigError(f"unknown mesh axis mesh.{unknown[0]}; the axes are {MESH_AXES}")
        return cls(**{a: int(cfg[a]) for a in cfg})

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in MESH_AXES)

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    def __str__(self) -> str:
        return "(" + ", ".join(f"{a}={s}" for a, s in zip(MESH_AXES, self.sizes) if s != 1) + ")" if self.size > 1 else "(single device)"


def validate_mesh_shape(shape: MeshShape, n_devices: int, *, num_experts: int | None = None,
                        global_batch: int | None = None) -> None:
    """Fail early, naming the numbers that disagree."""
    for axis, size in zip(MESH_AXES, shape.sizes):
        if size < 1:   # (-1 wildcards are filled by make_mesh before validation)
            raise MeshConfigError(f"mesh axis '{axis}' has size {size}; every axis must be >= 1")
    if shape.size != n_devices:
        raise MeshConfigError(
            f"mesh {shape} has {' x '.join(map(str, shape.sizes))} = {shape.size} devices "
            f"but {n_devices} devices are available; the product of data*fsdp*expert*tensor "
            f"must equal the device count")
    if num_experts is not None and num_experts % shape.expert != 0:
        raise MeshConfigError(
            f"num_experts={num_experts} is not divisible by the mesh 'expert' axis size "
            f"{shape.expert}; each expert-parallel rank must hold the same number of experts")
    if global_batch is not None:
        batch_shards = shape.data * shape.fsdp * shape.expert
        if global_batch % batch_shards != 0:
            raise MeshConfigError(
                f"batch {global_batch} per step (the microbatch: train.global_batch / train.grad_accum) "
                f"is not divisible by data*fsdp*expert = {shape.data}*{shape.fsdp}*{shape.expert} = {batch_shards}")


def fill_wildcard(shape: MeshShape, n_devices: int) -> MeshShape:
    """One axis may be -1: it takes whatever the other axes leave of the device count."""
    sizes = dict(zip(MESH_AXES, shape.sizes))
    wild = [a for a, s in sizes.items() if s == -1]
    if not wild:
        return shape
    if len(wild) > 1:
        raise MeshConfigError(f"mesh axes {wild} are all -1; at most one axis may be -1")
    rest = math.prod(s for a, s in sizes.items() if s != -1)
    if n_devices % rest:
        raise MeshConfigError(f"mesh axis '{wild[0]}'=-1 cannot fill {n_devices} devices: the other axes "
                              f"multiply to {rest}, which does not divide {n_devices}")
    sizes[wild[0]] = n_devices // rest
    return MeshShape(**sizes)


def make_mesh(cfg=None, *, devices: Sequence[jax.Device] | None = None, num_experts: int | None = None,
              global_batch: int | None = None) -> Mesh:
    """Build the (data, fsdp, expert, tensor) mesh from a config mapping or ``MeshShape``.

    ``cfg`` may be None (all devices on ``data``), a ``MeshShape``, or anything with
    ``data/fsdp/expert/tensor`` keys or attributes (missing axes default to 1; one axis may be -1
    to take the remaining devices).
    """
    devices = list(devices if devices is not None else jax.devices())
    if cfg is None:
        shape = MeshShape(data=len(devices))
    elif isinstance(cfg, MeshShape):
        shape = cfg
    else:
        shape = MeshShape.from_config(cfg)
    shape = fill_wildcard(shape, len(devices))
    validate_mesh_shape(shape, len(devices), num_experts=num_experts, global_batch=global_batch)
    dev_array = np.asarray(devices).reshape(shape.sizes)
    return Mesh(dev_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(names: Iterable[str | None], rules=None) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec, never using one mesh axis twice."""
    table = _RULES if rules is None else dict(rules)
    used: set[str] = set()
    out = []
    for name in names:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis '{name}' is not in the rules table (rm_jax/sharding.py)")
        target = table[name]
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def named_sharding(mesh: Mesh, names: Iterable[str | None]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names))


def _current_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return None
    return mesh


def constrain(x, names: Sequence[str | None]):
    """`with_sharding_constraint` by logical names; a no-op when no mesh is set.

    Axes whose dimension the mesh axes do not divide are left unsharded rather than failing,
    so tiny test shapes work on any mesh.
    """
    mesh = _current_mesh()
    if mesh is None:
        return x
    spec = logical_to_spec(names)
    fixed = []
    for dim, entry in zip(x.shape, spec):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        size = math.prod(mesh.shape[a] for a in axes) if axes else 1
        fixed.append(entry if size > 1 and dim % size == 0 else None)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*fixed))


def describe_devices() -> dict:
    devs = jax.devices()
    return {"platform": devs[0].platform, "count": len(devs), "process_count": jax.process_count(),
            "kinds": sorted({d.device_kind for d in devs})}
