"""Judge metrics, where users import them (``rm_jax.eval.metrics.judge_metrics``, docs/contracts.md
"Python API"). They are computed in ``rm_jax.metrics``, on the ground floor, so that training can
import them without the eval stage; this module only names them here.
"""

from rm_jax.metrics import (METRIC_KEYS, MIDDLE_ZONE, PASS_THRESHOLD, fail_indicator, failures_by_issue,
                            judge_metrics, optional_floats, pearson_or_nan, safe_auc, to_jsonable)

__all__ = ["METRIC_KEYS", "MIDDLE_ZONE", "PASS_THRESHOLD", "fail_indicator", "failures_by_issue", "judge_metrics",
           "optional_floats", "pearson_or_nan", "safe_auc", "to_jsonable"]
