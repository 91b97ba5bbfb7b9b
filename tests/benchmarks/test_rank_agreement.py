"""benchmarks/rank_agreement.py: the per-step agreement beside a generation step, two gloo processes."""

import json

import pytest

from benchmarks import rank_agreement

pytestmark = pytest.mark.bench


def test_every_rank_reports_the_agreement_and_the_step(tmp_path):
    out = tmp_path / "rank_agreement.json"
    rank_agreement.main(["--reps", "5", "--prompts", "1", "--new-tokens", "3", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["rank"] for r in rows] == [0, 1] and all(r["backend"] == "gloo" for r in rows)
    for row in rows:
        assert row["agreement_ms"] > 0 and row["step_ms"] > 0 and row["steps"] == 3
