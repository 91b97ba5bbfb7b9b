"""The first and last steps of ``benchmarks/gpu_check.sh``: what the machine is, and what the run got.

    python -m benchmarks.gpu_summary env --json OUT/gpu_env.json    # versions, GPU, FlashMLA
    python -m benchmarks.gpu_summary summary --dir OUT               # OUT/gpu_summary.md, .json, plots

The summary reads whatever the steps left in OUT, complete or not: the step table
(``gpu_steps.tsv``: status, seconds, time limit), the pytest logs (one line per test, written as
it finishes), and the benchmark JSONs (rewritten after every configuration). It reports what ran,
what passed, and the key ratios: packed against the old batch-column schedule and graph replay
against eager per mix; absorbed against chunked MHA and Triton against FlashMLA per sweep point;
the device path's K = 16 against K = 1 and against the host path.
``--dry-run`` marks everything as a CPU dry run and refuses ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import platform
import re
import sys

from benchmarks._lib.report import under_results_dir, write_json_atomic

TEST_STEPS = ("cuda_kernels", "dsa", "cuda_graphs", "cuda_models")
TEST_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def environment() -> dict:
    import numpy
    import torch

    env = dict(python=platform.python_version(), torch=torch.__version__, numpy=numpy.__version__,
               cuda_available=torch.cuda.is_available(), cuda_runtime=torch.version.cuda)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = "sm_%d%d" % torch.cuda.get_device_capability()
    from mla_ops.ops import flashmla

    env["flash_mla_installed"] = importlib.util.find_spec("flash_mla") is not None
    env["flashmla_available"], env["flashmla_reason"] = flashmla.available()
    if env["flash_mla_installed"]:
        try:
            import flash_mla

            env["flash_mla_version"] = flash_mla.__version__
        except Exception as exc:  # its CUDA extension failed to load: the reason is in flashmla_reason
            env["flash_mla_version"] = f"import failed: {type(exc).__name__}"
    return env


def read_steps(directory: str) -> list[dict]:
    path = os.path.join(directory, "gpu_steps.tsv")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(csv.DictReader(f, delimiter="\t"))


def read_json(directory: str, name: str) -> dict | None:
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def test_results(directory: str, step: str) -> dict | None:
    """Per-test outcomes from a ``pytest -v`` log (lines are written as each test finishes)."""
    path = os.path.join(directory, f"{step}.log")
    if not os.path.exists(path):
        return None
    outcomes = {}
    with open(path, errors="replace") as f:
        for line in f:
            match = TEST_LINE.match(line.strip())
            if match:
                outcomes[match.group(1)] = match.group(2)
    counts = {k: sum(v == k for v in outcomes.values()) for k in ("PASSED", "FAILED", "SKIPPED", "ERROR")}
    return dict(counts, failed_tests=sorted(t for t, v in outcomes.items() if v in ("FAILED", "ERROR")))


def kernel_ratios(report: dict) -> list[dict]:
    """Per mix: chunks and best times of the three schedules, batch-column / packed, eager / graph."""
    from benchmarks.kernel_bench import best_ms

    mixes = {}
    for r in report["results"]:
        mixes.setdefault((r["mix"], r["workspace_size"]), {})[r["schedule"]] = r
    out = []
    for (mix, workspace), rows in mixes.items():
        packed = rows.get("packed")
        entry = dict(mix=mix, workspace_size=workspace,
                     chunks={s: r["chunks"] for s, r in rows.items()}, ms={s: best_ms(r) for s, r in rows.items()})
        if packed:
            entry["tflops"] = packed["tflops"]
            entry["roofline_fraction"] = packed["roofline_fraction"]
            if packed["graph_ms"]:
                entry["graph_speedup"] = packed["eager_ms"] / packed["graph_ms"]
            for other in ("whole_requests", "batch_column"):
                if other in rows:
                    entry[f"{other}_over_packed"] = best_ms(rows[other]) / best_ms(packed)
        out.append(entry)
    return out


def absorbed_ratios(report: dict) -> list[dict]:
    """Per sweep point: MHA over the best absorbed time, Triton over FlashMLA."""
    out = []
    for r in report["results"]:
        absorbed = {k[:-3]: v for k, v in r.items() if k.startswith("absorbed_") and k.endswith("_ms")}
        entry = dict(context_len=r["context_len"], query_len=r["query_len"], mha_ms=r["mha_ms"], absorbed_ms=absorbed)
        if absorbed:
            entry["mha_over_absorbed"] = r["mha_ms"] / min(absorbed.values())
        if "absorbed_triton" in absorbed and "absorbed_flashmla" in absorbed:
            entry["triton_over_flashmla"] = absorbed["absorbed_triton"] / absorbed["absorbed_flashmla"]
        out.append(entry)
    return out


def fmt(value, spec=".3g") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, float) else str(value)


def completion(report: dict) -> str:
    return "Complete" if report["complete"] else "INCOMPLETE (cut short)"


def markdown(summary: dict) -> str:
    lines = ["# GPU check summary", ""]
    if summary["dry_run"]:
        lines += ["**DRY RUN on CPU: no GPU result.** It checks that every step runs and reports.", ""]
    env = summary.get("env") or {}
    lines += [f"Machine: {env.get('device', 'no CUDA device')} ({env.get('capability', '-')}), python "
              f"{env.get('python', '?')}, torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, numpy "
              f"{env.get('numpy', '?')}; FlashMLA: "
              f"{'yes' if env.get('flashmla_available') else 'no (' + str(env.get('flashmla_reason', '?')) + ')'}", ""]
    lines += ["## Steps", "", "| step | status | seconds | limit (s) |", "| --- | --- | ---: | ---: |"]
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s['limit_s']} |" for s in summary["steps"]]
    lines += ["", "## CUDA tests", "", "| step | passed | failed | skipped | errors |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for step, t in summary["tests"].items():
        if t is None:
            lines.append(f"| {step} | no log | | | |")
        else:
            lines.append(f"| {step} | {t['PASSED']} | {t['FAILED']} | {t['SKIPPED']} | {t['ERROR']} |")
    failed = [name for t in summary["tests"].values() if t for name in t["failed_tests"]]
    lines += [f"* failed: `{name}`" for name in failed]
    kernels, absorbed, device_path = (summary.get(k) for k in ("kernels", "absorbed", "device_path"))
    lines += ["", "## Context pipeline (kernel_bench): best of eager / graph replay", ""]
    if kernels is None:
        lines.append("No report.")
    else:
        lines += [f"{completion(kernels)}; roofline: "
                  f"{fmt(kernels['roofline'].get('matmul_tflops'))} TFLOP/s matmul, "
                  f"{fmt(kernels['roofline'].get('copy_gbps'))} GB/s copy.", "",
                  "| mix | W | chunks p / w / b | packed ms | batch-column / packed | whole / packed "
                  "| eager / graph | TFLOP/s | roofline |",
                  "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for m in kernels["mixes"]:
            chunks = " / ".join(str(m["chunks"].get(s, "-")) for s in ("packed", "whole_requests", "batch_column"))
            lines.append(f"| {m['mix']} | {m['workspace_size']} | {chunks} | {fmt(m['ms'].get('packed'))} | "
                         f"{fmt(m.get('batch_column_over_packed'))} | {fmt(m.get('whole_requests_over_packed'))} | "
                         f"{fmt(m.get('graph_speedup'))} | {fmt(m.get('tflops'), '.1f')} | "
                         f"{fmt(m.get('roofline_fraction'), '.1%')} |")
    lines += ["", "## Absorbed vs chunked MHA (absorbed_bench)", ""]
    if absorbed is None:
        lines.append("No report.")
    else:
        lines += [f"{completion(absorbed)}; suggested "
                  f"absorb_max_query_len: {fmt(absorbed['suggested'])} (cost model: {absorbed['cost_model']}).", "",
                  "| context | query | MHA ms | absorbed ms | MHA / absorbed | Triton / FlashMLA |",
                  "| ---: | ---: | ---: | --- | ---: | ---: |"]
        for p in absorbed["points"]:
            times = ", ".join(f"{k[len('absorbed_'):]} {fmt(v)}" for k, v in p["absorbed_ms"].items())
            lines.append(f"| {p['context_len']} | {fmt(p['query_len'] if p['query_len'] is not None else 'mixed')} | "
                         f"{fmt(p['mha_ms'])} | {times} | {fmt(p.get('mha_over_absorbed'))} | "
                         f"{fmt(p.get('triton_over_flashmla'))} |")
    lines += ["", "## Device path: K static chunk iterations vs the host plan (device_path_bench)", ""]
    if device_path is None:
        lines.append("No report.")
    else:
        lines += [f"{completion(device_path)}.", "",
                  "| mix | ratio | value |", "| --- | --- | ---: |"]
        lines += [f"| {mix} | {key} | {fmt(value)} |" for mix, entry in device_path["ratios"].items()
                  for key, value in entry.items()]
    return "\n".join(lines) + "\n"


def plots(directory: str, kernels: dict | None, absorbed: dict | None) -> list[str]:
    """PNGs from the (possibly partial) reports; none without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return []
    from benchmarks import absorbed_bench, kernel_bench

    made = []
    for report, module, name in ((kernels, kernel_bench, "gpu_kernels.png"), (absorbed, absorbed_bench,
                                                                             "gpu_absorbed.png")):
        if report and report["results"]:
            module.plot(report, os.path.join(directory, name))
            made.append(name)
    return made


def summarize(directory: str, dry_run: bool) -> dict:
    kernels, absorbed = read_json(directory, "gpu_kernels.json"), read_json(directory, "gpu_absorbed.json")
    summary = dict(dry_run=dry_run, env=read_json(directory, "gpu_env.json"), steps=read_steps(directory),
                   tests={step: test_results(directory, step) for step in TEST_STEPS})
    if kernels is not None:
        summary["kernels"] = dict(complete=kernels["complete"], roofline=kernels.get("roofline", {}),
                                  mixes=kernel_ratios(kernels))
    if absorbed is not None:
        summary["absorbed"] = dict(complete=absorbed["complete"], cost_model=absorbed["cost_model_threshold"],
                                   suggested=absorbed.get("suggested_absorb_max_query_len"),
                                   points=absorbed_ratios(absorbed))
    device_path = read_json(directory, "gpu_device_path.json")
    if device_path is not None:
        summary["device_path"] = dict(complete=device_path["complete"], ratios=device_path.get("ratios", {}))
    summary["dry_run"] = dry_run or any((r or {}).get("dry_run") for r in (kernels, absorbed, device_path))
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    env_parser = sub.add_parser("env", help="versions, GPU and FlashMLA of this machine")
    env_parser.add_argument("--json", required=True)
    env_parser.add_argument("--dry-run", action="store_true")
    summary_parser = sub.add_parser("summary", help="the table of what ran, what passed, the key ratios")
    summary_parser.add_argument("--dir", required=True, help="the folder the steps wrote into")
    summary_parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    where = args.json if args.command == "env" else args.dir
    if args.dry_run and under_results_dir(where):
        raise SystemExit(f"--dry-run writes nothing under benchmarks/results/: got {where}")

    if args.command == "env":
        env = dict(environment(), dry_run=args.dry_run)
        write_json_atomic(args.json, env)
        print(json.dumps(env, indent=1))
        return 0 if env["cuda_available"] or args.dry_run else 1
    summary = summarize(args.dir, args.dry_run)
    write_json_atomic(os.path.join(args.dir, "gpu_summary.json"), summary)
    text = markdown(summary)
    with open(os.path.join(args.dir, "gpu_summary.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
    # Plots last: the table is on disk even if matplotlib is slow or missing.
    reports = (read_json(args.dir, "gpu_kernels.json"), read_json(args.dir, "gpu_absorbed.json"))
    summary["plots"] = plots(args.dir, *reports)
    write_json_atomic(os.path.join(args.dir, "gpu_summary.json"), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
