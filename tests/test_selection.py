"""Checkpoint selection rule, the sweep table, and that the plots write PNGs."""

import os

import numpy as np
import pytest

from rm_jax.eval.plots import plot_p_pass_hist, plot_reliability, plot_reward_hist, plot_sweep, plot_training
from rm_jax.eval.selection import Choice, SelectionRule, SweepRow, format_table, select_checkpoint

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(step, acc, p, r, f1, auc, mz, img, loss):
    return SweepRow(step, acc, p, r, f1, auc, mz, img, loss)


# Steps 300..1200 shaped like the field report: val loss bottoms at 1100, the second half grows
# over-confident (middle zone falls), AUC peaks early, fail-F1 peaks at 900.
REPORT_LIKE = [
    _row(300, 0.890, 0.40, 0.66, 0.498, 0.915, 0.190, 0.52, 0.300),
    _row(400, 0.905, 0.44, 0.66, 0.528, 0.918, 0.170, 0.55, 0.280),
    _row(500, 0.913, 0.472, 0.647, 0.545, 0.920, 0.155, 0.563, 0.262),
    _row(600, 0.920, 0.52, 0.60, 0.557, 0.915, 0.130, 0.60, 0.250),
    _row(700, 0.925, 0.55, 0.58, 0.565, 0.912, 0.120, 0.62, 0.240),
    _row(800, 0.930, 0.58, 0.55, 0.565, 0.910, 0.110, 0.65, 0.233),
    _row(900, 0.937, 0.629, 0.526, 0.573, 0.908, 0.098, 0.669, 0.228),
    _row(1000, 0.914, 0.476, 0.698, 0.566, 0.910, 0.103, 0.608, 0.225),
    _row(1100, 0.935, 0.649, 0.414, 0.505, 0.905, 0.059, 0.637, 0.223),
    _row(1200, 0.934, 0.63, 0.42, 0.504, 0.895, 0.052, 0.64, 0.224),
]


def test_rule_picks_900_not_lowest_val_loss():
    choice = select_checkpoint(REPORT_LIKE)
    assert choice.step == 900 and not choice.fallback
    # 1100 (0.920 - 0.905 = 0.015) is inside the AUC band despite float rounding; 1200 is not.
    assert choice.candidates == [300, 400, 500, 600, 700, 800, 900, 1000, 1100]
    assert "step 900" in choice.reason and "fail_f1" in choice.reason
    assert select_checkpoint(REPORT_LIKE, SelectionRule.lowest_val_loss()).step == 1100
    assert select_checkpoint(REPORT_LIKE, SelectionRule(objective="auc")).step == 500


def test_field_report_table_picks_900():
    rows = [_row(500, .913, .472, .647, .545, .920, .155, .563, None),
            _row(900, .937, .629, .526, .573, .908, .098, .669, None),
            _row(1000, .914, .476, .698, .566, .910, .103, .608, None),
            _row(1100, .935, .649, .414, .505, .905, .059, .637, 0.223),
            _row(1500, .933, .620, .422, .503, .888, .050, .640, None),
            _row(2000, .935, .642, .448, .528, .886, .053, .648, None)]
    assert select_checkpoint(rows).step == 900


def test_best_f1_with_collapsed_middle_zone_is_skipped():
    rows = [_row(100, .90, .5, .5, .50, .90, .20, None, .3),
            _row(200, .93, .7, .6, .65, .91, .03, None, .2),     # best F1, but a near 0/1 judge
            _row(300, .92, .6, .55, .57, .905, .08, None, .25)]
    choice = select_checkpoint(rows)
    assert choice.step == 300 and 200 not in choice.candidates


def test_ties_go_to_earlier_step():
    rows = [_row(s, .9, .5, .5, .6, .9, .1, None, None) for s in (400, 200, 300)]
    assert select_checkpoint(rows).step == 200


def test_fallback_when_none_qualify():
    rows = [_row(100, .9, .5, .5, .5, .85, .01, None, .3),
            _row(200, .9, .5, .5, .6, .88, .02, None, .2)]
    choice = select_checkpoint(rows)
    assert choice.fallback and choice.step == 200 and choice.candidates == []
    assert "FALLBACK" in choice.reason and "best AUC" in choice.reason


def test_no_auc_at_all_falls_back_to_last_step():
    rows = [_row(100, .9, 0, 0, 0, None, .1, None, None), _row(200, .9, 0, 0, 0, float("nan"), .1, None, None)]
    choice = select_checkpoint(rows)
    assert choice.fallback and choice.step == 200


def test_rule_validation():
    with pytest.raises(ValueError, match="objective"):
        SelectionRule(objective="accuracy")
    with pytest.raises(ValueError, match="at least one"):
        select_checkpoint([])
    with pytest.raises(ValueError, match="duplicate"):
        select_checkpoint([REPORT_LIKE[0], REPORT_LIKE[0]])


def test_from_metrics_and_table():
    metrics = {"accuracy": .9, "fail_precision": .5, "fail_recall": .4, "fail_f1": .44, "auc": None,
               "middle_zone": .1, "img_corr": None}
    row = SweepRow.from_metrics(1300, metrics, val_loss=0.3)
    assert row.step == 1300 and row.auc is None
    choice = select_checkpoint(REPORT_LIKE)
    table = format_table(REPORT_LIKE + [row], choice)
    lines = table.splitlines()
    assert lines[0] == "| step | accuracy | fail P | fail R | F1 | AUC | middle zone | img corr | val loss |"
    assert len(lines) == 2 + len(REPORT_LIKE) + 1
    marked = [ln for ln in lines if "chosen" in ln]
    assert len(marked) == 1 and marked[0].startswith("| **900** ← chosen | **93.7%** |")
    assert "| 0.908**" not in marked[0] and "**0.908**" in marked[0]
    assert "—" in [ln for ln in lines if ln.startswith("| 1300 |")][0]   # missing AUC shown as a dash
    assert format_table(REPORT_LIKE, 1100).count("chosen") == 1


def test_plots_write_pngs(tmp_path):
    rng = np.random.default_rng(0)
    labels = ["fail" if x < 0.15 else "pass" for x in rng.random(200)]
    p = np.clip([0.8 if lab == "pass" else 0.3 for lab in labels] + rng.normal(0, 0.2, 200), 0, 1)
    p[0], p[1] = 0.0, 1.0   # the edges land in the first and last bins
    paths = [plot_sweep(REPORT_LIKE, 900, str(tmp_path / "sweep.png")),
             plot_sweep(REPORT_LIKE[:2], None, str(tmp_path / "sub" / "sweep2.png")),
             plot_reliability(labels, p, str(tmp_path / "rel.png"), bins=10),
             plot_p_pass_hist(labels, p, str(tmp_path / "hist.png")),
             plot_reward_hist(labels, 2 * p - 1, str(tmp_path / "reward.png")),
             plot_training([{"step": s, "loss": 3.0 / s, **({"val_loss": 2.0 / s} if s % 5 == 0 else {})}
                            for s in range(1, 40)], str(tmp_path / "train.png")),
             plot_training([{"step": s, "loss": 3.0 / s, **({"val_loss": 2.0 / s, "val_auc": 0.5 + s / 100,
                                                           "val_middle_zone": 1 - s / 50} if s % 5 == 0 else {})}
                            for s in range(1, 40)], str(tmp_path / "train_judge.png"))]
    for path in paths:
        assert os.path.getsize(path) > 1000
        with open(path, "rb") as f:
            assert f.read(8) == PNG_MAGIC


def test_choice_is_a_record():
    c = select_checkpoint(REPORT_LIKE)
    assert isinstance(c, Choice) and isinstance(c.candidates, list)


def test_unscored_samples_are_counted_not_guessed():
    """A reason-first judge that never wrote the verdict slot (or a too-long prompt) has no
    P(pass): the sweep's metrics leave it out and count it, and equal judge_metrics on the rest."""
    from types import SimpleNamespace

    from rm_jax.data.schema import parse_sample
    from rm_jax.eval.metrics import judge_metrics
    from rm_jax.eval.sweep import evaluate_results
    rng = np.random.default_rng(0)
    samples, results = [], []
    for i in range(40):
        label = "fail" if i % 3 == 0 else "pass"
        samples.append(parse_sample({"id": f"s{i}", "messages": [{"role": "user", "content": "hi"}],
                                     "response": {"content": "hello"}, "label": {"l3": label}},
                                    line=i + 1, base_dir="."))
        lost = i % 7 == 0
        results.append(SimpleNamespace(p_pass=float("nan") if lost else float(rng.random()), slot_found=not lost,
                                       error="too_long: x" if i == 5 else None, off_vocab_mass=0.0))
    got = evaluate_results(samples, results)
    keep = [i for i in range(40) if i % 7 and i != 5]
    want = judge_metrics([samples[i].label.l3 for i in keep], [results[i].p_pass for i in keep],
                         off_vocab_mass=[0.0] * len(keep))
    assert got["n_unscored"] == 40 - len(keep) and got["n"] == len(keep)
    assert got["auc"] == pytest.approx(want["auc"]) and got["fail_f1"] == pytest.approx(want["fail_f1"])
    none = evaluate_results(samples[:2], [results[0], results[0]])
    assert none["n"] == 0 and none["n_unscored"] == 2 and np.isnan(none["auc"])
