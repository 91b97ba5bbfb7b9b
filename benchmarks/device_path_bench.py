"""The device path (``plan_prefill(..., max_chunks=K)``) at K = 1, 4, 16 against the host path.

For the PR's headline batch (one chunk needed), ``run_prefill`` runs with the plan made inside the
timed step (the device form: planner plus K chunk iterations, as a captured step replays it) and
with a host plan made once outside (the chunks the batch needs, nothing more), eager and replayed
from a CUDA graph; every context takes the chunk loop (``absorb_max_query_len=0``). Goals (issue
10): K = 16 within 1.10x of K = 1, and the device path at the K the batch needs close to the host
path. DeepSeek-V2-Lite dims, bf16, as ``kernel_bench``.

``--interpret`` asks the same question on a CPU, of the Triton kernels under Triton's interpreter
(``TRITON_INTERPRET=1``, set before the kernels are defined, hence in the command line): a tiny
batch (contexts 40, 0, 23, 9; 2 heads, L = 16; fp32; workspace 128) that needs one chunk, so K - 1
iterations find no rows. Every launched program runs in Python, so a dead iteration costs what its
launches cost: a proxy for launch overhead, not a GPU time. Two routings: ``interpret-chunked``
(every context on the chunk loop) and ``interpret-routed`` (the default threshold: the short
requests take the absorbed path and the chunk loop has nothing left). The variants run in turn,
best of ``--reps`` (the interpreter is serial: one thread). Goal (issue 10): K = 16 within 1.3x of K = 1.

    python -m benchmarks.device_path_bench --json benchmarks/results/gpu_device_path.json
    python -m benchmarks.device_path_bench --dry-run    # smoke sizes on CPU (torch kernels), marked dry_run
    TRITON_INTERPRET=1 python -m benchmarks.device_path_bench --interpret --reps 5 --json /tmp/interpret.json
"""

from __future__ import annotations

import math
import os

import torch

import mla_ops
from benchmarks._lib import cli
from benchmarks._lib.batches import V2_LITE, Dims, paged_batch
from benchmarks._lib.report import Report, machine
from benchmarks._lib.timing import best_of_interleaved_s, graph_replay_ms, median_ms

MAX_CHUNKS = (1, 4, 16)
DIMS, BLOCK_SIZE = V2_LITE, 64
INTERPRET_DIMS, INTERPRET_BLOCK_SIZE = Dims(heads=2, latent=16, nope=8, rope=4, value=8), 16


def mixes(smoke: bool, interpret: bool):
    """(name, context_lens, query_lens, workspace_size, absorb_max_query_len): batches that need one chunk."""
    if interpret:
        batch = ([40, 0, 23, 9], [5, 3, 1, 7], 128)
        return [("interpret-chunked", *batch, 0), ("interpret-routed", *batch, None)]
    if smoke:
        return [("smoke", [300] + [4] * 7, [9] * 8, 512, 0)]
    return [("pr-headline", [60000] + [16] * 31, [513] * 32, 65536, 0)]


def run(args) -> dict:
    interpret = args.interpret
    device = torch.device("cpu" if interpret else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dims, block_size = (INTERPRET_DIMS, INTERPRET_BLOCK_SIZE) if interpret else (DIMS, BLOCK_SIZE)
    backend = "triton" if interpret else "auto"
    torch.set_grad_enabled(False)
    if interpret:
        torch.set_num_threads(1)  # the interpreter is serial; threads only add noise
    report = Report(args.json, dict(
        machine(device), dtype=str(dtype), dims=dict(dims.header(), block_size=block_size),
        **(dict(backend="triton interpreter", timing="best of interleaved wall times") if interpret else {}),
    ), dry_run=args.dry_run)
    for name, context_lens, query_lens, workspace_size, absorb in mixes(args.smoke, interpret):
        x = paged_batch(context_lens, query_lens, dims, block_size, device, dtype)
        lengths = (x["query_start_loc"], x["context_lens"], x["block_table"], block_size, workspace_size)
        needed = max(1, math.ceil(sum(context_lens) / workspace_size))
        scale = (dims.nope + dims.rope) ** -0.5

        def run_with(plan_fn):
            return lambda: mla_ops.run_prefill(x["q"], x["kv_c"], x["k_pe"], x["kv_cache"], x["kv_b_proj_weight"],
                                               scale, plan_fn(), backend=backend)

        host_plan = mla_ops.plan_prefill(*lengths, absorb_max_query_len=absorb)
        variants = [("host", host_plan.schedule.num_chunks, run_with(lambda: host_plan))]
        variants += [("device", k, run_with(lambda k=k: mla_ops.plan_prefill(*lengths, max_chunks=k,
                                                                             absorb_max_query_len=absorb)))
                     for k in MAX_CHUNKS if k >= needed]
        if interpret:
            best = best_of_interleaved_s({i: step for i, (_, _, step) in enumerate(variants)}, args.reps)
            times = [(best[i] * 1e3, None) for i in range(len(variants))]
        else:
            times = [(median_ms(step, device, args.reps), graph_replay_ms(step, device, args.reps))
                     for _, _, step in variants]
        for (path, chunks, _), (eager_ms, graph_ms) in zip(variants, times):
            row = dict(mix=name, workspace_size=workspace_size, path=path, max_chunks=chunks, chunks_needed=needed,
                       requests=len(context_lens), context_tokens=sum(context_lens), query_tokens=sum(query_lens),
                       absorb_max_query_len=absorb, eager_ms=eager_ms, graph_ms=graph_ms)
            report.add(row)
            print(f"{name:<18} {path:<6} K={chunks:<3} eager {eager_ms:8.3f} ms  graph "
                  f"{graph_ms if graph_ms is None else round(graph_ms, 3)!s:>8} ms", flush=True)
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
    parser = cli.parser(__doc__)
    cli.add_common_args(parser)
    parser.add_argument("--interpret", action="store_true",
                        help="the Triton kernels under Triton's CPU interpreter, tiny sizes (needs TRITON_INTERPRET=1)")
    args = cli.parse_args(parser, argv, "gpu_device_path.json")
    if args.interpret and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--interpret runs the kernels under Triton's interpreter, which must be on before they are "
                     "defined: TRITON_INTERPRET=1 python -m benchmarks.device_path_bench --interpret ...")
    return run(args)


if __name__ == "__main__":
    main()
