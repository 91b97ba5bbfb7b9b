"""benchmarks/variants_bench.py at tiny dims: every variant runs, the window reads fewer rows."""

import json

import pytest

from benchmarks import variants_bench

pytestmark = pytest.mark.bench


def test_smoke_run(tmp_path):
    path = tmp_path / "variants_bench.json"
    variants_bench.main(["--smoke", "--reps", "1", "--json", str(path)])
    report = json.loads(path.read_text())
    assert report["complete"] and {r["route"] for r in report["results"]} == {"chunked", "absorbed"}
    for row in report["results"]:
        assert row["rows_read_full"] == 40 + 20 and row["rows_read_window"] == 2 * (report["window"] - 1)
        assert row["window_time_ratio"] > 0 and set(row["sinks_time_ratio"]) == {"full", "window"}
