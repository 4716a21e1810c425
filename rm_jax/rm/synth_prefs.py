"""The embedded default preference set, from the synthetic generator's own groups.

``synth.generate`` draws ``responses_per_prompt`` responses per prompt (one scenario, several
"temperature" samples, each passing or failing). One such group becomes one preference line: its
candidates ranked pass (rank 0) above fail (rank 1), a partial K-way ranking with ties, expanded
by the contract into hard pairs (a passing vs a failing response to the same prompt) and ties
(two responses of the same class). Candidates keep synth's order, which is random with respect to
the label, so pair orientation (a/b) is neutral. Utility = 1 for pass, 0 for fail.
"""

from __future__ import annotations

import collections
import json
import os

from rm_jax.data import synth


def preference_lines(samples: list[dict]) -> list[dict]:
    groups: dict[str, list[dict]] = collections.OrderedDict()
    for s in samples:
        groups.setdefault(s["prompt_id"], []).append(s)
    lines = []
    for pid, group in groups.items():
        if len(group) < 2:
            continue
        has_image = any(isinstance(m.get("content"), list) and any(p.get("type") == "image" for p in m["content"])
                        for m in group[0]["messages"])
        cands = [{"response": s["response"], "rank": int(s["label"]["l3"] == "fail"),
                  "score": float(s["label"]["l3"] == "pass"), "source": s["id"]} for s in group]
        lines.append({"id": pid, "prompt_id": pid, "messages": group[0]["messages"], "tools": group[0]["tools"],
                      "slice": "image" if has_image else "text", "candidates": cands})
    return lines


def write_preferences(out_dir: str, n_prompts: int, k: int = 4, seed: int = 0, fail_rate: float = 0.5,
                      vocab_size: int = 4096) -> dict:
    """out_dir/preferences.jsonl + images/ + tokenizer/; returns a small summary."""
    os.makedirs(out_dir, exist_ok=True)
    cfg = synth.SynthConfig(n=n_prompts * k, seed=seed, fail_rate=fail_rate, responses_per_prompt=k)
    samples = synth.generate(cfg, out_dir)
    lines = preference_lines(samples)
    with open(os.path.join(out_dir, "preferences.jsonl"), "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    from rm_jax.data.tokenizer_build import write_tokenizer_dir
    write_tokenizer_dir(os.path.join(out_dir, "tokenizer"), synth.corpus_texts(samples), vocab_size)
    mixed = sum(len({c["rank"] for c in line["candidates"]}) > 1 for line in lines)
    return {"prompts": len(lines), "candidates": sum(len(line["candidates"]) for line in lines),
            "prompts_with_pass_and_fail": mixed}
