"""benchmarks/device_path_work.py counts programs from the launchers' own grid functions."""

import json

import pytest

from benchmarks import device_path_work

pytestmark = pytest.mark.bench


def test_work_report_on_a_few_trace_requests(tmp_path):
    out = tmp_path / "work.json"
    device_path_work.main(["--limit", "40", "--json", str(out)])
    result = json.loads(out.read_text())
    headline = result["headline"]
    for op, module in device_path_work.MODULES.items():
        one, sixteen = headline["1"][op], headline["16"][op]
        assert set(one) == {"programs", "idle_programs", "tiles"}
        # A persistent grid: at most PROGRAMS_PER_SM per SM, none idle when the chunk has rows ...
        assert 0 < one["programs"] <= module.PROGRAMS_PER_SM * device_path_work.H200_SMS and one["idle_programs"] == 0
        assert sixteen["tiles"] == one["tiles"] > 0  # ... dead chunk steps walk no tile ...
        assert sixteen["idle_programs"] == 15 * one["programs"]  # ... and cost one launch each
    for op in ("absorbed_fold", "absorbed_attention", "absorbed_unfold"):  # 513-token requests: none routed
        assert headline["16"][op] == headline["1"][op] and headline["1"][op]["tiles"] == 0
        assert 0 < headline["1"][op]["programs"] <= 2 * device_path_work.H200_SMS  # one launch, once per step
    assert headline["1"]["absorbed_rows"] == 0 and headline["1"]["live_chunks"] == 1
    assert result["headline_programs_k16_over_k1"] == 16.0  # every iteration launches the same grids
    assert result["trace_totals"]["1"]["steps"] == result["trace_steps_with_context"] > 0
