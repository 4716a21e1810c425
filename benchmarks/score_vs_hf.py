"""Scoring throughput: rm_jax's Scorer vs transformers + PyTorch, same tiny judge, samples and CPU.

    python -m benchmarks.score_vs_hf [--n=24 --batch=4 --max_new_tokens=32 --iters=3]

(a) P(pass) only: our one jitted prefill (hidden state at the slot @ head, no [B, T, V]) vs a
    transformers forward over the same right-padded batch, softmax over pass/fail at the slot.
(b) Full scoring: our prefill + KV-cache greedy decoding in one jitted while_loop, parsed, vs
    transformers ``generate`` (greedy, left-padded batch, from the assistant start) + JSON parsing,
    which is how verl-style generative rewards score.

The samples come as the synthetic set writes them, in GRPO-style groups (3 responses per prompt,
consecutive), as a reward server receives them. The scorer prefills each group's shared prompt
prefix once and runs only the responses after it (``Scorer(share_prefix=True)``, the default);
transformers scores every sample whole, as verl-style rewards do. rm_jax without prefix sharing
is printed too, so what each part contributes is visible.

The judge is a random-weight Qwen3VLMoeForConditionalGeneration built from configs/tiny.py with
the synthetic tokenizer's vocabulary, converted with load_hf; samples are synthetic, with images.
Rendering is done once outside the timings (identical for both). Both sides are warmed up first.
A random judge rarely emits EOS, so both decode about the full budget; the tokens generated are
printed. A measurement, not a test: nothing is asserted. Last line: one JSON object.
"""

from __future__ import annotations

import json
import os
import tempfile

from absl import app, flags
from benchmarks.timing import median_seconds  # noqa: E402
from rm_jax.model.config import hf_config_dict  # noqa: E402

flags.DEFINE_integer("n", 24, "samples scored per timed run (with images, in their prompt groups)")
flags.DEFINE_integer("batch", 4, "batch size (both implementations)")
flags.DEFINE_integer("max_new_tokens", 32, "decode budget for full scoring (both)")
flags.DEFINE_integer("iters", 3, "timed runs (median), after one warm-up")


def main(argv):
    del argv
    import jax
    import numpy as np
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from configs.tiny import get_config, hf_model_config
    from rm_jax.data import synth
    from rm_jax.data.render import Renderer
    from rm_jax.data.schema import Sample, read_samples
    from rm_jax.data.target import parse_output
    from rm_jax.model import load_hf
    from rm_jax.score.scorer import Scorer

    f = flags.FLAGS
    tmp = tempfile.mkdtemp()
    synth.write_dataset(os.path.join(tmp, "data"), n=max(40, 4 * f.n), seed=0)
    cfg = get_config()
    renderer = Renderer.from_config(cfg.data, os.path.join(tmp, "data", "tokenizer"))
    samples = [s for s in read_samples(os.path.join(tmp, "data", "samples.jsonl"))
               if isinstance(s, Sample) and s.images][:f.n]
    tok = renderer.tokenizer

    d = hf_config_dict(hf_model_config().to_dict())
    d["text_config"]["vocab_size"] = len(tok)
    torch.manual_seed(0)
    hf = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(**d)).eval().float()
    hf.save_pretrained(os.path.join(tmp, "hf"))
    model, mcfg = load_hf(os.path.join(tmp, "hf"))
    buckets = tuple(int(b) for b in cfg.data.buckets)
    scorer = Scorer(model, renderer, buckets=buckets, batch_size=f.batch, max_new_tokens=f.max_new_tokens,
                    progress=False)
    unshared = Scorer(model, renderer, buckets=buckets, batch_size=f.batch, max_new_tokens=f.max_new_tokens,
                      progress=False, share_prefix=False)

    # Render once for both sides; the scorers reuse these items (rendering is not what we time).
    rendered = scorer.render(samples)
    scorer._render = unshared._render = lambda _samples: rendered
    groups, _ = scorer._prefix_groups(rendered[0])
    prefix = list(renderer.scoring_prefix_ids())
    prompts = [(it.rendered.input_ids, it.rendered.pixel_values.astype(np.float32), it.rendered.image_grid_thw)
               for it in rendered[0]]
    v = renderer.verdict
    pad = tok.pad_token_id if tok.pad_token_id is not None else renderer.eos_id

    def hf_batch(rows, left: bool):
        t = max(len(r[0]) for r in rows)
        ids = np.full((len(rows), t), pad, np.int64)
        mask = np.zeros_like(ids)
        for i, (r, _, _) in enumerate(rows):
            sl = slice(t - len(r), t) if left else slice(0, len(r))
            ids[i, sl], mask[i, sl] = r, 1
        return dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    pixel_values=torch.tensor(np.concatenate([r[1] for r in rows])),
                    image_grid_thw=torch.tensor(np.concatenate([r[2] for r in rows]).astype(np.int64)),
                    mm_token_type_ids=torch.tensor((ids == mcfg.image_token_id).astype(np.int64)))

    def chunks(xs):
        return [xs[i:i + f.batch] for i in range(0, len(xs), f.batch)]

    def hf_p_pass():
        out = []
        with torch.no_grad():
            for rows in chunks([(np.concatenate([r, prefix]), p, g) for r, p, g in prompts]):
                kw = hf_batch(rows, left=False)
                logits = hf(**kw).logits
                last = kw["attention_mask"].sum(-1) - 1
                slot = logits[torch.arange(len(rows)), last][:, [v.pass_id, v.fail_id]]
                out.extend(torch.softmax(slot.double(), -1)[:, 0].tolist())
        return out

    hf_tokens = []

    def hf_full():
        out = []
        hf_tokens.clear()
        with torch.no_grad():
            for rows in chunks(prompts):
                kw = hf_batch(rows, left=True)
                gen = hf.generate(**kw, max_new_tokens=f.max_new_tokens, do_sample=False,
                                  eos_token_id=renderer.eos_id, pad_token_id=pad)
                new = gen[:, kw["input_ids"].shape[1]:]
                hf_tokens.extend(int((row != pad).sum()) for row in new)
                out.extend(parse_output(t) for t in tok.batch_decode(new, skip_special_tokens=True))
        return out

    ours_tokens = []

    def ours_full():
        res = scorer.score(samples)
        ours_tokens[:] = [r.n_new_tokens for r in res]
        return res

    ours_p = scorer.p_pass(samples)
    ref_p = hf_p_pass()
    max_diff = float(np.max(np.abs(np.array([s.p_pass for s in ours_p]) - np.array(ref_p))))
    unshared.p_pass(samples)
    unshared.score(samples)

    t_ours_p = median_seconds(lambda: scorer.p_pass(samples), f.iters)
    t_unshared_p = median_seconds(lambda: unshared.p_pass(samples), f.iters)
    t_hf_p = median_seconds(hf_p_pass, f.iters)
    t_ours_full = median_seconds(ours_full, f.iters)
    t_unshared_full = median_seconds(lambda: unshared.score(samples), f.iters)
    t_hf_full = median_seconds(hf_full, f.iters)

    n = len(samples)
    rows = [("P(pass) only", t_ours_p, t_hf_p), ("  (no prefix sharing)", t_unshared_p, t_hf_p),
            ("full (decode + parse)", t_ours_full, t_hf_full), ("  (no prefix sharing)", t_unshared_full, t_hf_full)]
    shared_tokens = sum(g.n_shared * (len(g.items) - 1) for g in groups)
    print(f"{n} samples with images in {len({s.prompt_id for s in samples})} prompt groups, batch {f.batch}, "
          f"decode budget {f.max_new_tokens} tokens, prompt lengths {min(len(p[0]) for p in prompts)}-"
          f"{max(len(p[0]) for p in prompts)}; prefix sharing skips {shared_tokens} of "
          f"{sum(len(p[0]) for p in prompts)} prompt tokens; max |P(pass) ours - transformers| = {max_diff:.2e}")
    print(f"{'task':<24}{'rm_jax samples/s':>18}{'transformers samples/s':>24}{'ratio':>8}")
    for name, ours, ref in rows:
        print(f"{name:<24}{n / ours:>18.2f}{n / ref:>24.2f}{ref / ours:>7.2f}x")
    print(f"new tokens per sample: rm_jax mean {np.mean(ours_tokens):.1f}, transformers mean {np.mean(hf_tokens):.1f}")
    print(json.dumps({"bench": "score_vs_hf", "speedup_p_pass": round(t_hf_p / t_ours_p, 3),
                      "speedup_full": round(t_hf_full / t_ours_full, 3),
                      "speedup_p_pass_no_sharing": round(t_hf_p / t_unshared_p, 3),
                      "speedup_full_no_sharing": round(t_hf_full / t_unshared_full, 3),
                      "rm_jax_p_pass_samples_per_s": round(n / t_ours_p, 2),
                      "hf_p_pass_samples_per_s": round(n / t_hf_p, 2),
                      "rm_jax_full_samples_per_s": round(n / t_ours_full, 2),
                      "hf_full_samples_per_s": round(n / t_hf_full, 2),
                      "rm_jax_new_tokens_mean": float(np.mean(ours_tokens)),
                      "hf_new_tokens_mean": float(np.mean(hf_tokens)),
                      "max_p_pass_diff": max_diff, "n": n, "batch": f.batch,
                      "max_new_tokens": f.max_new_tokens, "platform": jax.devices()[0].platform}))


if __name__ == "__main__":
    app.run(main)
