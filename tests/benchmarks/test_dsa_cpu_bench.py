"""benchmarks/dsa_cpu_bench.py at tiny dims: both sides run, select the same keys and agree."""

import json

import pytest

from benchmarks import dsa_cpu_bench

pytestmark = pytest.mark.bench


@pytest.mark.parametrize("clock", [[], ["--thread-time"]], ids=["wall", "thread time"])
def test_smoke_run_agrees_with_transformers(tmp_path, clock):
    path = tmp_path / "dsa_cpu_bench.json"
    dsa_cpu_bench.main(["--smoke", "--reps", "1", "--json", str(path), "--plot", str(tmp_path / "p.png"), *clock])
    report = json.loads(path.read_text())
    assert report["complete"] and report["threads"] == (1 if clock else 2)
    (row,) = report["results"]
    assert row["topk_equal"] == f"{row['prompt']} / {row['prompt']}"
    assert row["max_abs_diff"] < 1e-5 * max(row["max_abs_out"], 1.0)
    assert row["mla_ops_ms"] > 0 and row["transformers_ms"] > 0
