"""The optimizer: AdamW, linear warmup + cosine decay, global-norm clipping, optional frozen tower.

Gradient accumulation is *not* done here (optax.MultiSteps averages per-microbatch means);
the train step sums token losses over microbatches and divides once by the global target-token
count, which is what "token-sum cross-entropy / token count" means across accumulation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from rm_jax.run_config import TrainSection


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
    nu_dtype: str = ""            # "" = the param dtype; "bfloat16" halves the second moment (needs b2 <= 0.99)

    @classmethod
    def from_config(cls, train: TrainSection) -> "OptimConfig":
        """The run's ``train`` section; ``total_steps`` comes from the run plan."""
        return cls(**{f.name: getattr(train, f.name) for f in dataclasses.fields(cls) if f.name != "total_steps"})


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


# Storing nu in bf16 rounds every update to 8 significant bits. The EMA step (1 - b2) * (g^2 - nu)
# must stay above half a bf16 ulp (2^-9 relative) or nu stops moving; 1 - b2 >= 0.01 keeps a margin.
MAX_B2_LOW_PRECISION_NU = 0.99


def scale_by_adam_stored_nu(b1: float, b2: float, eps: float, mu_dtype, nu_dtype) -> optax.GradientTransformation:
    """optax.scale_by_adam whose second moment is *stored* in `nu_dtype` (optax has mu_dtype only).

    The update itself runs in fp32 (nu is widened on read, and this step's new nu is used before it
    is rounded for storage), so only the carried state loses precision. The state has optax's own
    ScaleByAdamState type, so checkpoints and sharding rules treat it like any Adam state."""
    nu_dtype = jnp.dtype(nu_dtype)
    if nu_dtype.itemsize < 4 and b2 > MAX_B2_LOW_PRECISION_NU:
        raise ValueError(f"nu_dtype={nu_dtype.name} needs b2 <= {MAX_B2_LOW_PRECISION_NU} (got {b2}): with a "
                         f"smaller EMA step the rounded second moment stops tracking g^2")
    inner = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype)

    def store(state):
        return state._replace(nu=jax.tree.map(lambda x: x.astype(nu_dtype), state.nu))

    def init(params):
        return store(inner.init(params))

    def update(updates, state, params=None):
        wide = state._replace(nu=jax.tree.map(lambda x: x.astype(jnp.float32), state.nu))
        updates, new_state = inner.update(updates, wide, params)
        return updates, store(new_state)

    return optax.GradientTransformation(init, update)


def _adamw(cfg: OptimConfig) -> optax.GradientTransformation:
    if not cfg.nu_dtype:
        return optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                           mu_dtype=cfg.mu_dtype or None)
    # optax.adamw's own chain, with the Adam scaling swapped (same state structure).
    return optax.chain(
        scale_by_adam_stored_nu(cfg.b1, cfg.b2, cfg.eps, cfg.mu_dtype or None, cfg.nu_dtype),
        optax.add_decayed_weights(cfg.weight_decay),
        optax.scale_by_learning_rate(schedule(cfg)),
    )


def make_optimizer(cfg: OptimConfig, params) -> optax.GradientTransformation:
    adamw = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), _adamw(cfg))
    if not cfg.freeze_vision:
        return adamw
    labels = jax.tree.map(lambda t: "train" if t else "frozen", trainable_mask(params, True))
    # Frozen params get no optimizer state at all (set_to_zero keeps none).
    return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels)
