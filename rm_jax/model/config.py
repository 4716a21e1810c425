"""Configuration pieces shared by every architecture: run-time options (never in config.json),
the config error type, and dict helpers.

Each architecture's typed config (``rm_jax.model.<arch>.config``) parses its own ``config.json``
sections; ``rm_jax.model.registry`` picks the parser by ``model_type``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


class ConfigError(ValueError):
    """A config field that rm_jax cannot represent; the message names the field."""


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    """Execution choices; not part of the checkpoint."""
    dtype: str = "float32"             # activations
    param_dtype: str = "float32"
    moe_backend: str = "ragged"        # "dense" | "ragged" | "ep_ring" (rm_jax.model.moe)
    # Grouped matmul of the ragged/ep_ring backends: "auto" (CPU: the tiled loop, else tokamax) |
    # "tokamax" | "lax" | "tiled" (moe.RAGGED_DOT_IMPLS; config key moe.ragged_dot).
    ragged_dot: str = "auto"
    scan_layers: bool = True           # lax.scan over homogeneous runs of layers
    remat: str = "none"                # "none" | "full" | "dots" | "dots_no_batch"
    # Attention (text and vision; config key train.attention): "auto" (the CPU kernel on CPU; on
    # GPU cuDNN flash when eligible, else XLA's, logged: layers.choose_attention), "xla" / "cudnn"
    # (jax.nn.dot_product_attention with that implementation), "blocked" (the CPU kernel anywhere).
    attention: str = "auto"
    # How bf16 layer stacks enter the layer scan (config key train.stack_codec): "none" |
    # "bf16_bits" (scanned as packed bits; bit-identical results, see layer_stack.STACK_CODECS).
    stack_codec: str = "none"


def plain_dict(d) -> dict:
    """ml_collections ConfigDict / HF PreTrainedConfig / Mapping -> plain nested dict."""
    if hasattr(d, "to_dict"):
        d = d.to_dict()
    return {k: (plain_dict(v) if isinstance(v, Mapping) or hasattr(v, "to_dict") else v)
            for k, v in dict(d).items()}


def required(parse, section: dict, name: str):
    """``parse(section)``, a missing key reported as a ConfigError naming ``name.key``."""
    try:
        return parse(section)
    except KeyError as e:
        raise ConfigError(f"config: {name}.{e.args[0]} is missing (it has no default)") from None


def hf_config_dict(d: Mapping[str, Any]) -> dict[str, Any]:
    """An ml_collections model section as transformers wants it: plain dicts, lists not tuples
    (our configs hold tuples so every field can be overridden from the command line; transformers'
    config dataclasses reject them)."""
    if isinstance(d, Mapping):
        return {k: hf_config_dict(v) for k, v in d.items()}
    return [hf_config_dict(v) for v in d] if isinstance(d, (list, tuple)) else d
