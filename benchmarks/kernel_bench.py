"""Context-attention pipeline on the GPU under three schedules, eager and replayed from a CUDA graph.

For each batch mix, the chunked context partial (per chunk: gather -> up-project -> attend and fold
into the running partial) runs with the SAME kernels under the packed, whole_requests and old
batch-column schedules. Every schedule is run in its full-batch form ([chunks, B] starts and
workspace offsets; requests without rows in a chunk cost an early exit), so only the schedule
differs. Reported per run: chunks, ms, achieved TFLOP/s (model FLOPs: 2*L*(P+V) per context row
and head for the up-projection, 2*(P+R+V) per query-key-head for attention) and the fraction of a
roofline measured in the same run (a large bf16 matmul and a device-to-device copy): the time
the work would take at those two rates, over the measured time.

    python -m benchmarks.kernel_bench --json benchmarks/results/gpu_kernels.json --plot ...png
    python -m benchmarks.kernel_bench --long       # every mix (the default run keeps to ~1 minute on an H200)
    python -m benchmarks.kernel_bench --smoke      # tiny sizes on any device (CPU: torch kernels)
    python -m benchmarks.kernel_bench --dry-run    # smoke on CPU into a temporary folder, marked dry_run

The JSON is rewritten after every (mix, schedule) row (``benchmarks/_lib/report.py``), so a run cut
short leaves every row it finished.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from benchmarks._lib import cli
from benchmarks._lib import plot as plotting
from benchmarks._lib.batches import V2_LITE, paged_batch
from benchmarks._lib.costs import pipeline_cost
from benchmarks._lib.pipeline import SCHEDULES, chunk_tensors, context_pipeline
from benchmarks._lib.report import RESULTS_DIR, Report, machine
from benchmarks._lib.timing import graph_replay_ms, median_ms

DIMS = V2_LITE
BLOCK_SIZE = 64


def mixes(smoke: bool, long: bool = False):
    """(name, context_lens, query_lens, workspace_size); the PR's headline batch first."""
    if smoke:
        return [("smoke", [300] + [4] * 7, [9] * 8, 512), ("smoke-many-chunks", [300] + [4] * 7, [9] * 8, 64)]
    out = [
        ("pr-headline", [60000] + [16] * 31, [513] * 32, 65536),
        ("pr-headline-w16k", [60000] + [16] * 31, [513] * 32, 16384),
        ("many-short", [256] * 128, [64] * 128, 65536),
    ]
    if long:
        out += [
            ("uniform-8x8k", [8192] * 8, [512] * 8, 65536),
            ("long-tail", [32768] + [4096] * 4 + [512] * 16, [256] * 21, 65536),
        ]
    trace = os.path.join(RESULTS_DIR, "trace_replay.json")
    if os.path.exists(trace):  # the heaviest steps of the Mooncake replay
        with open(trace) as f:
            steps = json.load(f)["steps"]
        steps.sort(key=lambda s: -sum(s["context_lens"]))
        for i, s in enumerate(steps[: 2 if long else 1]):
            out.append((f"mooncake-step-{i}", s["context_lens"], s["query_lens"], 65536))
    return out


def roofline(device, dtype):
    """Achieved bf16 matmul TFLOP/s and copy GB/s (read + write) on this device, now."""
    n = 8192 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    mm_ms = median_ms(lambda: torch.mm(a, b), device, 10)
    src = torch.empty(2**30 if device.type == "cuda" else 2**24, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), device, 10)
    return {"matmul_tflops": 2 * n**3 / mm_ms / 1e9, "copy_gbps": 2 * src.numel() / copy_ms / 1e6}


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_grad_enabled(False)
    peak = roofline(device, dtype)
    print(f"roofline: matmul {peak['matmul_tflops']:.0f} TFLOP/s, copy {peak['copy_gbps']:.0f} GB/s", flush=True)
    report = Report(args.json, dict(
        machine(device), dtype=str(dtype), dims=dict(DIMS.header(), block_size=BLOCK_SIZE), long=args.long,
        roofline=peak,
    ), dry_run=args.dry_run)
    for name, context_lens, query_lens, workspace_size in mixes(args.smoke, args.long):
        x = paged_batch(context_lens, query_lens, DIMS, BLOCK_SIZE, device, dtype)
        flops, nbytes = pipeline_cost(context_lens, query_lens, DIMS, torch.finfo(dtype).bits // 8)
        bound_ms = max(flops / (peak["matmul_tflops"] * 1e9), nbytes / (peak["copy_gbps"] * 1e6))
        for schedule in SCHEDULES:
            starts, cu = chunk_tensors(context_lens, query_lens, workspace_size, schedule, device)
            step = lambda: context_pipeline(x, DIMS, starts, cu, workspace_size)  # noqa: E731
            eager_ms = median_ms(step, device, args.reps)
            graph_ms = graph_replay_ms(step, device, args.reps)
            best = min(t for t in (eager_ms, graph_ms) if t is not None)
            row = dict(mix=name, workspace_size=workspace_size, schedule=schedule, chunks=int(starts.shape[0]),
                       requests=len(context_lens), context_tokens=sum(context_lens), query_tokens=sum(query_lens),
                       eager_ms=eager_ms, graph_ms=graph_ms, tflops=flops / best / 1e9,
                       roofline_fraction=bound_ms / best)
            report.add(row)
            print(f"{name:<20} W={workspace_size:<6} {schedule:<15} chunks={row['chunks']:<4} eager {eager_ms:8.3f} ms"
                  f"  graph {graph_ms if graph_ms is None else round(graph_ms, 3)!s:>8} ms  "
                  f"{row['tflops']:7.1f} TFLOP/s  {row['roofline_fraction']:.1%} of roofline", flush=True)
        del x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report.finish()


def plot(report: dict, path: str) -> None:
    plt = plotting.pyplot()
    rows = report["results"]
    mixes_ = list(dict.fromkeys(r["mix"] + f"\nW={r['workspace_size']}" for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(mixes_)), 4.5))
    width = 0.27
    for i, s in enumerate(SCHEDULES):
        ms = [next((best_ms(r) for r in rows if r["schedule"] == s and r["mix"] + f"\nW={r['workspace_size']}" == m),
                   np.nan) for m in mixes_]  # a partial report may lack the last schedules
        ax.bar(np.arange(len(mixes_)) + (i - 1) * width, ms, width, label=s)
    ax.set_xticks(np.arange(len(mixes_)), mixes_, fontsize=8)
    ax.set_ylabel("context pipeline, ms (best of eager / graph)")
    ax.set_yscale("log")
    dims = " ".join(f"{k}={v}" for k, v in report.get("dims", {}).items() if k != "block_size")
    ax.set_title(f"{report['device']}, {report['dtype']}, {dims}")
    ax.legend()
    plotting.save(fig, path, dpi=120)


def best_ms(row: dict) -> float:
    """The faster of eager and graph replay (graph_ms is None off CUDA)."""
    return min(t for t in (row["eager_ms"], row["graph_ms"]) if t is not None)


def main(argv=None) -> None:
    parser = cli.parser(__doc__)
    cli.add_common_args(parser)
    args = cli.parse_args(parser, argv, "gpu_kernels.json")
    report = run(args)
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
