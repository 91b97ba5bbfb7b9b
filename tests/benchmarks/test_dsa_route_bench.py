"""benchmarks/dsa_route_bench.py at tiny dims: both routes run, agree, and a ratio is suggested."""

import json

import pytest

from benchmarks import dsa_route_bench

pytestmark = pytest.mark.bench


def test_smoke_run_times_both_routes_and_suggests_a_ratio(tmp_path):
    path = tmp_path / "dsa_route_bench.json"
    dsa_route_bench.main(["--smoke", "--reps", "1", "--json", str(path)])
    report = json.loads(path.read_text())
    assert report["complete"] and len(report["results"]) == len(dsa_route_bench.SMOKE_CONFIGS)
    for row in report["results"]:
        assert row["sparse_ms"] > 0 and row["masked_mha_ms"] > 0 and row["break_even_ratio"] > 0
        assert row["max_abs_diff"] < 1e-5 and isinstance(row["picks_faster"], bool)
    assert report["suggested_masked_mha_ratio"] > 0
