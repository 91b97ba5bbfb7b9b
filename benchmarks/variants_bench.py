"""What a sliding window saves and what sinks cost (DESIGN §11), one attention layer on a CPU, in one run.

One step of two requests with long contexts and new tokens, one layer through ``run_prefill`` (host plan, the
CPU engine, float32), four variants timed interleaved: no window, a window of ``w``, each with and without
``sinks=``. Two routes: the chunk loop (``absorb_max_query_len=0``: gather, up-project, attend) and the absorbed
path (every request routed: the latent cache read in place). Reported per (route, context):

* ``rows_read``: the context rows the layer reads, per the plan (the chunk loop's gathered rows, the absorbed
  path's window rows), with and without the window, and their ratio; the window's is ``min(c, w - 1)`` per
  request whatever the context;
* ``window_time_ratio``: the windowed layer's time over the unwindowed one's;
* ``sinks_time_ratio``: with sinks over without, for both (1.00: not measurable; the goal).

Dims: DeepSeek-V2-Lite's (N = 16, L = 512, P = 128, R = 64, V = 128), ``w = 512`` (dots3_note's window).
Times are the thread's CPU time (one intra-op thread, the median of ``--reps`` round-robin samples), which other
processes on a shared machine do not inflate as they do wall time. ``--smoke``: tiny dims and sizes.

    python -m benchmarks.variants_bench --json benchmarks/results/variants_bench.json
"""

from __future__ import annotations

import statistics

import torch

import mla_ops
from benchmarks._lib import cli
from benchmarks._lib.batches import V2_LITE, Dims, paged_batch
from benchmarks._lib.report import Report
from benchmarks._lib.timing import thread_time_samples

WINDOW, CONTEXTS, QUERIES, BLOCK = 512, (2048, 8192), 192, 64
SMOKE = dict(window=8, contexts=(40,), queries=6, block=4, dims=Dims(2, 16, 8, 4, 8))
ROUTES = {"chunked": dict(absorb_max_query_len=0), "absorbed": dict(absorb_max_query_len=2**20)}


def rows_read(plan) -> int:
    """Context rows one layer reads under ``plan``: the chunk loop's gathered rows plus the absorbed path's
    (each absorbed request's window, or its whole context)."""
    chunked = plan.schedule.num_context_tokens
    absorbed = plan.absorbed_context_lens.tolist()
    if plan.sliding_window:
        absorbed = [min(c, plan.sliding_window - 1) for c in absorbed]
    return chunked + sum(absorbed)


def variants(x: dict, window: int, block: int, route: dict, sinks: torch.Tensor):
    """name -> (plan, a call running the layer)."""
    out = {}
    for name, w in (("full", None), ("window", window)):
        plan = mla_ops.plan_prefill(x["query_start_loc"], x["context_lens"], x["block_table"], block_size=block,
                                    sliding_window=w, **route)
        for suffix, s in (("", None), ("+sinks", sinks)):
            out[name + suffix] = plan, (lambda plan=plan, s=s: mla_ops.run_prefill(
                x["q"], x["kv_c"], x["k_pe"], x["kv_cache"], x["kv_b_proj_weight"], 0.1, plan, sinks=s))
    return out


@torch.no_grad()
def main(argv=None):
    parser = cli.parser(__doc__)
    cli.add_common_args(parser, reps=5, device="cpu")
    args = cli.parse_args(parser, argv, "variants_bench.json")
    if args.smoke:
        window, contexts, queries, block, dims = (SMOKE[k] for k in ("window", "contexts", "queries", "block", "dims"))
    else:
        window, contexts, queries, block, dims = WINDOW, CONTEXTS, QUERIES, BLOCK, V2_LITE
    torch.set_num_threads(1)
    report = Report(args.json, dict(benchmark="variants_bench", dims=dims.header(), window=window, threads=1,
                                    timer="thread CPU time, median of reps",
                                    dtype="float32", backend="auto (CPU engine)", queries_per_request=queries,
                                    requests=2, reps=args.reps), args.dry_run)
    sinks = torch.randn(dims.heads, generator=torch.Generator().manual_seed(1))
    for context in contexts:
        x = paged_batch([context, context // 2], [queries, queries], dims, block, "cpu", torch.float32, seed=context)
        for route_name, route in ROUTES.items():
            calls = variants(x, window, block, route, sinks)
            samples, _ = thread_time_samples({name: call for name, (_, call) in calls.items()}, args.reps,
                                             sample_ns=0, max_calls=1)
            rows = {name: rows_read(plan) for name, (plan, _) in calls.items() if "+" not in name}
            ms = {name: statistics.median(ns) / 1e6 for name, ns in samples.items()}
            row = dict(route=route_name, context=context, rows_read_full=rows["full"], rows_read_window=rows["window"],
                       rows_ratio=rows["window"] / rows["full"], ms=ms,
                       window_time_ratio=ms["window"] / ms["full"],
                       sinks_time_ratio=dict(full=ms["full+sinks"] / ms["full"],
                                             window=ms["window+sinks"] / ms["window"]))
            report.add(row)
            print(f"{route_name:8s} c={context:6d}: rows {rows['full']:6d} -> {rows['window']:5d} "
                  f"({row['rows_ratio']:.3f}x); time {ms['full']:8.1f} -> {ms['window']:7.1f} ms "
                  f"({row['window_time_ratio']:.3f}x); sinks {row['sinks_time_ratio']['full']:.3f}x / "
                  f"{row['sinks_time_ratio']['window']:.3f}x", flush=True)
    report.finish()


if __name__ == "__main__":
    main()
