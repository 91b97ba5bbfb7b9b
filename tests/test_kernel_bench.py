"""The GPU kernel benchmark stays runnable: its smoke mode on CPU (torch kernels)."""

import json

from benchmarks import kernel_bench


def test_smoke_run_writes_the_report(tmp_path):
    out = tmp_path / "report.json"
    kernel_bench.main(["--smoke", "--reps", "1", "--device", "cpu", "--json", str(out)])
    report = json.loads(out.read_text())
    rows = report["results"]
    assert {r["schedule"] for r in rows} == {"packed", "whole_requests", "batch_column"}
    for mix in {r["mix"] for r in rows}:
        chunks = {r["schedule"]: r["chunks"] for r in rows if r["mix"] == mix}
        assert chunks["packed"] <= chunks["whole_requests"] <= chunks["batch_column"]
    assert all(r["eager_ms"] > 0 and r["roofline_fraction"] > 0 for r in rows)


def test_absorbed_sweep_smoke_run(tmp_path):
    from benchmarks import absorbed_bench

    out = tmp_path / "absorbed.json"
    absorbed_bench.main(["--smoke", "--reps", "1", "--device", "cpu", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["cost_model_threshold"] == 170
    assert {"mha_ms", "absorbed_torch_ms"} <= set(report["results"][0])
    assert report["suggested_absorb_max_query_len"] in {0, 1, 8, 32}
