"""rm_eval: score the calibration and held-out splits with one or more trained RMs and report
pairwise (tie-aware, macro by slice), ranking (per-prompt Kendall tau-b / Spearman), Best-of-N,
length bias, calibration (temperature fitted on calibration, frozen, before/after on held-out) and,
for several runs, the ensemble (mean / min / std after aligning each member on the anchor set).

Anchor set: the calibration split's candidates. Each member's rewards are standardised by their
mean and std on it (a chosen gauge: BT rewards have no identified zero or shared scale across
runs); the anchor set id is the hash of its candidate ids.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from rm_jax import calibration as cal
from rm_jax.eval import ranking
from rm_jax.rm import data as data_lib
from rm_jax.rm.head import HEAD_DEFINITION
from rm_jax.rm.render import REWARD_POSITION_RULE

EVAL_SPLITS = ("calibration", "heldout")


def _pair_view(split: data_lib.PairSplit, r: np.ndarray) -> dict:
    slices = np.asarray([split.groups[g].get("slice", "all") for g in split.pair_group])
    return {"r_a": r[split.pair_a], "r_b": r[split.pair_b], "p": split.pair_p.astype(np.float64),
            "slice": slices, "len_a": split.response_len[split.pair_a], "len_b": split.response_len[split.pair_b]}


def prompt_ids(split: data_lib.PairSplit) -> list[str]:
    return [split.groups[g]["prompt_id"] for g in split.group]


def split_report(split: data_lib.PairSplit, r: np.ndarray, temperature: float) -> dict:
    pv = _pair_view(split, r)
    pids = prompt_ids(split)
    decided = pv["p"] != 0.5
    delta, y = (pv["r_a"] - pv["r_b"])[decided], pv["p"][decided]
    before, after = cal.sigmoid(delta), cal.sigmoid(delta / temperature)
    return {
        "pairwise": ranking.pairwise_by_slice(pv["slice"], pv["r_a"], pv["r_b"], pv["p"]),
        "ranking": ranking.ranking_metrics(pids, r, split.utility),
        "best_of_n": ranking.best_of_n(pids, r, split.utility),
        "length_bias": ranking.length_bias(pids, r, split.response_len, pv["r_a"], pv["r_b"], pv["len_a"],
                                           pv["len_b"], pv["p"]),
        "calibration_before": cal.calibration_metrics(before, y),
        "calibration_after": cal.calibration_metrics(after, y),
        "_curves": {"before": (before, y), "after T": (after, y)},
    }


def anchor_align(r_anchor: np.ndarray, r: np.ndarray) -> np.ndarray:
    sd = float(np.std(r_anchor))
    return (r - float(np.mean(r_anchor))) / (sd if sd > 0 else 1.0)


def evaluate(members: list[tuple[str, dict]], data_dir: str, out_dir: str) -> dict:
    """members: (name, {split: rewards [C]}) for each run. Writes rm_eval.json / .md / reliability.png."""
    os.makedirs(out_dir, exist_ok=True)
    splits = {s: data_lib.load_split(data_dir, s) for s in EVAL_SPLITS}
    with open(os.path.join(data_dir, "manifest.json")) as f:
        data_manifest = json.load(f)
    cal_split = splits["calibration"]
    anchor_ids = sorted(cid for g in cal_split.groups for cid in g["candidates"])
    anchor_id = hashlib.sha256("\n".join(anchor_ids).encode()).hexdigest()[:16]

    def fitted_t(r_cal):
        pv = _pair_view(cal_split, r_cal)
        d = pv["p"] != 0.5
        return cal.fit_temperature((pv["r_a"] - pv["r_b"])[d], pv["p"][d])

    report = {"members": {}, "tie_rule": ranking.TIE_RULE}
    curves = {}
    for name, rewards in members:
        t = fitted_t(rewards["calibration"])
        rep = split_report(splits["heldout"], rewards["heldout"], t)
        member_curves = rep.pop("_curves")
        if len(members) == 1:
            curves.update({f"{name} {k}": v for k, v in member_curves.items()})
        report["members"][name] = {"temperature": t, "heldout": rep}
    if len(members) > 1:
        aligned = {s: np.stack([anchor_align(rw["calibration"], rw[s]) for _, rw in members]) for s in EVAL_SPLITS}
        ens = {}
        for kind, fn in (("mean", lambda a: a.mean(0)), ("min", lambda a: a.min(0))):
            r = {s: fn(aligned[s]) for s in EVAL_SPLITS}
            t = fitted_t(r["calibration"])
            rep = split_report(splits["heldout"], r["heldout"], t)
            c = rep.pop("_curves")
            if kind == "mean":
                curves.update({f"ensemble mean {k}": v for k, v in c.items()})
            ens[kind] = {"temperature": t, "heldout": rep}
        std = aligned["heldout"].std(0)
        ens["std"] = {"mean": float(std.mean()), "p90": float(np.percentile(std, 90))}
        report["ensemble"] = ens
    png = os.path.join(out_dir, "reliability.png")
    cal.reliability_diagram(png, curves)
    report["reliability_diagram"] = png
    primary = report["ensemble"]["mean"] if len(members) > 1 else next(iter(report["members"].values()))
    report["manifest"] = {
        "head_definition": HEAD_DEFINITION, "reward_position_rule": REWARD_POSITION_RULE,
        "tokenizer_sha256": data_manifest.get("tokenizer_sha256"),
        "chat_template_sha256": data_manifest.get("chat_template_sha256"),
        "data_sha256": data_manifest.get("data_sha256"), "calibration_temperature": primary["temperature"],
        "anchor_set_id": anchor_id, "anchor_set": "calibration split candidates", "members": [n for n, _ in members],
        "tie_rule": ranking.TIE_RULE}
    with open(os.path.join(out_dir, "rm_eval.json"), "w") as f:
        json.dump(report, f, indent=1, default=float)
    with open(os.path.join(out_dir, "rm_eval.md"), "w") as f:
        f.write(format_report(report))
    return report


def _f(x) -> str:
    return "nan" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.4f}"


def format_report(report: dict) -> str:
    lines = ["# Scalar RM evaluation (held-out split)", ""]
    rows = [(n, m) for n, m in report["members"].items()]
    if "ensemble" in report:
        rows += [(f"ensemble {k}", report["ensemble"][k]) for k in ("mean", "min")]
    lines += ["| model | pairwise acc (macro by slice) | pairwise acc (all pairs) | Kendall tau-b | Spearman | T | "
              "NLL before | NLL after | Brier before | Brier after | ECE before | ECE after |", "|" + " --- |" * 12]
    for name, m in rows:
        h = m["heldout"]
        cb, ca = h["calibration_before"], h["calibration_after"]
        lines.append(f"| {name} | {_f(h['pairwise']['macro'])} | {_f(h['pairwise']['micro'])} | "
                     f"{_f(h['ranking']['kendall_tau_b'])} | "
                     f"{_f(h['ranking']['spearman'])} | {_f(m['temperature'])} | {_f(cb['nll'])} | {_f(ca['nll'])} | "
                     f"{_f(cb['brier'])} | {_f(ca['brier'])} | {_f(cb['ece'])} | {_f(ca['ece'])} |")
    first = rows[-2][1] if "ensemble" in report else rows[0][1]
    h = first["heldout"]
    bon = h["best_of_n"]
    lines += ["", "Best-of-N (oracle utility of the pick): " + ", ".join(
        f"N={n}: {_f(a)} (oracle {_f(o)})" for n, a, o in zip(bon["n"], bon["reward_pick"], bon["oracle_pick"]))]
    lb = h["length_bias"]
    lines += ["", f"Length bias: spearman(reward, length) {_f(lb['spearman_reward_length'])}, within prompt "
              f"{_f(lb['spearman_reward_length_within_prompt'])}; length-only baseline accuracy "
              f"{_f(lb['length_only_accuracy'])}; RM on equal-length pairs {_f(lb['equal_length_accuracy'])} "
              f"(n={lb['n_equal_length']}), on length-conflict pairs {_f(lb['length_conflict_accuracy'])} "
              f"(n={lb['n_length_conflict']})."]
    lines += ["", "Pairwise by slice: " + ", ".join(f"{s}: {_f(v['accuracy'])} (n={v['n']})"
                                                    for s, v in h["pairwise"]["by_slice"].items())]
    if "ensemble" in report:
        lines += ["", f"Ensemble std (anchor-aligned): mean {_f(report['ensemble']['std']['mean'])}"]
    lines += ["", f"Tie rule: {report['tie_rule']}. Temperature fitted on the calibration split, frozen.",
              f"Anchor set: {report['manifest']['anchor_set_id']}. Reliability diagram: reliability.png", ""]
    return "\n".join(lines)
