"""The GPU check (``benchmarks/gpu_check.sh``, ``benchmarks/gpu_summary.py``) stays runnable without a GPU.

``benchmarks/gpu_check.sh --dry-run`` runs every step (CUDA tests, which skip here, the
benchmarks at smoke sizes on the torch kernels, the summary) into a temporary folder. The
pieces that make a cut-short GPU run keep its results are checked on their own: reports
rewritten after every configuration, atomic writes, a summary of partial results, and dry runs
that never write under ``benchmarks/results/``.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks import absorbed_bench, device_path_bench, gpu_summary, graphs_bench, kernel_bench
from benchmarks._lib import report

pytestmark = pytest.mark.bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def results_listing():
    return sorted(os.listdir(report.RESULTS_DIR))


def test_gpu_check_dry_run_runs_every_step_and_summarizes(tmp_path):
    before = results_listing()
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    run = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert results_listing() == before, "a dry run wrote under benchmarks/results/"

    steps = gpu_summary.read_steps(str(tmp_path))
    assert [s["step"] for s in steps] == ["wheels", "env", "cuda_kernels", "dsa", "kernel_bench", "absorbed_bench",
                                          "device_path_bench", "cuda_graphs", "graphs_bench", "summary"]
    assert all(s["status"] == "passed" for s in steps), steps
    for name in ("gpu_env.json", "gpu_kernels.json", "gpu_absorbed.json", "gpu_device_path.json", "gpu_summary.json"):
        assert json.loads((tmp_path / name).read_text())["dry_run"] is True, name

    kernels = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert kernels["complete"] and {r["schedule"] for r in kernels["results"]} == {"packed", "whole_requests",
                                                                                  "batch_column"}
    for mix in {r["mix"] for r in kernels["results"]}:
        chunks = {r["schedule"]: r["chunks"] for r in kernels["results"] if r["mix"] == mix}
        assert chunks["packed"] <= chunks["whole_requests"] <= chunks["batch_column"]
    absorbed = json.loads((tmp_path / "gpu_absorbed.json").read_text())
    assert absorbed["complete"] and absorbed["cost_model_threshold"] == 170
    # The suggestion is the one the smoke sweep's own times imply.
    assert absorbed["suggested_absorb_max_query_len"] == absorbed_bench.suggested_threshold(
        absorbed["results"], [1, 8, 32], ["absorbed_torch_ms"])
    assert {"mha_ms", "absorbed_torch_ms"} <= set(absorbed["results"][0])
    assert absorbed["results"][-1]["query_len"] is None  # the mixed batch

    device_path = json.loads((tmp_path / "gpu_device_path.json").read_text())
    assert device_path["complete"] and {(r["path"], r["max_chunks"]) for r in device_path["results"]} == {
        ("host", 1), ("device", 1), ("device", 4), ("device", 16)}
    assert set(device_path["ratios"]["smoke"]) == {"k4_over_k1_eager", "k16_over_k1_eager", "device_over_host_eager"}

    text = (tmp_path / "gpu_summary.md").read_text()
    assert "DRY RUN on CPU: no GPU result" in text
    assert "| cuda_kernels | 0 | 0 |" in text  # all skipped without a GPU
    assert "| smoke-many-chunks | 64 | 6 / 6 / 38 |" in text


def test_a_run_cut_short_keeps_every_finished_row(tmp_path, monkeypatch):
    path = tmp_path / "kernels.json"
    calls = []
    original = kernel_bench.context_pipeline

    def pipeline_that_dies(*args):
        calls.append(1)
        if len(calls) > 3:  # 2 warm-ups + 1 rep of the first schedule, then the "kill"
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(kernel_bench, "context_pipeline", pipeline_that_dies)
    with pytest.raises(KeyboardInterrupt):
        kernel_bench.main(["--dry-run", "--json", str(path)])
    partial = json.loads(path.read_text())
    assert partial["complete"] is False and partial["dry_run"] is True
    assert [r["schedule"] for r in partial["results"]] == ["packed"]
    assert partial["roofline"]["matmul_tflops"] > 0


def test_atomic_write_keeps_the_old_file_when_a_write_fails(tmp_path):
    path = tmp_path / "report.json"
    report.write_json_atomic(str(path), {"results": [1]})
    with pytest.raises(TypeError):
        report.write_json_atomic(str(path), {"results": [1, object()]})  # dies mid-dump
    assert json.loads(path.read_text()) == {"results": [1]}
    assert os.listdir(tmp_path) == ["report.json"], "no temporary file left behind"


@pytest.mark.parametrize("module", [kernel_bench, absorbed_bench, device_path_bench, graphs_bench])
def test_dry_runs_never_write_under_benchmarks_results(module):
    before = results_listing()
    with pytest.raises(SystemExit, match="dry-run"):
        module.main(["--dry-run", "--json", os.path.join(report.RESULTS_DIR, "gpu_kernels.json")])
    with pytest.raises(SystemExit, match="dry-run"):
        gpu_summary.main(["summary", "--dir", report.RESULTS_DIR, "--dry-run"])
    assert results_listing() == before


def test_dry_run_without_a_path_writes_a_temporary_folder():
    path = report.output_path(None, True, "gpu_kernels.json")
    assert not report.under_results_dir(path) and os.path.isdir(os.path.dirname(path))
    assert report.output_path("anywhere.json", False, "x") == "anywhere.json"


def test_summary_of_a_run_cut_short(tmp_path):
    (tmp_path / "gpu_steps.tsv").write_text(
        "step\tstatus\trc\tseconds\tlimit_s\nenv\tpassed\t0\t3\t20\ncuda_kernels\tfailed\t1\t50\t80\n"
        "kernel_bench\ttimed_out\t124\t65\t60\n"
    )
    (tmp_path / "cuda_kernels.log").write_text(
        "tests/test_cuda.py::test_merge_kernel PASSED [ 10%]\n"
        "tests/test_cuda.py::test_absorbed_kernel[dtype0-False] FAILED [ 20%]\n"
        "tests/test_cuda.py::test_flashmla_adapter_against_reference[dtype0] SKIPPED (no flash_mla) [ 30%]\n"
    )
    row = dict(mix="pr-headline", workspace_size=65536, requests=32, context_tokens=60496, query_tokens=16416)
    rows = [dict(row, schedule="packed", chunks=1, eager_ms=4.0, graph_ms=2.0, tflops=300.0, roofline_fraction=0.5),
            dict(row, schedule="whole_requests", chunks=1, eager_ms=4.2, graph_ms=2.2, tflops=280.0,
                 roofline_fraction=0.45)]  # batch_column never ran
    report.write_json_atomic(str(tmp_path / "gpu_kernels.json"), dict(
        dry_run=False, complete=False, roofline=dict(matmul_tflops=700.0, copy_gbps=4000.0), results=rows,
        device="test", dtype="torch.bfloat16"))

    assert gpu_summary.main(["summary", "--dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "gpu_summary.json").read_text())
    assert summary["dry_run"] is False and "absorbed" not in summary
    assert summary["tests"]["cuda_kernels"]["PASSED"] == 1 and summary["tests"]["cuda_graphs"] is None
    failed = summary["tests"]["cuda_kernels"]["failed_tests"]
    assert failed == ["tests/test_cuda.py::test_absorbed_kernel[dtype0-False]"]
    (mix,) = summary["kernels"]["mixes"]
    assert mix["graph_speedup"] == 2.0 and math.isclose(mix["whole_requests_over_packed"], 1.1)
    assert "batch_column_over_packed" not in mix
    text = (tmp_path / "gpu_summary.md").read_text()
    assert "| kernel_bench | timed_out | 65 | 60 |" in text and "INCOMPLETE (cut short)" in text
    assert "No report." in text and "DRY RUN" not in text
