"""benchmarks/cp_step.py: the sharded step's dry run, two gloo processes on CPU."""

import json

import pytest

from benchmarks import cp_step

pytestmark = pytest.mark.bench


def test_dry_run_measures_every_rank(tmp_path):
    out = tmp_path / "cp_step.json"
    cp_step.main(["--dry-run", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["dry_run"] and [r["world_size"] for r in report["ranks"]] == [2, 2]
    for row in report["ranks"]:
        assert row["step_ms"] > 0 and row["all_reduce_ms"] > 0 and row["all_gather_fp8_ms"] > 0
    assert report["ranks"][0]["parameters_per_rank"] == report["ranks"][1]["parameters_per_rank"]
