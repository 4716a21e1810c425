"""Typed Qwen3.5-MoE configuration, parsed once from (and written back to) config.json.

Design choices:

* Two checkpoint kinds share one record: the multimodal ``qwen3_5_moe``
  (``text_config`` + ``vision_config``) and the text-only ``qwen3_5_moe_text`` (flat keys,
  ``Qwen3_5MoeForCausalLM``); ``vision`` is None for the latter and ``to_hf_dict`` writes the
  same kind back.
* ``layer_types`` is read as is (any pattern of ``linear_attention`` / ``full_attention``); when it
  is absent, transformers' default (every ``full_attention_interval``-th layer full) is applied.
* Keys we do not model are kept verbatim in ``extra`` so HF -> rm_jax -> HF loses nothing.
* The vision tower is Qwen3-VL's (rm_jax.model.vision) without deepstack; its config is parsed by
  the Qwen3-VL parser and a deepstack index is refused.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping

from rm_jax.model.config import ConfigError, RuntimeOptions
from rm_jax.model.config import plain_dict as _plain
from rm_jax.model.config import required as _required
from rm_jax.model.vision_config import VisionConfig
from rm_jax.model.vision_config import vision_from_hf as _vision_from_hf
from rm_jax.model.gated_deltanet import GatedDeltaNetConfig

LAYER_KINDS = ("linear_attention", "full_attention")
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
_TEXT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
              "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
              "attention_bias", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
              "linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size",
              "shared_expert_intermediate_size", "num_experts_per_tok", "num_experts", "layer_types",
              "full_attention_interval", "model_type", "architectures")
_TOP_KEYS = ("model_type", "architectures", "image_token_id", "video_token_id", "vision_start_token_id",
             "vision_end_token_id", "tie_word_embeddings", "text_config", "vision_config")


@dataclasses.dataclass(frozen=True)
class Qwen35TextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    mrope_interleaved: bool = True
    max_position_embeddings: int = 32768
    # The router always renormalises its top-k weights (transformers' Qwen3_5MoeTopKRouter).
    norm_topk_prob: bool = True
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"text_config.layer_types has {len(self.layer_types)} entries; "
                              f"num_hidden_layers={self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if bad:
            raise ConfigError(f"text_config.layer_types: unknown kind(s) {bad}; expected {LAYER_KINDS}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"text_config.num_attention_heads={self.num_attention_heads} is not a multiple "
                              f"of num_key_value_heads={self.num_key_value_heads}")
        rd = self.rotary_dim
        if rd <= 0 or rd % 2 or rd > self.head_dim:
            raise ConfigError(f"text_config: head_dim={self.head_dim} * partial_rotary_factor="
                              f"{self.partial_rotary_factor} gives rotary dim {rd}; it must be even and in "
                              f"(0, head_dim]")
        if sum(self.mrope_section) != rd // 2:
            raise ConfigError(f"text_config.rope_parameters.mrope_section={list(self.mrope_section)} sums to "
                              f"{sum(self.mrope_section)}; the rotary dim {rd} has {rd // 2} frequency slots")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"text_config.num_experts_per_tok={self.num_experts_per_tok} must be in "
                              f"[1, num_experts={self.num_experts}]")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"text_config.linear_num_value_heads={self.linear_num_value_heads} is not a "
                              f"multiple of linear_num_key_heads={self.linear_num_key_heads}")

    def is_sparse(self, layer: int) -> bool:
        """Every Qwen3.5-MoE layer routes its FFN through experts (same query as Qwen3-VL's config)."""
        return 0 <= layer < self.num_hidden_layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def gdn(self, backend: str = "xla") -> GatedDeltaNetConfig:
        return GatedDeltaNetConfig(
            hidden_size=self.hidden_size, num_key_heads=self.linear_num_key_heads,
            num_value_heads=self.linear_num_value_heads, key_head_dim=self.linear_key_head_dim,
            value_head_dim=self.linear_value_head_dim, conv_kernel=self.linear_conv_kernel_dim,
            eps=self.rms_norm_eps, backend=backend)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_types) if k == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_types) if k == "linear_attention")


@dataclasses.dataclass(frozen=True)
class Qwen35MoeConfig:
    text: Qwen35TextConfig
    vision: VisionConfig | None            # None: a text-only (ForCausalLM) checkpoint
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    tie_word_embeddings: bool = False
    runtime: RuntimeOptions = dataclasses.field(default_factory=RuntimeOptions)
    gdn_backend: str = "xla"               # a key of gated_deltanet.GDN_BACKENDS (run-time choice)
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    # The on-disk expert layout of the checkpoint this came from ("per_expert" | "out_in" |
    # "in_out") and each tensor's safetensors dtype: export writes both back (bit-exact round trip).
    hf_expert_layout: str | None = dataclasses.field(default=None, compare=False)
    hf_tensor_dtypes: Mapping[str, str] | None = dataclasses.field(default=None, compare=False)

    model_type = "qwen3_5_moe"

    @property
    def text_only(self) -> bool:
        return self.vision is None

    def replace_runtime(self, **kw) -> "Qwen35MoeConfig":
        return dataclasses.replace(self, runtime=dataclasses.replace(self.runtime, **kw))

    # -- HF dict <-> typed config ---------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], runtime: RuntimeOptions | None = None) -> "Qwen35MoeConfig":
        d = _plain(d)
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"config: model_type={model_type!r}; this parser reads {MODEL_TYPES}")
        runtime = runtime or RuntimeOptions()
        if model_type == "qwen3_5_moe_text":
            text = _required(_text_from_hf, dict(d), "config")
            return cls(text=text, vision=None, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                       runtime=runtime)
        for key in ("text_config", "vision_config"):
            if key not in d:
                raise ConfigError(f"config: a qwen3_5_moe config needs {key!r}; got keys {sorted(d)}")
        text = _required(_text_from_hf, dict(d["text_config"]), "text_config")
        vision = _required(_vision_from_hf, dict(d["vision_config"]), "vision_config")
        if vision.deepstack_visual_indexes:
            raise ConfigError("vision_config.deepstack_visual_indexes: Qwen3.5's vision tower has no deepstack")
        return cls(text=text, vision=vision,
                   image_token_id=int(d.get("image_token_id", 248056)),
                   video_token_id=int(d.get("video_token_id", 248057)),
                   vision_start_token_id=int(d.get("vision_start_token_id", 248053)),
                   vision_end_token_id=int(d.get("vision_end_token_id", 248054)),
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), runtime=runtime,
                   extra={k: v for k, v in d.items() if k not in _TOP_KEYS})

    def to_hf_dict(self) -> dict[str, Any]:
        t = self.text
        text = dict(copy.deepcopy(dict(t.extra)))
        text.update(
            model_type="qwen3_5_moe_text", vocab_size=t.vocab_size, hidden_size=t.hidden_size,
            num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
            num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, hidden_act="silu",
            attention_bias=False, layer_types=list(t.layer_types),
            moe_intermediate_size=t.moe_intermediate_size,
            shared_expert_intermediate_size=t.shared_expert_intermediate_size,
            num_experts=t.num_experts, num_experts_per_tok=t.num_experts_per_tok,
            linear_num_key_heads=t.linear_num_key_heads, linear_num_value_heads=t.linear_num_value_heads,
            linear_key_head_dim=t.linear_key_head_dim, linear_value_head_dim=t.linear_value_head_dim,
            linear_conv_kernel_dim=t.linear_conv_kernel_dim, rms_norm_eps=t.rms_norm_eps,
            max_position_embeddings=t.max_position_embeddings, tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters=dict(rope_type="default", rope_theta=t.rope_theta,
                                 partial_rotary_factor=t.partial_rotary_factor,
                                 mrope_section=list(t.mrope_section), mrope_interleaved=t.mrope_interleaved),
        )
        if self.vision is None:
            text["architectures"] = ["Qwen3_5MoeForCausalLM"]
            return text
        v = self.vision
        vision = dict(copy.deepcopy(dict(v.extra)))
        vision.update(
            model_type="qwen3_5_moe_vision", depth=v.depth, hidden_size=v.hidden_size,
            intermediate_size=v.intermediate_size, num_heads=v.num_heads, in_channels=v.in_channels,
            patch_size=v.patch_size, spatial_merge_size=v.spatial_merge_size,
            temporal_patch_size=v.temporal_patch_size, out_hidden_size=v.out_hidden_size,
            num_position_embeddings=v.num_position_embeddings, hidden_act="gelu_pytorch_tanh",
            rope_parameters=dict(rope_type="axial", rope_theta=v.rope_theta))
        out = dict(copy.deepcopy(dict(self.extra)))
        out.update(model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"],
                   image_token_id=self.image_token_id, video_token_id=self.video_token_id,
                   vision_start_token_id=self.vision_start_token_id,
                   vision_end_token_id=self.vision_end_token_id, tie_word_embeddings=self.tie_word_embeddings,
                   text_config=text, vision_config=vision)
        return out


def _text_from_hf(t: dict) -> Qwen35TextConfig:
    rope = dict(t.get("rope_scaling") or t.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"text_config.rope_parameters.rope_type={rope_type!r}: only 'default' "
                          "(interleaved MRoPE) is implemented")
    if t.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"text_config.hidden_act={t['hidden_act']!r}: only 'silu' is implemented")
    if t.get("attention_bias", False):
        raise ConfigError("text_config.attention_bias=true is not implemented")
    n_layers = int(t.get("num_hidden_layers", 40))
    layer_types = t.get("layer_types")
    if layer_types is None:    # transformers' default pattern
        interval = int(t.get("full_attention_interval", 4))
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    n_heads = int(t.get("num_attention_heads", 16))
    # Absent keys take transformers' Qwen3_5MoeTextConfig defaults (its config.json may omit them).
    return Qwen35TextConfig(
        vocab_size=int(t.get("vocab_size", 248320)), hidden_size=int(t.get("hidden_size", 2048)),
        num_hidden_layers=n_layers, num_attention_heads=n_heads,
        num_key_value_heads=int(t.get("num_key_value_heads") or 2), head_dim=int(t.get("head_dim") or 256),
        layer_types=tuple(str(k) for k in layer_types),
        moe_intermediate_size=int(t.get("moe_intermediate_size", 512)),
        shared_expert_intermediate_size=int(t.get("shared_expert_intermediate_size", 512)),
        num_experts=int(t.get("num_experts", 256)), num_experts_per_tok=int(t.get("num_experts_per_tok", 8)),
        linear_num_key_heads=int(t.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(t.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(t.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(t.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(t.get("linear_conv_kernel_dim", 4)),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 10_000_000.0))),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))),
        mrope_section=tuple(int(s) for s in rope.get("mrope_section", (11, 11, 10))),
        mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
        max_position_embeddings=int(t.get("max_position_embeddings", 32768)),
        extra={k: v for k, v in t.items() if k not in _TEXT_KEYS},
    )
