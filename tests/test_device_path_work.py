"""benchmarks/device_path_work.py counts programs from the launchers' own grid functions."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` is not an installed package

from benchmarks import device_path_work  # noqa: E402


def test_work_report_on_a_few_trace_requests(tmp_path):
    out = tmp_path / "work.json"
    device_path_work.main(["--limit", "40", "--json", str(out)])
    headline = json.loads(out.read_text())["headline"]
    for op in ("gather", "up_projection", "attention"):
        one, sixteen = headline["1"][op], headline["16"][op]
        assert one["idle_programs"] == 0 and one["programs"] < one["one_program_per_tile"]  # grids sized to the GPU
        assert sixteen["tiles"] == one["tiles"]  # dead chunk steps walk no tile
        assert sixteen["idle_programs"] == 15 * one["programs"]  # ... and cost one launch each
