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
    for op in ("absorbed_fold", "absorbed_attention", "absorbed_unfold"):  # 513-token requests: none routed
        assert headline["16"][op] == headline["1"][op] and headline["1"][op]["tiles"] == 0
        assert 0 < headline["1"][op]["programs"] <= 2 * 132  # one persistent launch, once per step
    assert headline["1"]["absorbed_rows"] == 0 and headline["1"]["absorbed_rows_before"] == 32 * 513


def test_interpreter_timing_script(tmp_path):
    # Its own process: TRITON_INTERPRET must be set before any kernel is defined. Times are not asserted.
    import subprocess

    out = tmp_path / "timing.json"
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "benchmarks/interpreter_chunks.py", "--repeats", "1", "--json", str(out)],
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    for routing in ("chunked", "routed"):
        assert set(result[routing]["seconds"]) == {"1", "4", "16"} and result[routing]["k16_over_k1"] > 0
