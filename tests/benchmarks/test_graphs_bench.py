"""benchmarks/graphs_bench.py: its dry run (CPU, tiny sizes) exercises every code path of the GPU run."""

import json

import pytest

from benchmarks import graphs_bench

pytestmark = pytest.mark.bench


def test_graphs_bench_dry_run(tmp_path):
    out = tmp_path / "graphs.json"
    graphs_bench.main(["--dry-run", "--compile-backend", "aot_eager", "--reps", "2", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["complete"] is True and report["device"] == "cpu"
    rows = report["results"]
    assert {r["mode"] for r in rows} == {"eager", "compile"}
    assert all(r["runner_ms"] > 0 and r["eager_ms"] > 0 and r["max_abs_diff"] < 1e-3 for r in rows)
    assert all(r["graphs"] >= 1 and r["eager_steps"] == 0 for r in rows)
