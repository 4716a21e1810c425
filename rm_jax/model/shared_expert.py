"""A routed MoE block plus an always-on shared expert behind a sigmoid gate (Qwen2-MoE,
Qwen3-Next, Qwen3.5): ``y = moe(x) + sigmoid(x @ w_gate) * mlp(x)``.

The routed part is ``moe.SparseMoeBlock`` (every backend, its aux statistics) and the shared
expert ``layers.MLP``; this module only adds the gate, so routing and expert kernels stay one
implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rm_jax.model.layers import MLP, normal, param
from rm_jax.model.moe import MoeAux, MoeConfig, SparseMoeBlock
from rm_jax.sharding import constrain


class SharedExpertMoeBlock(nnx.Module):
    def __init__(self, cfg: MoeConfig, shared_d_ff: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        self.dtype = dtype
        self.routed = SparseMoeBlock(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.shared = MLP(cfg.d_model, shared_d_ff, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.shared_gate_d1 = param(normal(rngs, (cfg.d_model, 1), param_dtype, cfg.d_model), ("embed", None))

    def __call__(self, x_btd, *, mask_bt=None) -> tuple[jax.Array, MoeAux]:
        y_btd, aux = self.routed(x_btd, mask_bt=mask_bt)
        gate_bt1 = jax.nn.sigmoid(jnp.einsum("btd,dk->btk", x_btd, self.shared_gate_d1[...].astype(self.dtype)))
        y_btd = y_btd + gate_bt1 * self.shared(x_btd)
        return constrain(y_btd, ("batch", "length", "act_embed")), aux
