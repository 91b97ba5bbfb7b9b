"""benchmarks/planner_bench.py end to end, cut short: every case runs, the JSON reads back, and the
planners it times agree on what they plan."""

import json

import pytest

from benchmarks import planner_bench

pytestmark = pytest.mark.bench


def test_planner_bench_runs_and_its_planners_agree(tmp_path, monkeypatch):
    monkeypatch.setattr(planner_bench, "BATCH_SIZES", (1, 300))
    monkeypatch.setattr(planner_bench, "CHUNK_TARGETS", (1, 30))
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    planner_bench.main(["--json", str(out), "--plot", str(png), "--rounds", "2", "--trace-rounds", "1",
                        "--limit", "40"])
    result = json.loads(out.read_text())
    cases = result["batch_size"] + result["chunk_count"] + [result["headline"]]
    assert [c["B"] for c in result["batch_size"]] == [1, 300]
    for case in cases:
        assert set(case["us"]) == set(result["planners"]) == set(case["chunks"])
        # whole_requests is vLLM's schedule; packed never needs more chunks.
        assert case["chunks"]["whole_requests"] == case["chunks"]["vllm"]
        assert case["chunks"]["packed"] <= case["chunks"]["vllm"]
        # vLLM upstream's tail split: between packed and #50613.
        assert case["chunks"]["packed"] <= case["chunks"]["vllm_upstream"] <= case["chunks"]["vllm"]
        assert set(case["ratio_upstream"]) == set(result["planners"]) - {"vllm_upstream"}
        assert abs(case["ratio_upstream"]["packed"] - case["us"]["packed"] / case["us"]["vllm_upstream"]) <= 0.002
        # The report rounds times and ratios separately: equal to the rounding.
        assert abs(case["ratio"]["packed"] - case["us"]["packed"] / case["us"]["vllm"]) <= 0.002
    assert result["headline"]["chunks"]["packed"] == 1
    trace = result["trace"]
    assert trace["steps"] == len(result["trace_step_ratios"]["packed"]) > 10
    assert set(trace["ratio_median"]) == set(result["planners"]) - {"vllm"}
    assert set(trace["ratio_median_upstream"]) == set(result["planners"]) - {"vllm_upstream"}
    assert "vllm_upstream" in result["planners"]
    assert trace["steps"] == len(result["trace_step_ratios_upstream"]["packed"])
    assert png.stat().st_size > 10_000
