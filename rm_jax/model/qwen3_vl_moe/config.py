"""Qwen3-VL-MoE's typed config, built from (and written back to) its transformers config dict.

Design choices:

* The HF ``config.json`` is the source of truth for sizes: ``ModelConfig.from_hf_dict`` reads the
  keys transformers' ``Qwen3VLMoeConfig`` writes (and the older ``rope_scaling``/``rope_theta`` and
  ``num_local_experts`` spellings found in published checkpoints), and ``to_hf_dict`` writes a dict
  that ``from_pretrained`` accepts. Keys we do not model are kept verbatim in ``*_extra`` so an
  HF -> rm_jax -> HF round trip loses nothing.
* Run-time choices that are not part of the architecture (dtype, MoE backend, remat, scanning) live
  in ``RuntimeOptions`` (``rm_jax.model.config``); they never reach ``config.json``.
* ``model_type`` must be ``qwen3_vl_moe`` (or absent): another architecture's config.json, e.g.
  Qwen3.5's, is refused by name instead of being parsed field by field.
* Which decoder layers are sparse follows transformers exactly: a layer is an MoE layer iff it is not
  in ``mlp_only_layers``, ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``;
  ``layer_specs`` states it as one ``LayerSpec`` per layer (every mixer is attention).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping

from rm_jax.model.config import ConfigError, RuntimeOptions, plain_dict, required
from rm_jax.model.layer_stack import LayerSpec
from rm_jax.model.vision_config import VisionConfig, vision_from_hf, vision_to_hf

MODEL_TYPE = "qwen3_vl_moe"

_TEXT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "num_experts", "num_experts_per_tok", "decoder_sparse_step", "mlp_only_layers",
              "rms_norm_eps", "hidden_act", "attention_bias", "max_position_embeddings",
              "tie_word_embeddings", "rope_parameters", "rope_scaling",
              "rope_theta", "num_local_experts", "model_type")
_TOP_KEYS = ("model_type", "image_token_id", "video_token_id", "vision_start_token_id",
             "vision_end_token_id", "tie_word_embeddings", "text_config", "vision_config")


@dataclasses.dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    mrope_interleaved: bool = True
    max_position_embeddings: int = 262144
    norm_topk_prob: bool = True
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type = MODEL_TYPE            # class constant: the registry key (not a dataclass field)

    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    tie_word_embeddings: bool = False
    runtime: RuntimeOptions = dataclasses.field(default_factory=RuntimeOptions)
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    # On-disk fused-expert layout of the checkpoint this came from ("in_out" | "out_in"); export
    # writes the same layout back so a round trip is bit-exact.
    hf_expert_layout: str | None = dataclasses.field(default=None, compare=False)
    # Safetensors dtype of each tensor of that checkpoint ({hf key: "BF16" | "F32" ...}); export
    # writes each one back in its own dtype.
    hf_tensor_dtypes: Mapping[str, str] | None = dataclasses.field(default=None, compare=False)

    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """One record per decoder layer: attention, then a dense MLP or the sparse MoE block."""
        return tuple(LayerSpec("attention", "moe" if self.text.is_sparse(i) else "dense")
                     for i in range(self.text.num_hidden_layers))

    def replace_runtime(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, runtime=dataclasses.replace(self.runtime, **kw))

    # -- HF dict <-> typed config ---------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], runtime: RuntimeOptions | None = None) -> "ModelConfig":
        d = plain_dict(d)
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ConfigError(f"config: model_type={d['model_type']!r} is not a Qwen3-VL-MoE config "
                              f"(expected {MODEL_TYPE!r}); rm_jax.model.registry picks the parser by model_type")
        if "text_config" not in d or "vision_config" not in d:
            raise ConfigError("config: expected a Qwen3-VL-MoE config with 'text_config' and "
                              f"'vision_config'; got keys {sorted(d)}")
        t, v = dict(d["text_config"]), dict(d["vision_config"])
        text = required(_text_from_hf, t, "text_config")
        vision = required(vision_from_hf, v, "vision_config")
        # transformers ties by the top-level key only (default False), whatever text_config says.
        tie = bool(d.get("tie_word_embeddings", False))
        return cls(
            text=text, vision=vision,
            image_token_id=int(d.get("image_token_id", 151655)),
            video_token_id=int(d.get("video_token_id", 151656)),
            vision_start_token_id=int(d.get("vision_start_token_id", 151652)),
            vision_end_token_id=int(d.get("vision_end_token_id", 151653)),
            tie_word_embeddings=tie,
            runtime=runtime or RuntimeOptions(),
            extra={k: val for k, val in d.items() if k not in _TOP_KEYS},
        )

    def to_hf_dict(self) -> dict[str, Any]:
        t, v = self.text, self.vision
        text = dict(copy.deepcopy(dict(t.extra)))
        text.update(
            model_type="qwen3_vl_moe_text", vocab_size=t.vocab_size, hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size, moe_intermediate_size=t.moe_intermediate_size,
            num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
            num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim,
            num_experts=t.num_experts, num_experts_per_tok=t.num_experts_per_tok,
            decoder_sparse_step=t.decoder_sparse_step, mlp_only_layers=list(t.mlp_only_layers),
            rms_norm_eps=t.rms_norm_eps, hidden_act="silu", attention_bias=False,
            max_position_embeddings=t.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters=dict(rope_type="default", rope_theta=t.rope_theta,
                                 mrope_section=list(t.mrope_section),
                                 mrope_interleaved=t.mrope_interleaved),
        )
        vision = vision_to_hf(v, "qwen3_vl_moe_vision")
        out = dict(copy.deepcopy(dict(self.extra)))
        out.update(model_type=MODEL_TYPE, architectures=["Qwen3VLMoeForConditionalGeneration"],
                   image_token_id=self.image_token_id, video_token_id=self.video_token_id,
                   vision_start_token_id=self.vision_start_token_id,
                   vision_end_token_id=self.vision_end_token_id,
                   tie_word_embeddings=self.tie_word_embeddings,
                   text_config=text, vision_config=vision)
        return out


def _text_from_hf(t: dict) -> TextConfig:
    # As transformers reads it: a (legacy) rope_scaling dict wins over rope_parameters, and a
    # text-level rope_theta only fills a dict that has none.
    rope = dict(t.get("rope_scaling") or t.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"text_config.rope_parameters.rope_type={rope_type!r}: only 'default' "
                          "(plain interleaved MRoPE) is implemented")
    theta = rope.get("rope_theta", t.get("rope_theta", 5_000_000.0))
    act = t.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"text_config.hidden_act={act!r}: only 'silu' is implemented")
    if t.get("attention_bias", False):
        raise ConfigError("text_config.attention_bias=true is not implemented")
    n_heads = int(t["num_attention_heads"])
    num_experts = t.get("num_experts", t.get("num_local_experts", 0))
    known = set(_TEXT_KEYS)
    return TextConfig(
        vocab_size=int(t["vocab_size"]), hidden_size=int(t["hidden_size"]),
        intermediate_size=int(t["intermediate_size"]),
        moe_intermediate_size=int(t.get("moe_intermediate_size", 0)),
        num_hidden_layers=int(t["num_hidden_layers"]), num_attention_heads=n_heads,
        num_key_value_heads=int(t.get("num_key_value_heads") or n_heads),
        head_dim=int(t.get("head_dim") or t["hidden_size"] // n_heads),
        num_experts=int(num_experts), num_experts_per_tok=int(t.get("num_experts_per_tok", 1)),
        decoder_sparse_step=int(t.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in (t.get("mlp_only_layers") or ())),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        mrope_section=tuple(int(s) for s in rope.get("mrope_section", (24, 20, 20))),
        mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
        max_position_embeddings=int(t.get("max_position_embeddings", 262144)),
        # Qwen3-VL-MoE's router renormalizes the top-k weights whatever the config says (transformers
        # ignores the key); the key itself round-trips through ``extra``.
        norm_topk_prob=True,
        extra={k: v for k, v in t.items() if k not in known},
    )


