"""Bytes each rank moves per prefill step under context parallel: all-gather of the context rows,
all-gather of the absorbed queries, and the per-request choice of ``mla_ops.context_parallel``.

The steps are the Mooncake conversation trace through the scheduler model of
``benchmarks/_lib/trace.py`` (``load_trace`` + ``simulate``: 8,192 tokens per step, up to 256
running requests). For D = 2, 4, 8 ranks (DeepSeek-V3: 128 heads, 128 / D per rank; L=512, P=128,
R=64, V=128; bf16 activations, float32 partials; interleave 1) every step is costed three ways,
per rank and per layer:

* ``all_gather``: every request with context takes the all-gather path;
* ``absorbed``: every request with context takes the absorbed-queries path;
* ``routed``: each request the path ``CostModel.prefers_absorbed`` picks (bytes at the machine
  balance ``flops_per_byte`` plus FLOPs), which is what ``plan_prefill(absorb_max_query_len=None,
  context_parallel=...)`` does.

Two byte counts: ``modeled`` is the cost model's (the rows and queries themselves), ``planned``
what the host plan really sends: per chunk, D parts as long as the largest share a rank has of it,
as planned by the library's host planner (rank 0's plan; every rank moves the same amount), plus the absorbed
tokens' queries and partials. No GPU is involved: the bytes follow from the plans, the FLOPs from
the model. Nothing here is a measured time: no multi-GPU machine was available.

    python -m benchmarks.context_parallel_cost \
        --json benchmarks/results/context_parallel_cost.json --plot benchmarks/results/context_parallel_cost.png
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

import mla_ops
from benchmarks._lib import plot as plotting
from benchmarks._lib.report import write_json_atomic
from benchmarks._lib.trace import DEFAULT_TRACE, load_trace, simulate
from mla_ops import parallel
from mla_ops.parallel import plan as cp_planning

STRATEGIES = ("all_gather", "absorbed", "routed")


def planned_bytes(context_lens, query_lens, world_size: int, threshold: int | None, model, workspace_size: int):
    """Bytes rank 0's host plan sends in one layer: all-gather parts, absorbed queries and partials.

    The library's host planning steps for rank 0 of ``world_size``: routing, the stripe schedule and
    every rank's pieces, whose largest share of a chunk sizes that chunk's parts (no process group is
    needed to plan; the reorder index, which does not change the bytes, is left out).
    """
    config = mla_ops.ContextParallel(cost_model=model)
    args = cp_planning._Stripes(0, world_size, 1, workspace_size, workspace_size // world_size, 1, threshold, None,
                                 config)
    absorbed, gathered, starts, lens, schedule = cp_planning._host_schedule(context_lens, query_lens, "packed",
                                                                                 args)
    pieces = cp_planning._chunk_pieces(torch.from_numpy(starts), torch.from_numpy(lens),
                                            torch.from_numpy(gathered), args)
    part_rows = int(pieces.local_cu_seq_lens[..., -1].amax(0).sum())  # each chunk's parts: its largest share
    row = (model.latent + model.rope) * model.activation_bytes
    heads = model.num_heads // world_size
    gathered_bytes = (world_size - 1) * part_rows * row
    tokens = int(query_lens[absorbed].sum())
    absorbed_bytes = tokens * heads * (world_size - 1) * (row + (model.latent + 1) * model.partial_bytes)
    return gathered_bytes + absorbed_bytes, schedule.num_chunks


def cost_steps(steps, worlds: Sequence[int], model, workspace_size: int, planned: bool) -> dict:
    """Per D: per-step bytes (modeled, planned), FLOPs and routing shares of the three strategies."""
    out = {}
    for d in worlds:
        per_step = {s: {"modeled_bytes": [], "planned_bytes": [], "flops": [], "chunks": []} for s in STRATEGIES}
        rows_absorbed = rows_total = requests_absorbed = requests_with_context = 0
        for ctx, q in steps:
            k = model.path_costs(ctx, q, d)
            has = ctx > 0
            choice = model.prefers_absorbed(ctx, q, d) & has
            picks = {"all_gather": np.zeros_like(has), "absorbed": has, "routed": choice}
            thresholds = {"all_gather": 0, "absorbed": 2**31 - 1, "routed": None}
            for s in STRATEGIES:
                a = picks[s]
                bytes_ = np.where(a, k["absorbed_bytes"], k["all_gather_bytes"])
                per_step[s]["modeled_bytes"].append(float(bytes_[has].sum()))
                per_step[s]["flops"].append(float(np.where(a, k["absorbed_flops"], k["all_gather_flops"])[has].sum()))
                if planned:
                    sent, chunks = planned_bytes(ctx, q, d, thresholds[s], model, workspace_size)
                    per_step[s]["planned_bytes"].append(float(sent))
                    per_step[s]["chunks"].append(chunks)
            rows_absorbed += int(ctx[choice].sum())
            rows_total += int(ctx.sum())
            requests_absorbed += int(choice.sum())
            requests_with_context += int(has.sum())
        entry = {"routed_absorbed_context_share": rows_absorbed / max(rows_total, 1),
                 "routed_absorbed_request_share": requests_absorbed / max(requests_with_context, 1)}
        for s in STRATEGIES:
            entry[s] = {name: _summary(values) for name, values in per_step[s].items() if values}
            entry[s]["modeled_cost_flop_equivalents"] = float(
                np.sum(per_step[s]["modeled_bytes"]) * model.flops_per_byte + np.sum(per_step[s]["flops"]))
        entry["per_step_modeled_bytes"] = {s: per_step[s]["modeled_bytes"] for s in STRATEGIES}
        out[str(d)] = entry
    return out


def _summary(values) -> dict:
    v = np.asarray(values, dtype=np.float64)
    return {"total": float(v.sum()), "mean": float(v.mean()), "median": float(np.median(v)),
            "p90": float(np.percentile(v, 90)), "max": float(v.max())}


def plot(result: dict, path: str | Path) -> None:
    plt = plotting.pyplot()
    worlds = result["world_sizes"]
    fig, (bars, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.27
    for i, s in enumerate(STRATEGIES):
        kind = "planned_bytes" if "planned_bytes" in result["by_world_size"][str(worlds[0])][s] else "modeled_bytes"
        means = [result["by_world_size"][str(d)][s][kind]["mean"] / 2**20 for d in worlds]
        bars.bar(np.arange(len(worlds)) + (i - 1) * width, means, width, label=s.replace("_", " "))
    bars.set_xticks(np.arange(len(worlds)), [f"D = {d}" for d in worlds])
    bars.set_ylabel("MiB received per rank, per layer and step (mean)")
    bars.set_yscale("log")
    bars.set_title(f"{kind.replace('_', ' ')}: {result['num_prefill_steps']:,} Mooncake prefill steps")
    bars.legend()
    d = str(worlds[-1])
    for s, style in zip(STRATEGIES, ("-", "-", "--")):
        v = np.sort(np.asarray(result["by_world_size"][d]["per_step_modeled_bytes"][s])) / 2**20
        cdf.plot(np.maximum(v, 1e-2), np.linspace(0, 1, len(v)), style, label=s.replace("_", " "))
    cdf.set_xscale("log")
    cdf.set_xlim(left=1e-2)
    cdf.set_xlabel(f"MiB per step (modeled), D = {d}")
    cdf.set_ylabel("fraction of steps")
    cdf.legend()
    fig.suptitle("Context parallel traffic (DeepSeek-V3 dims, bf16; cost model, no GPU measurement)")
    plotting.save(fig, path, dpi=120)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", help=f"trace .jsonl (Mooncake format); default: {DEFAULT_TRACE.name} in "
                                        "benchmarks/traces/")
    parser.add_argument("--json", required=True, help="where to write the results JSON")
    parser.add_argument("--plot", help="where to write a PNG summary")
    parser.add_argument("--world-sizes", default="2,4,8")
    parser.add_argument("--workspace-size", type=int, default=65536)
    parser.add_argument("--flops-per-byte", type=float, default=parallel.CostModel.flops_per_byte)
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--modeled-only", action="store_true", help="skip running the host planner per step")
    args = parser.parse_args(argv)

    trace = Path(args.trace) if args.trace else DEFAULT_TRACE
    worlds = [int(d) for d in args.world_sizes.split(",")]
    model = parallel.CostModel(flops_per_byte=args.flops_per_byte)
    start = time.perf_counter()
    steps = [(np.asarray(s.context_lens, dtype=np.int64), np.asarray(s.query_lens, dtype=np.int64))
             for s in simulate(load_trace(trace, args.limit))]
    by_world = cost_steps(steps, worlds, model, args.workspace_size, planned=not args.modeled_only)
    result = {
        "trace": str(trace), "num_prefill_steps": len(steps), "world_sizes": worlds,
        "workspace_size": args.workspace_size, "interleave": 1, "cost_model": model.__dict__,
        "units": "bytes received per rank, per layer and step; FLOPs per rank, per layer and step",
        "measured_on_gpus": False, "wall_s": round(time.perf_counter() - start, 1), "by_world_size": by_world,
    }
    if args.plot:
        plot(result, args.plot)
    for entry in by_world.values():  # the plot's per-step series; the JSON keeps the summaries
        entry.pop("per_step_modeled_bytes")
    write_json_atomic(args.json, result)

    kind = "modeled_bytes" if args.modeled_only else "planned_bytes"
    print(f"{len(steps):,} prefill steps; {kind} per rank and layer, mean per step (MiB):")
    print(f"{'D':>3} " + " ".join(f"{s:>12}" for s in STRATEGIES) + "  routed: context rows / requests absorbed")
    for d in worlds:
        e = by_world[str(d)]
        print(f"{d:>3} " + " ".join(f"{e[s][kind]['mean'] / 2**20:>12.2f}" for s in STRATEGIES)
              + f"  {e['routed_absorbed_context_share']:.1%} / {e['routed_absorbed_request_share']:.1%}")
    return result


if __name__ == "__main__":
    main()
