"""The demo's lessons table: the noise bounds against simulation and the verdict each gets."""

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from rm_jax.eval import lessons


@pytest.mark.parametrize("shift,n_pos,n_neg,rel", [(0.8, 248, 452, 0.1), (1.5, 60, 640, 0.3)])
def test_auc_standard_error_bounds_the_spread_of_simulated_aucs(shift, n_pos, n_neg, rel):
    """Close at the demo's AUCs and class sizes; at high AUC with few positives Hanley-McNeil
    overstates a binormal spread (the safe side: a 'separated' verdict stays conservative)."""
    rng = np.random.default_rng(0)
    y = np.r_[np.ones(n_pos), np.zeros(n_neg)]
    aucs = [roc_auc_score(y, np.r_[rng.normal(shift, 1, n_pos), rng.normal(0, 1, n_neg)]) for _ in range(400)]
    se = lessons.auc_se(float(np.mean(aucs)), n_pos, n_neg)
    assert np.std(aucs) == pytest.approx(se, rel=rel) and se > 0.9 * np.std(aucs)


def test_share_standard_error_matches_binomial_draws():
    rng = np.random.default_rng(1)
    draws = rng.binomial(248, 0.3, size=4000) / 248
    assert np.std(draws) == pytest.approx(lessons.share_se(0.3, 248), rel=0.05)


def _m(auc, middle, recall, n=700, n_fail=248):
    return {"n": n, "n_fail": n_fail, "auc": auc, "middle_zone": middle, "fail_recall": recall,
            "fail_precision": 0.5}


def test_ablation_lessons_separate_large_effects_and_call_small_ones_noise():
    rows = {"verdict_first": _m(0.74, 0.75, 0.26), "reason_first": _m(0.60, 0.0, 0.20),
            "oversample_1": _m(0.74, 0.75, 0.26), "oversample_3": _m(0.73, 0.80, 0.57),
            "policy_init": _m(0.74, 0.75, 0.26), "random_init": _m(0.72, 0.70, 0.25)}
    got = {ls.name: ls for ls in lessons.ablation_lessons(rows, "test")}
    assert got["reason_first"].holds is True        # middle zone 75% -> 0%
    assert got["oversample_3"].holds is True        # recall 26% -> 57% on 248 failures
    assert got["policy_init"].holds is None         # +0.02 AUC on 700 samples is inside the noise
    rows["policy_init"], rows["random_init"] = rows["random_init"], _m(0.85, 0.7, 0.3)
    assert {ls.name: ls for ls in lessons.ablation_lessons(rows, "t")}["policy_init"].holds is False
    text = "\n".join(lessons.lesson_lines(list(got.values())))
    assert "reproduced" in text and "inside the noise" in text


def test_selection_lesson_on_one_step_cannot_separate_the_rules():
    sweep = {"chosen": {"step": 1000}, "lowest_val_loss_step": 1000}
    ls = lessons.selection_lesson(sweep, lambda s, step: _m(0.74, 0.78, 0.3), "sweep")
    assert ls.holds is None and "both choose step 1000" in ls.note
    sweep["lowest_val_loss_step"] = 400
    by_step = {1000: _m(0.80, 0.30, 0.5), 400: _m(0.62, 0.90, 0.2)}
    ls = lessons.selection_lesson(sweep, lambda s, step: by_step[step], "sweep")
    assert ls.holds is True and "step 400" in ls.base_label
