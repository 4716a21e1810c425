"""The optimizer: AdamW, linear warmup + cosine decay, global-norm clipping, optional frozen tower.

Gradient accumulation is *not* done here (optax.MultiSteps averages per-microbatch means);
the train step sums token losses over microbatches and divides once by the global target-token
count, which is what "token-sum cross-entropy / token count" means across accumulation.
"""

from __future__ import annotations

import dataclasses

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 5e-6
    warmup_steps: int = 50
    total_steps: int = 2300
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    freeze_vision: bool = False
    mu_dtype: str = ""            # "" = the param dtype; "bfloat16" halves Adam's first moment

    @classmethod
    def from_config(cls, train_cfg) -> "OptimConfig":
        return cls(**{f.name: type(f.default)(train_cfg[f.name]) for f in dataclasses.fields(cls)
                      if f.name in train_cfg})


def schedule(cfg: OptimConfig) -> optax.Schedule:
    warmup = max(1, min(cfg.warmup_steps, cfg.total_steps - 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(cfg.total_steps, warmup + 1), end_value=cfg.lr * cfg.end_lr_ratio)


def trainable_mask(params, freeze_vision: bool):
    """True for parameters that train; the vision tower is False when frozen."""
    def is_trainable(path, _):
        return not (freeze_vision and any(getattr(k, "key", getattr(k, "name", None)) == "vision" for k in path))
    return jax.tree_util.tree_map_with_path(is_trainable, params)


def make_optimizer(cfg: OptimConfig, params) -> optax.GradientTransformation:
    adamw = optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                    mu_dtype=cfg.mu_dtype or None),
    )
    if not cfg.freeze_vision:
        return adamw
    labels = jax.tree.map(lambda t: "train" if t else "frozen", trainable_mask(params, True))
    # Frozen params get no optimizer state at all (set_to_zero keeps none).
    return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels)
