"""The records every judge architecture shares between stages: what goes into a forward
(``JudgeInputs``), what comes out (``JudgeOutput``), and the decode state (``DecodeState``, with
``KVState`` for attention layers and ``NewTokenState`` for what a decode step adds).

Design choices:

* **Pytrees, no behaviour.** They are ``flax.struct`` dataclasses, so they cross ``jax.jit`` as
  arguments and results. What builds them lives elsewhere: ``rm_jax.model.inputs`` (inputs,
  outside jit), the architectures (outputs), ``rm_jax.model.decode_state`` (how a state grows).
  The model surface (``rm_jax.model.interface``) and the decode-state operations both import them,
  and neither imports the other.
* **One decode-state record per layer kind, stacked over the layers of that kind only.**
  ``KVState`` holds ``[L_attn, B, S, K, Hd]`` keys/values of the attention layers in layer order;
  ``recurrent`` is a ``GatedDeltaNetState`` whose fields carry a leading ``L_gdn`` axis. A model
  with no layer of a kind has ``None`` there (Qwen3-VL: no recurrent state).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax

from rm_jax.model.gated_deltanet import GatedDeltaNetState
from rm_jax.model.moe import MoeAux
from rm_jax.model.vision import VisionInputs


@flax.struct.dataclass
class JudgeInputs:
    input_ids_bt: jax.Array
    attention_mask_bt: jax.Array
    positions_3bt: jax.Array
    image_index_bt: jax.Array | None = None     # row of the image features, -1 for other tokens
    # Valid length of each row when every row's mask is a prefix of ones (right padding): then
    # attention runs as causal + key lengths (the cuDNN flash path) instead of a [B,1,T,T] mask.
    kv_lengths_b: jax.Array | None = None
    vision: VisionInputs | None = None


@flax.struct.dataclass
class JudgeOutput:
    logits_btv: jax.Array | None                # None with forward_arrays(logits=False)
    layer_hidden_lbtd: jax.Array | None = None  # output of each decoder layer (pre-deepstack)
    inputs_embeds_btd: jax.Array | None = None  # after image splicing
    final_hidden_btd: jax.Array | None = None   # after the final norm
    image_embeds_nd: jax.Array | None = None    # merged image features [N/m^2, D]
    deepstack_embeds: tuple | None = None       # one [N/m^2, D] per deepstack tap
    moe_aux: MoeAux | None = None               # stacked over sparse layers, in layer order
    # forward_arrays(return_kv=True), the prefill of a decode state (rm_jax.model.decode_state):
    kv_lbtkh: tuple | None = None               # (k, v) of every attention layer, in layer order
    recurrent: Any = None                       # GatedDeltaNetState stacked over the GDN layers


@flax.struct.dataclass
class KVState:
    """Rotated keys and values of every attention layer, ``S`` slots per row."""
    k_lbskh: jax.Array
    v_lbskh: jax.Array


@flax.struct.dataclass
class DecodeState:
    kv: KVState | None                       # attention layers (None: the model has none)
    recurrent: GatedDeltaNetState | None     # GDN layers, stacked (None: the model has none)
    length_b: jax.Array                      # tokens held per row = the next KV write slot
    next_pos_b: jax.Array                    # MRoPE position (all three axes) of the next token

    # Shorthands for the attention cache (the only kind Qwen3-VL has).
    @property
    def k_lbskh(self) -> jax.Array:
        return self.kv.k_lbskh

    @property
    def v_lbskh(self) -> jax.Array:
        return self.kv.v_lbskh


@flax.struct.dataclass
class NewTokenState:
    """What ``decode_tokens`` adds for N new tokens per row (``DecodeState`` is not updated there)."""
    kv: tuple | None                         # (k_lbnkh, v_lbnkh) of the attention layers
    recurrent: GatedDeltaNetState | None     # the GDN layers' state after the new tokens
