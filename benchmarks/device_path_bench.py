"""The device path (``plan_prefill(..., max_chunks=K)``) at K = 1, 4, 16 against the host path, on a GPU.

For the PR's headline batch (one chunk needed), ``run_prefill`` runs with the plan made inside the
timed step (the device form: planner plus K chunk iterations, as a captured step replays it) and
with a host plan made once outside (the chunks the batch needs, nothing more), eager and replayed
from a CUDA graph; every context takes the chunk loop (``absorb_max_query_len=0``). Goals (issue
10): K = 16 within 1.10x of K = 1, and the device path at the K the batch needs close to the host
path. Dims as ``kernel_bench.py`` (DeepSeek-V2-Lite, bf16).

    python benchmarks/device_path_bench.py --json benchmarks/results/gpu_device_path.json
    python benchmarks/device_path_bench.py --dry-run    # smoke sizes on CPU, marked dry_run
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mla_ops  # noqa: E402
from benchmarks.kernel_bench import (  # noqa: E402
    BLOCK_SIZE, HEADS, LATENT, NOPE, ROPE, VALUE, add_common_args, make_inputs, parse_args, timed,
)
from benchmarks.report import Report  # noqa: E402

MAX_CHUNKS = (1, 4, 16)


def mixes(smoke: bool):
    """(name, context_lens, query_lens, workspace_size): batches that need one chunk."""
    if smoke:
        return [("smoke", [300] + [4] * 7, [9] * 8, 512)]
    return [("pr-headline", [60000] + [16] * 31, [513] * 32, 65536)]


def graph_ms(step, device, reps):
    """Milliseconds per replay of ``step`` captured in a CUDA graph; None off CUDA."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture: Triton compiles here
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = timed(graph.replay, device, reps)
    del graph
    return ms


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_grad_enabled(False)
    report = Report(args.json, dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
        dtype=str(dtype), dims=dict(N=HEADS, L=LATENT, P=NOPE, R=ROPE, V=VALUE, block_size=BLOCK_SIZE),
    ), dry_run=args.dry_run)
    for name, context_lens, query_lens, workspace_size in mixes(args.smoke):
        x = make_inputs(context_lens, query_lens, device, dtype)
        g = torch.Generator(device=device).manual_seed(1)
        tokens = x["q"].shape[0]
        kv_c = torch.randn(tokens, LATENT, generator=g, device=device).to(dtype)
        k_pe = torch.randn(tokens, ROPE, generator=g, device=device).to(dtype)
        context = torch.tensor(context_lens, dtype=torch.int32, device=device)
        # Every context on the chunk loop (absorb_max_query_len=0): the loop's dead iterations are measured.
        lengths = (x["query_start_loc"], context, x["block_table"], BLOCK_SIZE, workspace_size)
        needed = max(1, math.ceil(sum(context_lens) / workspace_size))
        scale = (NOPE + ROPE) ** -0.5

        def run_with(plan_fn):
            return lambda: mla_ops.run_prefill(x["q"], kv_c, k_pe, x["kv_cache"], x["weight"], scale, plan_fn())

        host_plan = mla_ops.plan_prefill(*lengths, absorb_max_query_len=0)
        variants = [("host", host_plan.schedule.num_chunks, run_with(lambda: host_plan))]
        variants += [("device", k, run_with(lambda k=k: mla_ops.plan_prefill(*lengths, max_chunks=k,
                                                                             absorb_max_query_len=0)))
                     for k in MAX_CHUNKS if k >= needed]
        for path, chunks, step in variants:
            row = dict(mix=name, workspace_size=workspace_size, path=path, max_chunks=chunks, chunks_needed=needed,
                       requests=len(context_lens), context_tokens=sum(context_lens), query_tokens=tokens,
                       eager_ms=timed(step, device, args.reps), graph_ms=graph_ms(step, device, args.reps))
            report.add(row)
            print(f"{name:<12} {path:<6} K={chunks:<3} eager {row['eager_ms']:8.3f} ms  graph "
                  f"{row['graph_ms'] if row['graph_ms'] is None else round(row['graph_ms'], 3)!s:>8} ms", flush=True)
        del x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = report.finish(ratios=ratios(report.data))
    print(result["ratios"], flush=True)
    return result


def ratios(report: dict) -> dict:
    """Per mix: device K = 16 and K = 4 over K = 1, and device at the needed K over host (eager, graph)."""
    out = {}
    for mix in dict.fromkeys(r["mix"] for r in report["results"]):
        rows = [r for r in report["results"] if r["mix"] == mix]
        device = {r["max_chunks"]: r for r in rows if r["path"] == "device"}
        host = next(r for r in rows if r["path"] == "host")
        needed = min(device) if device else None
        entry = {}
        for mode in ("eager_ms", "graph_ms"):
            if needed is None or device[needed][mode] is None:
                continue
            for k in (4, 16):
                if k in device:
                    entry[f"k{k}_over_k{needed}_{mode[:-3]}"] = round(device[k][mode] / device[needed][mode], 3)
            entry[f"device_over_host_{mode[:-3]}"] = round(device[needed][mode] / host[mode], 3)
        out[mix] = entry
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    return run(parse_args(parser, argv, "gpu_device_path.json"))


if __name__ == "__main__":
    main()
