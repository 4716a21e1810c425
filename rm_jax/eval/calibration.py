"""Calibration, where users import it (``rm_jax.eval.calibration.calibration_metrics``,
docs/contracts.md "Python API"). It is computed in ``rm_jax.calibration``, on the ground floor, so
that scoring and serving apply a calibrated P(pass) without importing the eval stage.
"""

from rm_jax.calibration import (Calibration, EPS, IDENTITY, METHODS, calibration_metrics, calibration_split,
                                calibration_table, fit_temperature, prior_shift, reliability_bins,
                                reliability_diagram, sigmoid)

__all__ = ["Calibration", "EPS", "IDENTITY", "METHODS", "calibration_metrics", "calibration_split",
           "calibration_table", "fit_temperature", "prior_shift", "reliability_bins", "reliability_diagram",
           "sigmoid"]
