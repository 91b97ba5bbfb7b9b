"""benchmarks/compile_cost.py: regional compilation makes two graphs, whatever the depth, and no restart."""

import pytest

from benchmarks import compile_cost

pytestmark = pytest.mark.bench


def test_regional_compilation_of_a_deep_model_makes_two_graphs_and_no_restart():
    row = compile_cost.measure("regional", 6)
    assert row["graphs"] == 2 and row["restarts"] == 0 and row["seconds"] > 0
