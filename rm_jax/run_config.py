"""The run config, typed and parsed once.

A run is configured by an ml_collections file (``configs/*.py``, overridden with
``--config.a.b=v`` on the command line). Each entry point turns that dict into a ``RunConfig``
with ``parse`` and hands the typed records down; nothing below the launchers reads the dict.

Design choices:

* **One frozen dataclass per section** (``model``, ``data``, ``train``, ``mesh``, ``moe``, and
  ``rm`` for the scalar RM). Every field has its default and a one-line description
  (``describe()`` prints them). The defaults are the embedded default (``configs/tiny.py``),
  which is built from them, so a default is written once.
* **Refuse, don't guess.** A key the records do not have is refused with its full path
  (``train.stpes``); a value of the wrong kind and combinations that cannot work (a batch the
  accumulation does not divide, two per-position loss terms at once) are refused with the reason,
  at launch rather than deep inside a compiled step.
* **The model section is the checkpoint's own config.json** (transformers keys, nested): the
  architecture's parser (``rm_jax.model.registry``) validates it, and adopting an ``init_from``
  checkpoint's sizes returns a new record. ``model_config`` combines it with the run-time choices
  of ``train`` and ``moe`` into the architecture's typed config: the one place that does.
* ``to_dict`` gives back the ml_collections layout; it is what run manifests record, and a
  manifest's ``config`` parses back into the same record (``score``, ``sweep``, ``serve``).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Mapping

from rm_jax.model import convert, registry
from rm_jax.model.config import ConfigError, RuntimeOptions, plain_dict
from rm_jax.model.layers import ATTENTION_IMPLS
from rm_jax.model.layer_stack import STACK_CODECS
from rm_jax.model.moe import BACKENDS, RAGGED_DOT_IMPLS
from rm_jax.sharding import MeshShape


def _field(default, doc: str, **kw):
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata={"doc": doc}, **kw)
    return dataclasses.field(default=default, metadata={"doc": doc}, **kw)


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The architecture's transformers config (config.json keys, nested ``text_config`` /
    ``vision_config``). Its keys are the architecture's to check (``registry.config_from_hf_dict``):
    real config.json files carry keys rm_jax does not read, and they stay recorded as given."""
    hf: dict = dataclasses.field(default_factory=dict, metadata={
        "doc": "transformers config dict; `model_type` picks the architecture"})

    @property
    def model_type(self) -> str:
        return str(self.hf["model_type"])       # parse refuses a model section without one

    def to_dict(self) -> dict:
        return plain_dict(self.hf)


@dataclasses.dataclass(frozen=True)
class ImageSection:
    max_pixels: int = _field(128 * 128, "the policy's per-image pixel budget (`longest_edge` in Qwen processors)")
    min_pixels: int = _field(16 * 16, "smallest image area after resizing")
    max_image_tokens: int = _field(1024, "per-image cap on merged vision tokens")
    thumbnail_edge: int = _field(512, "longest edge of the images sent to teachers")


@dataclasses.dataclass(frozen=True)
class DataSection:
    dir: str = _field("", "built shards (launch.build_data --out)")
    tokenizer: str = _field("", "tokenizer dir; '' = <input folder>/tokenizer")
    max_len: int = _field(320, "text + image tokens; longer samples are rejected as too_long")
    buckets: tuple = _field((128, 192, 256, 320), "padded lengths: static shapes, few compiles")
    field_order: tuple = _field(("l3", "reason", "issues", "img"), "verdict JSON field order; verdict first")
    oversample_fail: int = _field(3, "failures repeated this many times, training split only")
    adversarial_rate: float = _field(0.0, "share of training samples that also get an attack variant labelled "
                                          "fail (rm_jax.data.attacks; held-out never); 0 = off")
    group_by_prompt: bool = _field(False, "shuffle prompts, keeping a prompt's responses in one batch")
    heldout_fraction: float = _field(0.15, "share of prompt_ids held out")
    calibration_fraction: float = _field(0.15, "share of prompt_ids kept for calibration (scalar RM pairs)")
    split_seed: int = _field(0, "seed of the prompt_id split")
    shard_max_examples: int = _field(2048, "examples per ArrayRecord shard (shards stay small)")
    shard_max_bytes: int = _field(64 << 20, "bytes per ArrayRecord shard")
    pixel_dtype: str = _field("float16", "storage dtype of image patches in the shards")
    image: ImageSection = _field(ImageSection, "image budget")
    tool_contract: str = _field("", "judge instruction for responses that call tools (configs/judge_contracts.py)")
    text_contract: str = _field("", "judge instruction for text-only responses")
    tools_listing: str = _field("template", "how tool schemas are shown: template | signatures | none")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    init_from: str = _field("", "HF checkpoint dir of the policy; '' = random init")
    init_expert_layout: str = _field("", "fused-expert layout when shapes cannot tell (H == 2I): published | transformers")
    steps: int = _field(0, "training steps; 0 = from epochs")
    epochs: float = _field(0.679, "passes over the (oversampled) training stream when steps is 0")
    global_batch: int = _field(16, "examples per optimizer step, all processes")
    grad_accum: int = _field(1, "microbatches per step (global_batch must be a multiple)")
    lr: float = _field(3e-3, "peak learning rate (a random-init tiny model needs far more than SFT's 5e-6)")
    warmup_steps: int = _field(20, "linear warmup steps")
    end_lr_ratio: float = _field(0.1, "final learning rate / peak (cosine decay)")
    weight_decay: float = _field(0.0, "AdamW weight decay")
    b1: float = _field(0.9, "Adam beta1")
    b2: float = _field(0.95, "Adam beta2")
    eps: float = _field(1e-8, "Adam epsilon")
    clip_norm: float = _field(1.0, "global gradient-norm clip")
    mimetic_qk_gain: float = _field(0.0, "random init only: W_Q starts as W_K, q/k norms scaled by this; 0 = off")
    freeze_vision: bool = _field(False, "keep the vision tower fixed")
    dtype: str = _field("float32", "compute dtype (bfloat16 on GPU)")
    param_dtype: str = _field("float32", "master weights and optimizer state")
    mu_dtype: str = _field("", "Adam first moment dtype; '' = param dtype")
    nu_dtype: str = _field("", "Adam second moment storage dtype; '' = param dtype (bfloat16 needs b2 <= 0.99)")
    expert_grad_dtype: str = _field("", "routed-expert gradient dtype; '' = param dtype")
    expert_accum_dtype: str = _field("", "dtype expert gradients are summed in over microbatches; '' = param dtype")
    expert_grad_in_scan: bool = _field(False, "sum routed-expert gradients into the accumulator inside the layer scan "
                                       "(each layer's master slice cast there): no cast copy of the expert stacks and "
                                       "no per-microbatch expert gradient (equal to the plain path)")
    remat: str = _field("none", "rematerialization policy: none | full | dots | dots_no_batch")
    attention: str = _field("auto", "auto | cudnn | xla | blocked (auto: CPU kernel on CPU, cuDNN flash when eligible)")
    scan_layers: bool = _field(True, "lax.scan over homogeneous runs of layers")
    stack_codec: str = _field("none", "none | bf16_bits: bf16 layer stacks scanned as packed bits (bit-identical; "
                              "XLA:CPU otherwise slices an f32 copy of each whole stack)")
    verdict_weight: float = _field(8.0, "loss weight of the verdict token (1.0 = plain token mean)")
    max_target_tokens: int = _field(96, "static per-example target budget (checked, never truncated)")
    vocab_chunk: int = _field(2048, "vocabulary chunk of the cross-entropy")
    max_patches: int = _field(4096, "vision patches per microbatch (static)")
    max_images: int = _field(32, "images per microbatch (static)")
    checkpoint_every: int = _field(200, "steps between checkpoints; 0 = only the last")
    keep: int = _field(0, "checkpoints kept; 0 = all (the sweep scores them all)")
    async_checkpoint: bool = _field(True, "write checkpoints in the background")
    eval_every: int = _field(200, "steps between held-out validations; 0 = off")
    eval_batches: int = _field(16, "held-out batches per validation; 0 = the whole split")
    log_every: int = _field(10, "steps between metrics rows; 0 = only the last")
    tensorboard: bool = _field(True, "also write W/tensorboard/")

    def __post_init__(self):
        if self.global_batch % self.grad_accum:
            raise ConfigError(f"train.global_batch={self.global_batch} is not divisible by "
                              f"train.grad_accum={self.grad_accum}")
        for key in ("log_every", "checkpoint_every", "eval_every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key}={getattr(self, key)}: must be >= 0 (0 = only at the last step)")
        if self.attention not in ATTENTION_IMPLS:
            raise ConfigError(f"train.attention={self.attention!r}; expected one of {tuple(ATTENTION_IMPLS)}")
        if self.stack_codec not in STACK_CODECS:
            raise ConfigError(f"train.stack_codec={self.stack_codec!r}; expected one of {tuple(STACK_CODECS)}")


@dataclasses.dataclass(frozen=True)
class MoeSection:
    backend: str = _field("ragged", "ragged (experts FSDP-sharded) | ep_ring | dense (test oracle)")
    ragged_dot: str = _field("auto", "grouped matmul: auto (CPU: tiled; GPU: tokamax) | tokamax | lax | tiled")
    lb_coef: float = _field(0.01, "load-balancing loss coefficient")
    z_coef: float = _field(0.0, "router z-loss coefficient")

    def __post_init__(self):
        for key, allowed in (("backend", BACKENDS), ("ragged_dot", RAGGED_DOT_IMPLS)):
            if getattr(self, key) not in allowed:
                raise ConfigError(f"moe.{key}={getattr(self, key)!r}; expected one of {tuple(allowed)}")


@dataclasses.dataclass(frozen=True)
class RmSection:
    """The scalar Bradley–Terry RM's run (configs/rm_tiny.py)."""
    steps: int = _field(240, "training steps")
    groups: int = _field(2, "prompt groups per global microbatch (whole groups; a multiple of the process count)")
    rows: int = _field(8, "candidate rows per microbatch: rows/groups slots per group")
    pairs: int = _field(12, "pair slots per microbatch: pairs/groups slots per group")
    grad_accum: int = _field(1, "microbatches per step")
    group_normalize: bool = _field(True, "mean within each prompt, then over prompts")
    center_coef: float = _field(0.01, "coef * ((r_a + r_b) / 2)^2: fixes the reward's zero")
    max_patches: int = _field(4096, "vision patches per microbatch (static)")
    max_images: int = _field(32, "images per microbatch (static)")
    checkpoint_every: int = _field(120, "steps between checkpoints")
    log_every: int = _field(10, "steps between metrics rows")
    eval_rows: int = _field(8, "candidate rows per evaluation microbatch")

    def __post_init__(self):
        for key in ("steps", "groups", "rows", "pairs", "grad_accum", "checkpoint_every", "log_every"):
            if getattr(self, key) < 1 and not (key == "steps" and getattr(self, key) == 0):
                raise ConfigError(f"rm.{key}={getattr(self, key)}: must be >= 1")


# The mesh section is the mesh shape itself (one axis may be -1: the devices the others leave).
_SECTIONS = {"model": ModelSection, "data": DataSection, "train": TrainSection, "mesh": MeshShape,
             "moe": MoeSection, "rm": RmSection}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str = _field("run", "the run's name (recorded in manifests)")
    model: ModelSection = _field(ModelSection, "architecture (transformers config.json keys)")
    data: DataSection = _field(DataSection, "data build and loading")
    mesh: MeshShape = _field(MeshShape, "device mesh: data, fsdp, expert, tensor (one may be -1)")
    train: TrainSection = _field(TrainSection, "judge training")
    moe: MoeSection = _field(MoeSection, "mixture-of-experts execution")
    seed: int = _field(0, "init, shuffling and draws")
    rm: RmSection | None = _field(None, "scalar RM training (None outside configs/rm_tiny.py)")

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "rm":
                continue
            out[f.name] = _to_plain(value)
        return out

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)


def _to_plain(value):
    if isinstance(value, ModelSection):
        return value.to_dict()
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def _coerce(value, default, path: str):
    """A config value as the kind its default is (ml_collections keeps what the file wrote)."""
    kind = type(default)
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}={value!r}: expected true or false")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ConfigError(f"{path}={value!r}: expected an integer")
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}={value!r}: expected a number")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}={value!r}: expected a string")
        return value
    if kind is tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
            raise ConfigError(f"{path}={value!r}: expected a list")
        return tuple(value)
    return value


def _parse_record(cls, values: Mapping, path: str):
    if not isinstance(values, Mapping):
        raise ConfigError(f"{path}: expected a section (a dict of keys), got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key {path}.{unknown[0]}"
                          + (f" (and {', '.join(f'{path}.{k}' for k in unknown[1:])})" if unknown[1:] else "")
                          + f"; {path} has: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in values.items():
        kind = hints[name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            kwargs[name] = _parse_record(kind, value, f"{path}.{name}")
            continue
        f = fields[name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs[name] = _coerce(value, default, f"{path}.{name}")
    return cls(**kwargs)


def parse(cfg: Any) -> RunConfig:
    """An ml_collections ConfigDict (or the plain dict a manifest recorded) -> ``RunConfig``."""
    d = plain_dict(cfg)
    top = {f.name: f for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(d) - set(top))
    if unknown:
        raise ConfigError(f"unknown config key {unknown[0]}; a run config has: {', '.join(top)}")
    kwargs: dict = {}
    for name, value in d.items():
        if name == "model":
            if not isinstance(value, Mapping) or "model_type" not in value:
                raise ConfigError("model: expected the transformers config dict, with its model_type")
            # In config.json's form (lists, not tuples): a manifest's section parses to the same record.
            kwargs[name] = ModelSection(json.loads(json.dumps(plain_dict(value))))
        elif name in _SECTIONS:
            kwargs[name] = None if value is None else _parse_record(_SECTIONS[name], value, name)
        else:
            kwargs[name] = _coerce(value, top[name].default, name)
    run = RunConfig(**kwargs)
    if "model" in d:
        model_config(run)   # the architecture refuses what it cannot represent
    return run


def runtime_options(run: RunConfig) -> RuntimeOptions:
    """The execution choices of ``train`` and ``moe`` the model is built with."""
    t = run.train
    return RuntimeOptions(dtype=t.dtype, param_dtype=t.param_dtype, remat=t.remat, scan_layers=t.scan_layers,
                          moe_backend=run.moe.backend, ragged_dot=run.moe.ragged_dot, attention=t.attention,
                          stack_codec=t.stack_codec)


def model_config(run: RunConfig):
    """The architecture's typed config of a run: its ``model`` section with the run-time options."""
    return registry.config_from_hf_dict(run.model.hf, runtime_options(run))


def adopt_init_config(run: RunConfig) -> RunConfig:
    """With ``train.init_from``, the checkpoint's architecture is the run's: a new record whose
    ``model`` is that config.json, so the mesh check, the manifest and everything that rebuilds the
    model from the manifest (score, sweep, export) see the sizes that were trained."""
    if not run.train.init_from:
        return run
    loaded = convert.read_config(run.train.init_from)
    return run.replace(model=ModelSection(json.loads(json.dumps(plain_dict(loaded.to_hf_dict())))))


def describe(cls=RunConfig, prefix: str = "") -> list[str]:
    """``path = default  # description`` for every field (docs, --help text)."""
    lines = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        kind = typing.get_type_hints(cls)[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind) and kind is not ModelSection:
            lines += describe(kind, f"{path}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else "(section)"
        lines.append(f"{path} = {default!r}  # {f.metadata.get('doc', '')}")
    return lines
