"""Score a JSONL file end to end: parse, render-check, judge, rule checks, reward, write.

Bad rows never stop the run: a row that fails the contract, cannot be rendered (missing or
corrupt image...) or is longer than the largest length bucket gets `{"id", "error"}` with the
reason, and every other row is scored.
"""

from __future__ import annotations

import json
import os

from rm_jax.data.schema import Reject, read_samples, render_error
from rm_jax.calibration import IDENTITY, Calibration
from rm_jax.score.reward import RewardSettings, compute_reward


def renderer_for(workdir: str, tokenizer: str):
    from rm_jax.data.render import Renderer
    from rm_jax.score.checkpoints import read_run_config, run_data_dir
    cfg = read_run_config(workdir)
    path = os.path.join(run_data_dir(workdir), "manifest.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: the training data manifest is gone (its renderer settings and "
                                f"tokenizer are needed to score with the run in {workdir})")
    with open(path) as f:
        manifest = json.load(f)
    return cfg, Renderer.from_config(cfg.data, tokenizer or manifest["tokenizer_dir"],
                                     storage_dtype=manifest["build_options"]["pixel_dtype"])


def score_file(workdir: str, input_path: str, out_path: str, *, step: int | None = None, tokenizer: str = "",
               batch_size: int = 16, max_new_tokens: int = 64, progress: bool = True,
               reward: RewardSettings = RewardSettings(), calibration: Calibration = IDENTITY) -> dict:
    """Score ``input_path`` into ``out_path``; ``reward`` = (weights, rule penalties);
    ``calibration`` maps P(pass) before the reward reads it (identity by default)."""
    import jax
    if jax.process_count() > 1:
        raise RuntimeError(f"scoring runs in one process; this one is process {jax.process_index()} of "
                           f"{jax.process_count()}: run it once, on one host")
    from rm_jax.score.checkpoints import load_judge
    from rm_jax.score.scorer import Scorer

    if not os.path.isfile(input_path):      # before the checkpoint loads, not after
        raise FileNotFoundError(f"--input={input_path}: no such file (a samples JSONL, docs/contracts.md)")
    cfg, renderer = renderer_for(workdir, tokenizer)
    model, _, used_step = load_judge(workdir, step)
    rows: list[dict | None] = []
    good = []
    for item in read_samples(input_path, require_label=False):
        if isinstance(item, Reject):
            rows.append({"id": item.id, "line": item.line, "error": f"{item.reason}: {item.detail}"})
            continue
        try:
            renderer.render(item, with_target=False)   # images decode, template fits
        except Exception as e:   # noqa: BLE001 -- one bad row never stops the run; its reason is kept
            rows.append({"id": item.id, "line": item.line, "error": render_error(e)})
            continue
        rows.append(None)
        good.append(item)
    scorer = Scorer.for_run(model, renderer, cfg, batch_size=batch_size, max_new_tokens=max_new_tokens,
                            progress=progress)
    results = iter(zip(good, scorer.score(good)))
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    n_err = n_scored = 0
    with open(out_path, "w") as f:
        for row in rows:
            if row is None:
                sample, r = next(results)
                row = result_row(sample, r, reward, calibration)
                if "error" in row:
                    row = {"id": row["id"], "line": sample.line, "error": row["error"]}
            if "error" in row:
                n_err += 1
            else:
                n_scored += 1
            f.write(json.dumps(row, ensure_ascii=False, default=float) + "\n")
    summary = {"scored": n_scored, "errors": n_err, "step": used_step, "out": out_path,
               "calibration": calibration.to_json()}
    # Which samples, judge and calibration produced OUT (launch.select reads the input from it).
    with open(out_path + ".meta.json", "w") as f:
        json.dump({"input": os.path.abspath(input_path), "workdir": os.path.abspath(workdir), **summary}, f, indent=2)
    return summary


def result_row(sample, r, reward: RewardSettings = RewardSettings(), calibration: Calibration = IDENTITY) -> dict:
    """One ``launch.score`` row for a scored sample (a ``JudgeResult``): the verdict, the rule
    checks and the reward; ``{id, error}`` when it has no P(pass). ``launch.score`` and the
    server's ``/v1/score`` both write rows through here, so they cannot drift apart. With a
    calibration, ``p_pass`` and the reward's P(pass) term are the calibrated value; ``verdict`` stays
    the token the judge wrote."""
    if r.error is not None or not r.slot_found:
        # Over the largest bucket (the scorer's own check), or a reason-first judge that never
        # wrote the verdict slot: no P(pass), so no reward either.
        return {"id": sample.id, "error": r.error or "no_verdict_slot: the judge's output has no \"l3\" value"}
    p_pass = calibration.p_pass(r.p_pass)
    rw = compute_reward(sample, p_pass, list(r.issues), r.img, *reward)
    return {"id": sample.id, "p_pass": p_pass, "verdict": r.verdict, "reason": r.reason,
            "issues": list(r.issues), "img": r.img, "parse_ok": r.parse_ok,
            "off_vocab_mass": r.off_vocab_mass, "rule_score": rw.rule_score,
            "components": rw.components, "reward": rw.reward}


def p_pass_row(sample, v, reward: RewardSettings = RewardSettings(), calibration: Calibration = IDENTITY) -> dict:
    """A row from P(pass) alone (a ``VerdictScore``, no decoding): the verdict is the slot's argmax,
    reason/issues/img are not read, and the reward is the rule part plus the P(pass) term only
    (``components["judge_terms"] == "p_pass_only"`` says so)."""
    if v.error is not None or not v.slot_found:
        return {"id": sample.id, "error": v.error or "no_verdict_slot: the judge's output has no \"l3\" value"}
    p_pass = calibration.p_pass(v.p_pass)
    rw = compute_reward(sample, p_pass, 0, None, *reward)
    return {"id": sample.id, "p_pass": p_pass, "verdict": "pass" if v.logit_pass >= v.logit_fail else "fail",
            "reason": None, "issues": [], "img": None, "parse_ok": None, "off_vocab_mass": v.off_vocab_mass,
            "rule_score": rw.rule_score, "components": {**rw.components, "judge_terms": "p_pass_only"},
            "reward": rw.reward}
