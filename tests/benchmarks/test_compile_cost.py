"""benchmarks/compile_cost.py: regional compilation makes two graphs, whatever the depth, and no restart."""

import pytest

from benchmarks import compile_cost

pytestmark = pytest.mark.bench


def test_regional_compilation_of_a_deep_model_makes_two_graphs_and_no_restart():
    row = compile_cost.measure("regional", 6)
    assert row["graphs"] == 2 and row["restarts"] == 0 and row["seconds"] > 0


def test_fastest_keeps_the_run_of_least_cpu_time_and_lists_every_run():
    runs = [dict(seconds=9.0, cpu_seconds=5.0, load=[1.0, 2.0]), dict(seconds=7.0, cpu_seconds=6.0, load=[3.0, 3.5])]
    row = compile_cost.fastest(runs)
    assert row["cpu_seconds"] == 5.0 and row["runs"] == [[9.0, 5.0, [1.0, 2.0]], [7.0, 6.0, [3.0, 3.5]]]
    assert "runs" not in compile_cost.fastest([dict(seconds=1.0, cpu_seconds=1.0, load=[0.0, 0.0])])
