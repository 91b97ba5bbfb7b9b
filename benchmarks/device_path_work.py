"""Programs launched and tiles processed by the device path's K chunk iterations, per op.

The device path (``plan_prefill(..., max_chunks=K)``) runs K static chunk iterations, each
launching gather, up-projection and context attention. Their launches are persistent: each grid
is the op's own ``grid`` function (``mla_ops.triton.gather.grid``, ``rows_gemm.grid``,
``attention.grid``, the ones the launchers call) at an H200's 132 SMs times the op's
``PROGRAMS_PER_SM``, and the programs stride over the tiles that are live in the chunk. This
script counts, for the PR's headline batch (32 requests x 513 new tokens, contexts 60,000 +
31 x 16, W = 65,536) and for every step of the Mooncake conversation trace (``load_trace`` +
``simulate`` of ``benchmarks/_lib/trace.py``), at K = 1, 4, 16:

* ``programs``: the sum over the K iterations of each launch's grid;
* ``idle_programs``: programs whose stride loop finds no tile (about a launch's worth per dead chunk);
* ``tiles``: the tiles the stride loops walk (gather: row tiles x column tiles of the chunk's rows;
  up-projection: output tiles of its rows; attention: the query-tile slots of the chunk's live run
  of requests x heads, as the kernel counts them).

The absorbed path runs once per step, before the chunks: fold, latent attention and unfold over
the routed requests' tokens packed into ``max_absorbed_tokens`` rows (the default, W / 4). The
requests are routed as the device plan routes them (threshold 170, then the capacity), so the
chunks carry the MHA share only. ``absorbed_rows`` counts the packed rows the step folds.

DeepSeek-V3 dims (``MLAConfig.from_name("deepseek-v3")``: N = 128 heads, L = 512, R = 64,
P = V = 128), 16-bit tile configs. No GPU is involved: these are launch sizes, not times.

    python -m benchmarks.device_path_work --json benchmarks/results/device_path_work.json \
        --plot benchmarks/results/device_path_work.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

import torch

from benchmarks._lib import plot as plotting
from benchmarks._lib.batches import V3
from benchmarks._lib.report import write_json_atomic
from benchmarks._lib.trace import DEFAULT_TRACE, load_trace, repo_path, simulate
from mla_ops.planning.device_schedule import device_plan_tensors
from mla_ops.planning.options import PlanOptions
from mla_ops.planning.routing import DEFAULT_ABSORB_MAX_QUERY_LEN, route_context
from mla_ops.triton import absorbed, attention, gather, rows_gemm

H200_SMS = 132
HEADS, LATENT, NOPE, ROPE, VALUE = V3
WORKSPACE = 65536
MAX_CHUNKS = (1, 4, 16)
MODULES = {"gather": gather, "up_projection": rows_gemm, "attention": attention}
CHUNK_OPS = tuple(MODULES)
ABSORBED_MODULES = {"absorbed_fold": rows_gemm, "absorbed_attention": absorbed, "absorbed_unfold": rows_gemm}
ABSORBED_OPS = tuple(ABSORBED_MODULES)
OPS = CHUNK_OPS + ABSORBED_OPS
CAPACITY = PlanOptions(workspace_size=WORKSPACE, max_chunks=1).absorbed_capacity


def chunk_launches(query_lens: list[int], cu_seq_lens: list[int], sms: int) -> dict[str, tuple[int, int]]:
    """(grid size, tiles walked) of each op for one chunk iteration with these device rows on ``sms`` SMs."""
    width, num_out = LATENT + ROPE, HEADS * (NOPE + VALUE)
    up_m, up_n = rows_gemm.GPU_CONFIG_16BIT[:2]
    attn_m = attention.CUDA_CONFIG_16BIT[0]
    num_requests, num_tokens, rows = len(query_lens), sum(query_lens), cu_seq_lens[-1]
    query_start_loc = [0]
    for n in query_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    live = [i for i in range(num_requests) if cu_seq_lens[i + 1] > cu_seq_lens[i]]
    attn_tiles = 0
    if live:  # the kernel's run first .. last of requests with rows
        first, last = live[0], live[-1]
        slot_lo = query_start_loc[first] // attn_m + first
        slot_hi = query_start_loc[last + 1] // attn_m + last + 1
        attn_tiles = (slot_hi - slot_lo) * HEADS
    return {
        "gather": (gather.grid(WORKSPACE, width, gather.PROGRAMS_PER_SM * sms)[0], gather.tiles(rows, width)),
        "up_projection": (
            rows_gemm.grid(WORKSPACE, num_out, up_m, up_n, rows_gemm.PROGRAMS_PER_SM * sms)[0],
            rows_gemm.tiles(rows, num_out, up_m, up_n),
        ),
        "attention": (
            attention.grid(num_tokens, num_requests, HEADS, attn_m, attention.PROGRAMS_PER_SM * sms)[0], attn_tiles
        ),
    }


def absorbed_launches(query_lens: list[int], absorbed_lens: list[int], sms: int) -> dict[str, tuple[int, int]]:
    """(grid size, tiles walked) of the absorbed path's three launches for one step on ``sms`` SMs."""
    rows = sum(q for q, a in zip(query_lens, absorbed_lens) if a)  # the packed routed tokens
    gemm_m, gemm_n = rows_gemm.GPU_CONFIG_16BIT[:2]
    block_m, block_h, _, block_dv, _, _ = absorbed.tile_shape(torch.bfloat16, False, HEADS, LATENT)
    num_requests = len(query_lens)
    gemm_programs = rows_gemm.PROGRAMS_PER_SM * sms
    attn_items = absorbed.work_items(CAPACITY, num_requests, HEADS, LATENT, block_m, block_h, block_dv)
    return {
        "absorbed_fold": (rows_gemm.grid(CAPACITY, LATENT, gemm_m, gemm_n, gemm_programs, HEADS)[0],
                          rows_gemm.tiles(rows, LATENT, gemm_m, gemm_n, HEADS)),
        "absorbed_attention": (  # the kernel walks nothing without packed rows
            min(attn_items, absorbed.PROGRAMS_PER_SM * sms),
            absorbed.work_items(rows, num_requests, HEADS, LATENT, block_m, block_h, block_dv) if rows else 0,
        ),
        "absorbed_unfold": (rows_gemm.grid(CAPACITY, VALUE, gemm_m, gemm_n, gemm_programs, HEADS)[0],
                            rows_gemm.tiles(rows, VALUE, gemm_m, gemm_n, HEADS)),
    }


def add(work: dict, launches: dict, ops) -> None:
    for op in ops:
        programs, tiles = launches[op]
        work[op]["programs"] += programs
        work[op]["idle_programs"] += max(0, programs - tiles)  # their stride loop never runs
        work[op]["tiles"] += tiles


def step_work(context_lens: list[int], query_lens: list[int], max_chunks: int) -> dict:
    """Programs and tiles per op over the K iterations of one step."""
    mha_lens, absorbed_lens = route_context(context_lens, query_lens, DEFAULT_ABSORB_MAX_QUERY_LEN, CAPACITY)
    _, _, cu_seq_lens, num_chunks = device_plan_tensors(
        torch.tensor(mha_lens, dtype=torch.int32), WORKSPACE, max_chunks
    )
    work = {op: {"programs": 0, "idle_programs": 0, "tiles": 0} for op in OPS}
    for cu in cu_seq_lens.tolist():
        add(work, chunk_launches(query_lens, cu, H200_SMS), CHUNK_OPS)
    add(work, absorbed_launches(query_lens, absorbed_lens, H200_SMS), ABSORBED_OPS)
    work["live_chunks"] = min(int(num_chunks), max_chunks)
    work["absorbed_rows"] = sum(q for q, a in zip(query_lens, absorbed_lens) if a)
    return work


def totals(steps: list[dict]) -> dict:
    out = {op: {key: sum(s[op][key] for s in steps) for key in steps[0][op]} for op in OPS}
    out["absorbed_rows"] = sum(s["absorbed_rows"] for s in steps)
    out["steps"] = len(steps)
    return out


def all_programs(work: dict, key: str = "programs", ops=OPS) -> int:
    return sum(work[op][key] for op in ops)


def run(trace: str | Path, limit: int | None) -> dict:
    headline = {k: step_work([60000] + [16] * 31, [513] * 32, k) for k in MAX_CHUNKS}
    steps = list(simulate(load_trace(trace, limit)))
    trace_work = {}
    for k in MAX_CHUNKS:
        per_step = [step_work(s.context_lens, s.query_lens, k) for s in steps if any(s.context_lens)]
        trace_work[k] = totals(per_step)

    def ratio(table):
        # Each iteration's grid is fixed at launch (no host read), so the chunk ops' programs grow as K.
        return round(all_programs(table[16], ops=CHUNK_OPS) / all_programs(table[1], ops=CHUNK_OPS), 4)

    return {
        "config": dict(sms=H200_SMS,
                       programs_per_sm={op: m.PROGRAMS_PER_SM for op, m in {**MODULES, **ABSORBED_MODULES}.items()},
                       heads=HEADS, latent=LATENT, rope=ROPE, nope=NOPE, value=VALUE, workspace=WORKSPACE,
                       absorb_max_query_len=DEFAULT_ABSORB_MAX_QUERY_LEN, max_absorbed_tokens=CAPACITY,
                       trace=repo_path(trace), limit=limit),
        "headline": {str(k): v for k, v in headline.items()},
        "headline_programs_k16_over_k1": ratio(headline),
        "headline_absorbed_rows": headline[1]["absorbed_rows"],
        # The absorbed path's bf16 scratch (2 x capacity x N x L) and the chunk loop's up-projected
        # workspace (W x N x (P + V)) share one allocation.
        "absorbed_scratch_bytes": 2 * CAPACITY * HEADS * LATENT * 2,
        "chunk_buffer_bytes": WORKSPACE * HEADS * (NOPE + VALUE) * 2,
        "trace_steps_with_context": trace_work[1]["steps"],
        "trace_totals": {str(k): v for k, v in trace_work.items()},
        "trace_programs_k16_over_k1": ratio(trace_work),
    }


def plot(result: dict, path: str | Path) -> None:
    plt = plotting.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "headline", "headline batch"), (axes[1], "trace_totals", "Mooncake trace")):
        ks = list(result[key])
        for label, field in (("programs", "programs"), ("idle programs", "idle_programs"),
                             ("tiles walked", "tiles")):
            ax.plot(ks, [all_programs(result[key][k], field) for k in ks], marker="o", label=label)
        ax.set_yscale("log")
        ax.set_xlabel("max_chunks K")
        ax.set_title(f"{title}: programs (3 ops x K chunks + 3 absorbed)")
        ax.legend()
    plotting.save(fig, path, dpi=100)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--limit", type=int, default=None, help="first N trace requests only")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    result = run(args.trace, args.limit)
    if args.json:
        write_json_atomic(args.json, result)
    if args.plot:
        plot(result, args.plot)
    print(json.dumps({k: v for k, v in result.items() if "_over_" in k}))
    return result


if __name__ == "__main__":
    main()
