"""Qwen3.5-MoE transformers checkpoint <-> rm_jax params: the key table, and load/export.

Design choices:

* **The table uses rm_jax.model.convert's records.** Each entry is a ``convert.Rule`` (HF key
  pattern, our param path(s), a ``convert.Transform`` pair of exact-inverse numpy functions); the
  Qwen3-VL transforms (k/v/o heads from ``qwen3_vl_moe.params``, the ViT's rules, the fused-expert
  layouts) are reused as they are, and only Qwen3.5's own tensors get new transforms (the gated
  ``q_proj``, the GDN layer). Safetensors IO is ``safetensors_io``'s, shardings ``placement``'s.
  The layer placement below is Qwen3.5's own (scopes ``layer`` / ``attn`` / ``gdn`` over pattern
  periods), so it expands its table itself and the registry routes load/save here.
* **Layer placement.** HF layer ``i`` lives in block ``i // p``, sub-layer ``i % p`` of the one
  scanned stack (``model.layer_period``); scopes ``layer`` / ``attn`` / ``gdn`` say which layers
  a rule applies to.
* **Expert layouts.** ``per_expert``: ``experts.{e}.{gate,up,down}_proj.weight``, what
  transformers 5.24's ``save_pretrained`` writes; fused ``gate_up_proj`` [E, 2I, H] /
  ``down_proj`` [E, H, I] (``out_in``, the published checkpoints); and the Qwen3-VL published
  orientation [E, H, 2I] / [E, I, H] (``in_out``). Per-expert tensors are gathered into the
  fused ``out_in`` form on the host and then go through the same fused transform, so there is one
  expert conversion. Export writes the layout the checkpoint came in (default per-expert, which
  is what transformers itself would write).
* **Text-only checkpoints** (``Qwen3_5MoeForCausalLM``) name the decoder ``model.`` instead of
  ``model.language_model.`` and have no ``model.visual.``.
* ``mtp.*`` (the multi-token-prediction head of the published checkpoints) is not part of the
  judge: those keys are skipped with one log line. Any other unknown key is an error.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

import ml_dtypes

from rm_jax.model import convert, safetensors_io
from rm_jax.model.config import ConfigError, RuntimeOptions
from rm_jax.model.gated_deltanet import HF_PARAMS as GDN_HF_PARAMS
from rm_jax.model.convert import EXPERTS_DOWN, EXPERTS_GATE_UP, IDENT, TRANSPOSE, Rule, Target, Transform
from rm_jax.model.qwen3_vl_moe import params as vl_params
from rm_jax.model.qwen3_vl_moe.params import KV_HEADS, O_HEADS
from rm_jax.model.safetensors_io import CheckpointError
from rm_jax.model.qwen3_5_moe.config import Qwen35MoeConfig
from rm_jax.model.qwen3_5_moe.model import Qwen35MoeJudge, abstract_model, layer_period
from rm_jax.model.vision import vision_segments

EXPERT_LAYOUTS = {"per_expert": "per_expert", "out_in": "out_in", "fused": "out_in", "published": "out_in",
                  "in_out": "in_out"}
MTP_PREFIX = "mtp."


# ---------------------------------------------------------------------------------------------
# Transforms of Qwen3.5's own tensors
# ---------------------------------------------------------------------------------------------

def _gated_q_fwd(w, c, x):
    # q_proj [N*2*Hd, D]: per head, Hd query rows then Hd gate rows (HF: view(..., N, 2*Hd).chunk(2)).
    t = c.text
    w_dn2h = w.T.reshape(w.shape[1], t.num_attention_heads, 2, t.head_dim)
    return w_dn2h[:, :, 0], w_dn2h[:, :, 1]


def _gated_q_inv(o, c, x):
    return np.stack(o, axis=2).reshape(o[0].shape[0], -1).T


GATED_Q = Transform(_gated_q_fwd, _gated_q_inv)


def _gdn(path: str, inverse) -> Transform:
    """gated_deltanet.HF_PARAMS' forward transform for ``path``, with its inverse."""
    fwd = GDN_HF_PARAMS[path][1]
    return Transform(lambda w, c, x: (fwd(w, c.text.gdn()),), lambda o, c, x: inverse(o[0]))


_flat_t = lambda a: a.reshape(a.shape[0], -1).T                   # [D, h, v] -> [h*v, D]
_GDN_INVERSES = {
    "in_proj_qkv_dc": lambda a: a.T, "in_proj_z_dhv": _flat_t, "in_proj_b_dh": lambda a: a.T,
    "in_proj_a_dh": lambda a: a.T, "conv1d_wc": lambda a: a.T[:, None, :], "A_log_h": lambda a: a,
    "dt_bias_h": lambda a: a, "norm.weight": lambda a: a,
    "out_proj_hvd": lambda a: a.reshape(-1, a.shape[-1]).T,        # [h, v, D] -> [D, h*v]
}


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------

_V = vl_params._V
EMBED_KEY = "model.language_model.embed_tokens.weight"   # multimodal; text-only: text_prefix(cfg)


def text_prefix(cfg: Qwen35MoeConfig) -> str:
    return "model." if cfg.text_only else "model.language_model."


def rules(cfg: Qwen35MoeConfig) -> tuple[Rule, ...]:
    """Every HF key pattern of this config; ``{i}`` is a decoder layer or vision block index."""
    L = text_prefix(cfg) + "layers.{i}."
    out = [
        Rule(text_prefix(cfg) + "embed_tokens.weight", ("embed_vd",), IDENT, "global"),
        Rule(text_prefix(cfg) + "norm.weight", ("final_norm.weight",), IDENT, "global"),
        Rule(L + "input_layernorm.weight", ("input_norm.weight",), IDENT, "layer"),
        Rule(L + "post_attention_layernorm.weight", ("post_norm.weight",), IDENT, "layer"),
        Rule(L + "mlp.gate.weight", ("mlp.routed.router_de",), TRANSPOSE, "layer"),
        Rule(L + "mlp.experts.gate_up_proj", ("mlp.routed.wi_gate_edf", "mlp.routed.wi_up_edf"),
             EXPERTS_GATE_UP, "layer"),
        Rule(L + "mlp.experts.down_proj", ("mlp.routed.wo_efd",), EXPERTS_DOWN, "layer"),
        Rule(L + "mlp.shared_expert.gate_proj.weight", ("mlp.shared.wi_gate_df",), TRANSPOSE, "layer"),
        Rule(L + "mlp.shared_expert.up_proj.weight", ("mlp.shared.wi_up_df",), TRANSPOSE, "layer"),
        Rule(L + "mlp.shared_expert.down_proj.weight", ("mlp.shared.wo_fd",), TRANSPOSE, "layer"),
        Rule(L + "mlp.shared_expert_gate.weight", ("mlp.shared_gate_d1",), TRANSPOSE, "layer"),
        Rule(L + "self_attn.q_proj.weight", ("mixer.wq_dnh", "mixer.wgate_dnh"), GATED_Q, "attn"),
        Rule(L + "self_attn.k_proj.weight", ("mixer.wk_dkh",), KV_HEADS, "attn"),
        Rule(L + "self_attn.v_proj.weight", ("mixer.wv_dkh",), KV_HEADS, "attn"),
        Rule(L + "self_attn.o_proj.weight", ("mixer.wo_nhd",), O_HEADS, "attn"),
        Rule(L + "self_attn.q_norm.weight", ("mixer.q_norm.weight",), IDENT, "attn"),
        Rule(L + "self_attn.k_norm.weight", ("mixer.k_norm.weight",), IDENT, "attn"),
        *(Rule(L + "linear_attn." + key, ("mixer." + path,), _gdn(path, _GDN_INVERSES[path]), "gdn")
          for path, (key, _) in GDN_HF_PARAMS.items()),
    ]
    if not cfg.tie_word_embeddings:
        out.append(Rule("lm_head.weight", ("lm_head_dv",), TRANSPOSE, "global"))
    if cfg.vision is not None:
        # Qwen3-VL's ViT rules as they are, without its deepstack mergers.
        out += [r for r in vl_params.RULES if r.hf.startswith(_V) and r.scope != "deepstack"]
    return tuple(out)


def expand_rules(cfg: Qwen35MoeConfig) -> dict[str, tuple[Rule, tuple[Target, ...]]]:
    """Every concrete (fused-layout) HF key of this config -> (rule, our targets)."""
    split = lambda p: tuple(int(s) if s.isdigit() else s for s in p.split("."))
    p = layer_period(cfg.text.layer_types)
    vis_seg = {}
    if cfg.vision is not None:
        for s, (start, end) in enumerate(vision_segments(cfg.vision)):
            vis_seg.update({i: (s, i - start) for i in range(start, end)})
    out = {}
    for rule in rules(cfg):
        if rule.scope == "global":
            out[rule.hf] = (rule, tuple(Target(split(o), None) for o in rule.ours))
        elif rule.scope == "vision_block":
            for i, (s, j) in vis_seg.items():
                out[rule.hf.format(i=i)] = (rule, tuple(
                    Target(("vision", "blocks", s, "layers") + split(o), j) for o in rule.ours))
        else:
            for i, kind in enumerate(cfg.text.layer_types):
                if (rule.scope == "attn") != (kind == "full_attention") and rule.scope != "layer":
                    continue
                out[rule.hf.format(i=i)] = (rule, tuple(
                    Target(("blocks", "layers", "layers", i % p) + split(o), i // p) for o in rule.ours))
    return out


# ---------------------------------------------------------------------------------------------
# Per-expert keys <-> the fused form
# ---------------------------------------------------------------------------------------------

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def per_expert_keys(fused_prefix: str, num_experts: int) -> list[str]:
    return [f"{fused_prefix}.{e}.{w}_proj.weight" for e in range(num_experts) for w in ("gate", "up", "down")]


class _ExpertGather:
    """Collects one layer's per-expert tensors (possibly spread over shards) and, once all 3*E
    are in, emits the fused ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""

    def __init__(self, num_experts: int):
        self.e = num_experts
        self.parts: dict[str, dict[tuple[int, str], np.ndarray]] = {}

    def add(self, key: str, array: np.ndarray):
        prefix, e, which = _PER_EXPERT.match(key).groups()
        if int(e) >= self.e:
            raise CheckpointError(f"{key}: expert {e} but the config has num_experts={self.e}")
        got = self.parts.setdefault(prefix, {})
        got[(int(e), which)] = np.asarray(array)
        if len(got) < 3 * self.e:
            return []
        del self.parts[prefix]
        gate_up = np.stack([np.concatenate([got[(e, "gate")], got[(e, "up")]], 0) for e in range(self.e)])
        down = np.stack([got[(e, "down")] for e in range(self.e)])
        return [(prefix + ".gate_up_proj", gate_up), (prefix + ".down_proj", down)]

    def check_complete(self, hf_dir):
        if self.parts:
            prefix, got = next(iter(self.parts.items()))
            raise CheckpointError(f"{hf_dir}: {prefix}.* holds {len(got)} of the {3 * self.e} per-expert tensors")


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------

def read_config(hf_dir, runtime: RuntimeOptions | None = None) -> Qwen35MoeConfig:
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path}: missing (a transformers checkpoint dir needs its config.json)")
    try:
        return Qwen35MoeConfig.from_hf_dict(json.loads(path.read_text()), runtime)
    except (ConfigError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def _detect_layout(index, cfg: Qwen35MoeConfig, given: str | None) -> str | None:
    if any(_PER_EXPERT.match(k) for k in index):
        if given not in (None, "per_expert"):
            raise CheckpointError(f"the checkpoint stores per-expert tensors, but expert_layout={given!r}")
        return "per_expert"
    return convert._expert_layout_from_headers(index, cfg, given)


def load_hf(hf_dir, dtype="float32", mesh=None, *, expert_layout: str | None = None,
            runtime: RuntimeOptions | None = None) -> tuple[Qwen35MoeJudge, Qwen35MoeConfig]:
    """Load a transformers Qwen3.5-MoE safetensors checkpoint (multimodal or text-only, any
    expert layout) into a (sharded) NNX model. ``expert_layout`` is needed only when fused expert
    shapes cannot tell the layout (hidden_size == 2 * moe_intermediate_size)."""
    if expert_layout is not None and expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout={expert_layout!r}; expected one of {sorted(EXPERT_LAYOUTS)}")
    pdtype = jnp.dtype(dtype)
    if not jnp.issubdtype(pdtype, jnp.floating):
        raise ValueError(f"dtype={dtype!r}: parameters need a floating dtype")
    runtime = dataclasses.replace(runtime or RuntimeOptions(), dtype=str(pdtype), param_dtype=str(pdtype))
    cfg = read_config(hf_dir, runtime)
    files = safetensors_io.checkpoint_files(hf_dir)
    index = convert._header_index(files)
    filler = convert.ParamFiller(abstract_model(cfg), mesh, pdtype)
    table = expand_rules(cfg)
    layout = _detect_layout(index, cfg, EXPERT_LAYOUTS.get(expert_layout) if expert_layout else None)
    ctx = {"expert_layout": "out_in" if layout == "per_expert" else layout}
    gather = _ExpertGather(cfg.text.num_experts)
    seen, unknown, mtp = set(), [], 0

    def put(key, array, file):
        rule, targets = table[key]
        ctx["key"], ctx["file"] = key, str(file)
        filler.put(file, key, rule.transform.to_ours(array, cfg, ctx), targets)
        seen.add(key)

    for file in files:
        st = safetensors_io.SafetensorsFile(file)
        for key in st.keys():
            if key.startswith(MTP_PREFIX):
                mtp += 1
            elif key in table:
                put(key, st.get(key), file)
            elif layout == "per_expert" and _PER_EXPERT.match(key):
                for fused_key, arr in gather.add(key, st.get(key)):
                    put(fused_key, arr, file)
            elif key == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            else:
                unknown.append(key)
        del st
    if mtp:
        logging.info("%s: ignoring %d mtp.* tensors (the multi-token-prediction head is not part of the judge)",
                     hf_dir, mtp)
    gather.check_complete(hf_dir)
    if unknown:
        raise CheckpointError(f"{hf_dir}: {len(unknown)} checkpoint keys have no rm_jax param, e.g. "
                              f"{sorted(unknown)[:5]}")
    missing = sorted(k for k in table if k not in seen)
    if missing:
        raise CheckpointError(f"{hf_dir}: {len(missing)} params missing from the checkpoint, e.g. {missing[:5]}")
    model = filler.model(hf_dir, table)
    cfg = dataclasses.replace(cfg, hf_expert_layout=layout or ctx.get("detected_layout"),
                              hf_tensor_dtypes={k: info[2] for k, info in index.items()})
    model.cfg = cfg
    return model, cfg


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------

def hf_tensors(model: Qwen35MoeJudge, expert_layout: str):
    """(HF key, numpy array in the params' dtype) for every tensor, in table order."""
    cfg = model.cfg
    fused = "out_in" if expert_layout == "per_expert" else expert_layout
    ctx = {"expert_layout": fused}
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    for key, (rule, targets) in expand_rules(cfg).items():
        ours = []
        for target in targets:
            arr = flat[target.path][...]
            ours.append(np.asarray(jax.device_get(arr if target.index is None else arr[target.index])))
        tensor = np.ascontiguousarray(rule.transform.to_hf(tuple(ours), cfg, ctx))
        if expert_layout == "per_expert" and key.endswith("mlp.experts.gate_up_proj"):
            i = cfg.text.moe_intermediate_size
            prefix = key[:-len(".gate_up_proj")]
            for e in range(cfg.text.num_experts):
                yield f"{prefix}.{e}.gate_proj.weight", np.ascontiguousarray(tensor[e, :i])
                yield f"{prefix}.{e}.up_proj.weight", np.ascontiguousarray(tensor[e, i:])
        elif expert_layout == "per_expert" and key.endswith("mlp.experts.down_proj"):
            prefix = key[:-len(".down_proj")]
            for e in range(cfg.text.num_experts):
                yield f"{prefix}.{e}.down_proj.weight", np.ascontiguousarray(tensor[e])
        else:
            yield key, tensor


def save_hf(model: Qwen35MoeJudge, out_dir, *, dtype=None, expert_layout: str | None = None,
            max_shard_bytes: int = 4 << 30) -> Path:
    """Write safetensors + config.json that transformers' ``Qwen3_5MoeForConditionalGeneration``
    (or ``Qwen3_5MoeForCausalLM`` for a text-only config) loads, streamed in shards of at most
    ``max_shard_bytes``. ``expert_layout`` defaults to the checkpoint's own, else per-expert; each
    tensor keeps the dtype it was loaded in."""
    cfg: Qwen35MoeConfig = model.cfg
    layout = EXPERT_LAYOUTS[expert_layout or cfg.hf_expert_layout or "per_expert"]
    recorded = dict(cfg.hf_tensor_dtypes or {})
    fallback = convert._np_dtype(str(dtype or cfg.runtime.param_dtype))
    forced = convert._np_dtype(str(dtype)) if dtype is not None else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def tensors():
        for key, tensor in hf_tensors(model, layout):
            want = forced or (np.dtype(safetensors_io._ST_DTYPES[recorded[key]]) if key in recorded else fallback)
            yield key, tensor.astype(want, copy=False)

    dtypes = convert.write_sharded(out, tensors(), max_shard_bytes)
    hf_cfg = cfg.to_hf_dict()
    common = max(set(dtypes), key=dtypes.count)
    hf_cfg["dtype"] = "bfloat16" if common == np.dtype(ml_dtypes.bfloat16) else str(common)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    return out
