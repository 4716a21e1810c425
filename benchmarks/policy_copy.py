"""Does the policy copy the request's values? Teacher-forced accuracy of a policy checkpoint.

    python -m benchmarks.policy_copy --hf=DIR --input=FILE [--n=200] [--tokenizer=DIR] [--judge_format]

The judge starts from the policy (launch.policy_sft) on the premise that a policy which writes the
right call has learned the lookup a judge needs ("2K" from the request into ``resolution``). This
measures that premise: over the passing responses of ``--input`` (the policy's own targets,
rendered by rm_jax.data.policy), the argmax of the next-token prediction against the response's
tokens, overall and on the *value* tokens (the tokens of the slot values the synthetic requests
state: resolutions, aspect ratios, counts, colours, shapes, styles). A value token's accuracy is the
policy's copy rate; chance is about one over the pool size (3-13). ``--judge_format`` reads the
same responses inside the judge's transcript (rm_jax.data.render), where the judge initialized from
this policy reads them. A measurement, not a test.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

from launch.common import define_config_flag

flags.DEFINE_string("hf", None, "policy HF checkpoint (launch.policy_sft's DIR/hf)", required=True)
flags.DEFINE_string("input", None, "samples JSONL", required=True)
flags.DEFINE_string("tokenizer", "", "tokenizer dir (default: <input folder>/tokenizer)")
flags.DEFINE_bool("judge_format", False, "read the responses where the judge reads them: inside the judge's "
                  "transcript (rm_jax.data.render), not in the policy's own chat")
flags.DEFINE_integer("n", 200, "passing samples measured: the file's last ones (the policy stage trains on "
                     "every passing sample of its input, so this is an in-sample figure)")

_CONFIG = define_config_flag()   # its data section renders the examples


def value_token_ids(tokenizer) -> set[int]:
    from rm_jax.data import synth
    values = [*synth.RESOLUTIONS, *synth.ASPECTS, *map(str, synth.COUNTS), *synth.COLOURS, *synth.SHAPES,
              *synth.STYLES]
    ids: set[int] = set()
    for v in values:
        for form in (v, " " + v, '"' + v):
            ids.update(t for t in tokenizer(form, add_special_tokens=False)["input_ids"]
                       if tokenizer.decode([t]).strip(' "') == v)
    return ids


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from rm_jax.data.policy import PolicyRenderer
    from rm_jax.data.render import resolve_tokenizer_dir
    from rm_jax.data.schema import Sample, SampleError, read_samples
    from rm_jax.model import load_hf
    f = flags.FLAGS
    cfg = _CONFIG.value
    from rm_jax.data.render import Renderer
    tok_dir = resolve_tokenizer_dir(f.tokenizer, f.input)
    renderer = PolicyRenderer.from_config(cfg.data, tok_dir)
    judge_renderer = Renderer.from_config(cfg.data, tok_dir) if f.judge_format else None
    model = load_hf(f.hf)[0]
    values = value_token_ids(renderer.tokenizer)
    samples = [s for s in read_samples(f.input) if isinstance(s, Sample) and s.label and s.label.l3 == "pass"]
    hits = {"all": [0, 0], "value": [0, 0]}
    per_value: dict[str, list[int]] = {}
    for s in samples[-f.n:]:
        try:
            if judge_renderer is not None:
                ex = judge_renderer.render(s, with_target=False)
                start, end = judge_renderer.response_span(ex.input_ids)
                if start < 0:
                    raise ValueError("response header not found in the judge's prompt")
                input_ids, targets = ex.input_ids, np.arange(start, end)
            else:
                ex = renderer.render(s)
                input_ids, targets = ex.input_ids, np.nonzero(ex.target_mask)[0]
        except SampleError:
            continue
        # Right padding to a multiple of 128 (causal: earlier logits are unchanged): few compiles.
        ids_t = np.pad(input_ids, (0, -len(input_ids) % 128), constant_values=int(renderer.eos_id))
        out = model.forward(ids_t[None], pixel_values=ex.pixel_values if ex.has_image else None,
                            image_grid_thw=ex.image_grid_thw if ex.has_image else None)
        pred_t = np.asarray(out.logits_btv[0]).argmax(-1)
        for t in targets:
            ok = int(pred_t[t - 1] == input_ids[t])
            hits["all"][0] += ok
            hits["all"][1] += 1
            if int(input_ids[t]) in values:
                hits["value"][0] += ok
                hits["value"][1] += 1
                name = renderer.tokenizer.decode([int(input_ids[t])]).strip(' "')
                per_value.setdefault(name, [0, 0])
                per_value[name][0] += ok
                per_value[name][1] += 1
    acc = {k: (h / n if n else float("nan")) for k, (h, n) in hits.items()}
    fmt = "judge" if f.judge_format else "policy"
    print(f"policy {f.hf} ({fmt} format): {hits['all'][1]} response tokens, accuracy {acc['all']:.3f}; "
          f"{hits['value'][1]} value tokens, copy accuracy {acc['value']:.3f}")
    for name, (h, n) in sorted(per_value.items(), key=lambda kv: -kv[1][1])[:16]:
        print(f"  {name:>10}: {h}/{n}")
    print(json.dumps({"bench": "policy_copy", "tokens": hits["all"][1], "accuracy": round(acc["all"], 4),
                      "value_tokens": hits["value"][1], "copy_accuracy": round(acc["value"], 4),
                      "format": fmt}))


if __name__ == "__main__":
    app.run(main)
