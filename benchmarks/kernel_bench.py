"""Context-attention pipeline on the GPU under three schedules, eager and replayed from a CUDA graph.

For each batch mix, the chunked context partial (per chunk: gather -> up-project -> attend and fold
into the running partial) runs with the SAME kernels under the packed, whole_requests and old
batch-column schedules. Every schedule is run in its full-batch form ([chunks, B] starts and
workspace offsets; requests without rows in a chunk cost an early exit), so only the schedule
differs. Reported per run: chunks, ms, achieved TFLOP/s (model FLOPs: 2*L*(P+V) per context row
and head for the up-projection, 2*(P+R+V) per query-key-head for attention) and the fraction of a
roofline measured in the same run (a large bf16 matmul and a device-to-device copy): the time
the work would take at those two rates, over the measured time.

    python benchmarks/kernel_bench.py --json benchmarks/results/gpu_kernels.json --plot ...png
    python benchmarks/kernel_bench.py --long       # every mix (the default run keeps to ~1 minute on an H200)
    python benchmarks/kernel_bench.py --smoke      # tiny sizes on any device (CPU: torch kernels)
    python benchmarks/kernel_bench.py --dry-run    # smoke on CPU into a temporary folder, marked dry_run

The JSON is rewritten after every (mix, schedule) row (``benchmarks/report.py``), so a run cut
short leaves every row it finished.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mla_ops  # noqa: E402
from benchmarks.batch_column import batch_column_schedule  # noqa: E402
from benchmarks.report import Report, output_path  # noqa: E402

HEADS, LATENT, NOPE, ROPE, VALUE = 16, 512, 128, 64, 128  # DeepSeek-V2-Lite
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
    trace = os.path.join(os.path.dirname(__file__), "results", "trace_replay.json")
    if os.path.exists(trace):  # the heaviest steps of the Mooncake replay
        with open(trace) as f:
            steps = json.load(f)["steps"]
        steps.sort(key=lambda s: -sum(s["context_lens"]))
        for i, s in enumerate(steps[: 2 if long else 1]):
            out.append((f"mooncake-step-{i}", s["context_lens"], s["query_lens"], 65536))
    return out


def full_batch_chunks(context_lens, query_lens, workspace_size, schedule):
    """[K, B] starts and [K, B+1] workspace offsets of a schedule, over the whole batch."""
    b = len(context_lens)
    if schedule == "batch_column":
        starts, seq_lens = batch_column_schedule(context_lens, workspace_size)
        starts = np.where(seq_lens > 0, starts, 0)
    else:
        plan = mla_ops.plan_context_chunks(context_lens, query_lens, workspace_size, policy=schedule)
        starts = np.zeros((plan.num_chunks, b), np.int64)
        seq_lens = np.zeros((plan.num_chunks, b), np.int64)
        for k, c in enumerate(plan.chunks):
            starts[k, c.request_start : c.request_end] = c.starts.numpy()
            seq_lens[k, c.request_start : c.request_end] = c.seq_lens.numpy()
    cu = np.zeros((starts.shape[0], b + 1), np.int64)
    np.cumsum(seq_lens, axis=1, out=cu[:, 1:])
    return starts, cu


def make_inputs(context_lens, query_lens, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = [-(-c // BLOCK_SIZE) for c in context_lens]
    table = torch.zeros(len(blocks), max(max(blocks), 1), dtype=torch.int32)
    perm = torch.randperm(sum(blocks) + 1).to(torch.int32)
    used = 0
    for r, n in enumerate(blocks):
        table[r, :n] = perm[used : used + n]
        used += n
    randn = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.float32).to(dtype)  # noqa: E731
    return dict(
        q=randn(sum(query_lens), HEADS, NOPE + ROPE),
        kv_cache=randn(sum(blocks) + 1, BLOCK_SIZE, LATENT + ROPE),
        block_table=table.to(device),
        query_start_loc=torch.tensor([0, *np.cumsum(query_lens).tolist()], dtype=torch.int32, device=device),
        weight=randn(HEADS * (NOPE + VALUE), LATENT) / math.sqrt(LATENT),
    )


def context_pipeline(x, starts, cu, workspace_size):
    """The context partial of every token: K chunks of gather, up-project, attend-and-fold."""
    ops = torch.ops.mla_ops
    tokens = x["q"].shape[0]
    out = x["q"].new_zeros(tokens, HEADS, VALUE)
    lse = x["q"].new_full((HEADS, tokens), float("-inf"), dtype=torch.float32)
    workspace = x["q"].new_empty(workspace_size, LATENT + ROPE)
    kv = x["q"].new_empty(workspace_size, HEADS * (NOPE + VALUE))
    k_nope, v = kv.view(-1, HEADS, NOPE + VALUE).split([NOPE, VALUE], dim=-1)
    for k in range(starts.shape[0]):
        ops.gather_context(x["kv_cache"], x["block_table"], cu[k], starts[k], None, workspace)
        ops.up_project(workspace[:, :LATENT], x["weight"], cu[k], kv)
        ops.context_attention(x["q"], k_nope, workspace[:, LATENT:], v, x["query_start_loc"], cu[k], starts[k],
                              NOPE ** -0.5, out, lse)
    return out, lse


def timed(fn, device, reps):
    """Median milliseconds of ``reps`` calls after warm-up."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def roofline(device, dtype):
    """Achieved bf16 matmul TFLOP/s and copy GB/s (read + write) on this device, now."""
    n = 8192 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    mm_ms = timed(lambda: torch.mm(a, b), device, 10)
    src = torch.empty(2**30 if device.type == "cuda" else 2**24, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = timed(lambda: dst.copy_(src), device, 10)
    return {"matmul_tflops": 2 * n**3 / mm_ms / 1e9, "copy_gbps": 2 * src.numel() / copy_ms / 1e6}


def model_cost(context_lens, query_lens, dtype_bytes):
    rows = sum(context_lens)
    flops = 2 * LATENT * (NOPE + VALUE) * HEADS * rows
    flops += 2 * (NOPE + ROPE + VALUE) * HEADS * sum(c * q for c, q in zip(context_lens, query_lens))
    # cache rows read, workspace written and read, K/V written and read, queries and partials.
    row_bytes = (3 * (LATENT + ROPE) + 2 * HEADS * (NOPE + VALUE)) * dtype_bytes
    token_bytes = HEADS * (NOPE + ROPE + 2 * VALUE) * dtype_bytes
    return flops, rows * row_bytes + sum(query_lens) * token_bytes


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_grad_enabled(False)
    peak = roofline(device, dtype)
    print(f"roofline: matmul {peak['matmul_tflops']:.0f} TFLOP/s, copy {peak['copy_gbps']:.0f} GB/s", flush=True)
    report = Report(args.json, dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
        dtype=str(dtype), dims=dict(N=HEADS, L=LATENT, P=NOPE, R=ROPE, V=VALUE, block_size=BLOCK_SIZE),
        long=args.long, roofline=peak,
    ), dry_run=args.dry_run)
    for name, context_lens, query_lens, workspace_size in mixes(args.smoke, args.long):
        x = make_inputs(context_lens, query_lens, device, dtype)
        flops, nbytes = model_cost(context_lens, query_lens, torch.finfo(dtype).bits // 8)
        bound_ms = max(flops / (peak["matmul_tflops"] * 1e9), nbytes / (peak["copy_gbps"] * 1e6))
        for schedule in ("packed", "whole_requests", "batch_column"):
            starts, cu = full_batch_chunks(context_lens, query_lens, workspace_size, schedule)
            starts = torch.as_tensor(starts, dtype=torch.int32, device=device)
            cu = torch.as_tensor(cu, dtype=torch.int32, device=device)
            eager_ms = timed(lambda: context_pipeline(x, starts, cu, workspace_size), device, args.reps)
            graph_ms = None
            if device.type == "cuda":
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    context_pipeline(x, starts, cu, workspace_size)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    context_pipeline(x, starts, cu, workspace_size)
                graph_ms = timed(graph.replay, device, args.reps)
                del graph
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    mixes_ = list(dict.fromkeys(r["mix"] + f"\nW={r['workspace_size']}" for r in rows))
    schedules = ("packed", "whole_requests", "batch_column")
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(mixes_)), 4.5))
    width = 0.27
    for i, s in enumerate(schedules):
        ms = [next((best_ms(r) for r in rows if r["schedule"] == s and r["mix"] + f"\nW={r['workspace_size']}" == m),
                   np.nan) for m in mixes_]  # a partial report may lack the last schedules
        ax.bar(np.arange(len(mixes_)) + (i - 1) * width, ms, width, label=s)
    ax.set_xticks(np.arange(len(mixes_)), mixes_, fontsize=8)
    ax.set_ylabel("context pipeline, ms (best of eager / graph)")
    ax.set_yscale("log")
    ax.set_title(f"{report['device']}, {report['dtype']}, N={HEADS} L={LATENT} P={NOPE} R={ROPE} V={VALUE}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def best_ms(row: dict) -> float:
    """The faster of eager and graph replay (graph_ms is None off CUDA)."""
    return min(t for t in (row["eager_ms"], row["graph_ms"]) if t is not None)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The flags both benchmarks take (and ``benchmarks/gpu_check.sh`` passes)."""
    parser.add_argument("--json", help="write the report here (rewritten after every configuration)")
    parser.add_argument("--plot", help="write a PNG here at the end")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI and CPU)")
    parser.add_argument("--long", action="store_true", help="the long sweep (the default fits a short GPU session)")
    parser.add_argument("--dry-run", action="store_true",
                        help="smoke sizes on CPU, one rep, report marked dry_run, never under benchmarks/results/")


def parse_args(parser: argparse.ArgumentParser, argv, name: str) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.dry_run:
        args.smoke, args.device, args.reps = True, "cpu", 1
        args.json = output_path(args.json, True, name)
        if args.plot:
            output_path(args.plot, True, name)
        print(f"dry run (CPU, no GPU result): {args.json}", flush=True)
    return args


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    args = parse_args(parser, argv, "gpu_kernels.json")
    report = run(args)
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
