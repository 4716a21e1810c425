"""The scalar reward model: any backbone with ``forward_arrays(inputs, logits=False).final_hidden_btd``
plus a Linear(hidden, 1) head in fp32, read at the reward position.

* The head is its own NNX module with its own parameter names (``RewardModel.head.w_d1`` /
  ``b_1``), so checkpoints always contain it and the optimizer always trains it (the reference
  text's PEFT pitfall: a score head left random or not saved). Its logical axes are ``embed``
  for the weight's input dim, nothing else, so it follows the rules table with no new entry.
* Small init (std 1/sqrt(D) * 0.1, not zero): initial rewards are near 0, and the backbone still
  receives gradient on the first step (a zero weight would block it).
* Reward position: the last index where ``response_mask_bt`` is 1 -- the end-of-turn token of
  the target assistant turn. Computed from the mask, so it holds for right padding, left
  padding, pad == eos and multi-turn templates (history turns end in the same eos).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rm_jax.sharding import LOGICAL_RULES

HEAD_DEFINITION = "Linear(hidden_size, 1) in float32 on the final-norm hidden state at the reward position"


def reward_positions(response_mask_bt: jax.Array) -> jax.Array:
    """[B] index of each row's last response token (0 for an all-zero row)."""
    t = response_mask_bt.shape[-1]
    idx_bt = jnp.arange(t, dtype=jnp.int32)[None, :]
    return jnp.max(jnp.where(response_mask_bt > 0, idx_bt, 0), axis=-1)


class ScalarHead(nnx.Module):
    def __init__(self, hidden: int, *, rngs: nnx.Rngs, init_scale: float = 0.1):
        std = init_scale / hidden ** 0.5
        self.w_d1 = nnx.Param(std * jax.random.normal(rngs.params(), (hidden, 1), jnp.float32),
                              out_sharding=("embed", None),
                              sharding_rules=LOGICAL_RULES, eager_sharding=False)
        self.b_1 = nnx.Param(jnp.zeros((1,), jnp.float32), out_sharding=(None,), sharding_rules=LOGICAL_RULES,
                             eager_sharding=False)

    def __call__(self, h_bd: jax.Array) -> jax.Array:
        return (h_bd.astype(jnp.float32) @ self.w_d1[...])[:, 0] + self.b_1[...][0]


class RewardModel(nnx.Module):
    def __init__(self, backbone: nnx.Module, *, rngs: nnx.Rngs):
        self.backbone = backbone
        self.head = ScalarHead(int(backbone.cfg.text.hidden_size), rngs=rngs)

    @property
    def cfg(self):
        return self.backbone.cfg

    def rewards(self, inputs, response_mask_bt: jax.Array) -> jax.Array:
        """[B] fp32 reward of each row."""
        return self.rewards_and_aux(inputs, response_mask_bt)[0]

    def rewards_and_aux(self, inputs, response_mask_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
        """([B] rewards, the MoE load-balancing loss averaged over sparse layers; 0 without MoE)."""
        out = self.backbone.forward_arrays(inputs, logits=False)
        pos_b = reward_positions(response_mask_bt)
        h_bd = jnp.take_along_axis(out.final_hidden_btd, pos_b[:, None, None], axis=1)[:, 0]
        lb = jnp.zeros((), jnp.float32) if out.moe_aux is None else jnp.mean(out.moe_aux.lb_loss)
        return self.head(h_bd), lb


def init_reward_model(model_cfg, seed: int = 0, backbone: nnx.Module | None = None) -> RewardModel:
    """A RewardModel on a given backbone (e.g. ``load_hf``'s), or on a random-init one."""
    if backbone is None:
        from rm_jax.model import init_model
        backbone = init_model(model_cfg, seed)
    return RewardModel(backbone, rngs=nnx.Rngs(seed + 1))
