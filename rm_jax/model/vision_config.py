"""The Qwen-VL vision tower's config (Qwen3-VL and Qwen3.5 share the ViT; Qwen3.5 has no
deepstack taps), parsed from and written back to a ``vision_config`` section."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping

from rm_jax.model.config import ConfigError

_VISION_KEYS = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                "patch_size", "spatial_merge_size", "temporal_patch_size", "out_hidden_size",
                "num_position_embeddings", "deepstack_visual_indexes", "hidden_act",
                "rope_parameters", "model_type")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    rope_theta: float = 10000.0
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def vision_from_hf(v: dict) -> VisionConfig:
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"vision_config.hidden_act={act!r}: only 'gelu_pytorch_tanh' is implemented")
    rope = dict(v.get("rope_parameters") or {})
    for key in ("patch_size", "temporal_patch_size"):
        if not isinstance(v.get(key, 1), int):
            raise ConfigError(f"vision_config.{key}={v[key]!r}: only square integer patches are implemented")
    known = set(_VISION_KEYS)
    return VisionConfig(
        depth=int(v["depth"]), hidden_size=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]), num_heads=int(v["num_heads"]),
        in_channels=int(v.get("in_channels", 3)), patch_size=int(v.get("patch_size", 16)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        out_hidden_size=int(v["out_hidden_size"]),
        num_position_embeddings=int(v["num_position_embeddings"]),
        deepstack_visual_indexes=tuple(int(i) for i in v.get("deepstack_visual_indexes", ())),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        extra={k: val for k, val in v.items() if k not in known},
    )




def vision_to_hf(v: VisionConfig, model_type: str) -> dict[str, Any]:
    """``vision_config`` as transformers writes it (unmodelled keys from ``extra`` kept)."""
    out = dict(copy.deepcopy(dict(v.extra)))
    out.update(
        model_type=model_type, depth=v.depth, hidden_size=v.hidden_size,
        intermediate_size=v.intermediate_size, num_heads=v.num_heads,
        in_channels=v.in_channels, patch_size=v.patch_size,
        spatial_merge_size=v.spatial_merge_size, temporal_patch_size=v.temporal_patch_size,
        out_hidden_size=v.out_hidden_size, num_position_embeddings=v.num_position_embeddings,
        deepstack_visual_indexes=list(v.deepstack_visual_indexes),
        hidden_act="gelu_pytorch_tanh",
        rope_parameters=dict(rope_type="axial", rope_theta=v.rope_theta),
    )
    return out
