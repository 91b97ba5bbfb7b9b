"""benchmarks/device_path_bench.py --interpret: the device path's dead chunk steps under Triton's interpreter."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import device_path_bench

pytestmark = pytest.mark.bench

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_interpreter_mode(tmp_path):
    # Its own process: TRITON_INTERPRET must be set before any kernel is defined. Times are not asserted.
    pytest.importorskip("triton")
    out = tmp_path / "interpret.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.device_path_bench", "--interpret", "--reps", "1",
                          "--json", str(out)], cwd=REPO_ROOT, env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["complete"] and result["backend"] == "triton interpreter" and result["dims"]["N"] == 2
    for mix, host_chunks in (("interpret-chunked", 1), ("interpret-routed", 0)):  # routed: nothing left to chunk
        rows = {(r["path"], r["max_chunks"]): r for r in result["results"] if r["mix"] == mix}
        assert set(rows) == {("host", host_chunks), ("device", 1), ("device", 4), ("device", 16)}
        ratios = result["ratios"][mix]
        one = rows["device", 1]["eager_ms"]
        assert ratios["k16_over_k1_eager"] == round(rows["device", 16]["eager_ms"] / one, 3)
        assert ratios["device_over_host_eager"] == round(one / rows["host", host_chunks]["eager_ms"], 3)


def test_interpreter_mode_needs_the_interpreter_on(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exit_:
        device_path_bench.main(["--interpret"])
    assert exit_.value.code == 2 and "TRITON_INTERPRET=1" in capsys.readouterr().err
