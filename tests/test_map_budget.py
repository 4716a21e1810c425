"""The ladder's mapping budget (rm_jax.serve.map_budget) against real XLA:CPU compiles."""

import jax
import jax.numpy as jnp
import pytest

from rm_jax.serve.map_budget import MapBudget, MapBudgetExceeded, mappings_in_use

pytestmark = pytest.mark.skipif(MapBudget.of_process() is None, reason="no /proc mapping counts (not Linux)")


def _compile_new(k: int) -> None:
    """One new executable: a shape this process has not compiled."""
    jax.block_until_ready(jax.jit(lambda x: jnp.tanh(x) * 2 + x.sum())(jnp.ones((k + 3, 7))))


def test_compiles_add_mappings_and_a_roomy_budget_passes():
    budget = MapBudget.of_process()
    mapped = budget.at_start
    for k in range(3):
        _compile_new(100 + k)
        mapped = budget.check(k + 1, 3, mapped)
    assert mappings_in_use() > budget.at_start        # XLA:CPU mapped each executable's kernels
    assert budget.largest_step > 0


def test_projection_past_the_cap_stops_before_the_compile_that_would_fail():
    start = mappings_in_use()
    for k in range(2):
        _compile_new(200 + k)
    grown = mappings_in_use() - start
    assert grown > 0
    # A cap that the two compiles fit under, but not 40 more at the same rate.
    budget = MapBudget(limit=int((start + grown * 6) / 0.95), at_start=start)
    with pytest.raises(MapBudgetExceeded, match=r"remaining 40 of 42 .*vm\.max_map_count=.*--nowarmup"):
        budget.check(2, 42, start + grown // 2)
    # The last shape needs no room after it.
    budget.check(42, 42, mappings_in_use())
