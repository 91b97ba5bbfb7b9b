"""Host planner time: mla-ops against vLLM's planner, interleaved in one process.

Every planner gets CPU int32 tensors and builds what its kernels read, and nothing more:

* ``vllm``: ``benchmarks.vllm_planner.build_chunked_context`` (vLLM PR #50613's planner and its
  per-chunk metadata: flat ``starts``, ``seq_lens``, ``cu_seq_lens``, ``cu_seqlens_q`` and
  ``token_to_seq`` tensors and one ``ContextChunk`` of slices per chunk);
* ``vllm_upstream``: the same with vLLM's newer upstream planner, which splits a request's tail
  at ``split_alignment`` multiples (``build_chunked_context(..., planner="upstream")``);
* ``packed`` / ``whole_requests``: ``mla_ops.plan_context_chunks(...).to(device)``, then every
  chunk's ``starts``, ``seq_lens``, ``cu_seq_lens`` and ``query_start_loc`` read;
* ``plan_prefill``: ``mla_ops.plan_prefill`` (packed, no absorbed routing, so that it plans the
  same context), where the library has it.

All use ``split_alignment = block_size = 16``, vLLM's alignment of a split to cache blocks. For
each batch the planners run round-robin, the order rotated every round, and each one's median
time (thread CPU time, see ``time_batches``) is kept; ``ratio`` is a planner's median over vLLM
#50613's (``vllm``) on the same batches, ``ratio_upstream`` over vLLM upstream's
(``vllm_upstream``); the plot shows the latter. Cases: random batches of B requests (contexts 0 or 16..4,096, 1..512 new
tokens, W = 65,536), batches sized to need 1 to 1,000 chunks (64 requests, W = 1,024), the PR's
headline batch, and every prefill step of the Mooncake trace replay (W = 65,536).

    python -m benchmarks.planner_bench --json benchmarks/results/planner_bench.json \
        --plot benchmarks/results/planner_bench.png
"""

from __future__ import annotations

import argparse
import platform
import statistics
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

import mla_ops
from benchmarks._lib import plot as plotting
from benchmarks._lib.report import write_json_atomic
from benchmarks._lib.timing import thread_time_samples
from benchmarks._lib.trace import DEFAULT_TRACE, load_trace, simulate
from benchmarks.vllm_planner import build_chunked_context

BLOCK_SIZE = 16
BATCH_SIZES = (1, 8, 32, 256, 1024, 4096)
CHUNK_TARGETS = (1, 3, 10, 30, 100, 300, 1000)


class Batch:
    """One batch's planner inputs as CPU int32 tensors, built outside the timed region."""

    def __init__(self, context_lens: Sequence[int], query_lens: Sequence[int]):
        self.context_lens = torch.tensor(list(context_lens), dtype=torch.int32)
        self.query_lens = torch.tensor(list(query_lens), dtype=torch.int32)
        self.query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        torch.cumsum(self.query_lens, 0, out=self.query_start_loc[1:])
        blocks = -(-self.context_lens // BLOCK_SIZE)
        width = max(int(blocks.max()) if len(blocks) else 0, 1)
        self.block_table = torch.arange(width, dtype=torch.int32).repeat(len(query_lens), 1)


def planners(workspace_size: int) -> dict[str, Callable[[Batch], int]]:
    """name -> function planning one batch and returning its chunk count."""

    def vllm(b: Batch) -> int:
        meta = build_chunked_context(b.context_lens, b.query_start_loc, workspace_size, BLOCK_SIZE, "cpu")
        return 0 if meta is None else len(meta.chunks)

    def library(policy: str) -> Callable[[Batch], int]:
        def plan(b: Batch) -> int:
            sched = mla_ops.plan_context_chunks(
                b.context_lens, b.query_lens, workspace_size, policy=policy, split_alignment=BLOCK_SIZE
            ).to("cpu", non_blocking=True)
            for c in sched.chunks:  # what the kernels read (already built: no lazy fields)
                c.starts, c.seq_lens, c.cu_seq_lens, c.query_start_loc
            return sched.num_chunks

        return plan

    def vllm_upstream(b: Batch) -> int:
        meta = build_chunked_context(
            b.context_lens, b.query_start_loc, workspace_size, BLOCK_SIZE, "cpu", planner="upstream"
        )
        return 0 if meta is None else len(meta.chunks)

    result = {"vllm": vllm, "vllm_upstream": vllm_upstream, "packed": library("packed"),
              "whole_requests": library("whole_requests")}
    if hasattr(mla_ops, "plan_prefill"):

        def plan_prefill(b: Batch) -> int:
            plan = mla_ops.plan_prefill(
                b.query_start_loc, b.context_lens, b.block_table, block_size=BLOCK_SIZE,
                workspace_size=workspace_size, policy="packed", split_alignment=BLOCK_SIZE,
                absorb_max_query_len=0,  # every context through the chunks, as vLLM plans it
            )
            schedule = getattr(plan, "schedule", None)
            return getattr(schedule, "num_chunks", -1)

        result["plan_prefill"] = plan_prefill
    return result


def time_batches(batches: Sequence[Batch], workspace_size: int, rounds: int) -> dict:
    """Median µs and chunk count per planner over ``rounds`` interleaved samples per batch.

    A sample is the thread's CPU time over enough back-to-back calls to last ~200 µs, divided by
    their number (``timing.thread_time_samples``): on a shared machine, time the thread spends
    descheduled does not count.
    """
    fns = planners(workspace_size)
    names = list(fns)
    samples = {n: [] for n in names}
    chunks = {n: [] for n in names}
    for b in batches:
        batch_samples, counts = thread_time_samples({n: (lambda fn=fns[n]: fn(b)) for n in names}, rounds)
        for n in names:
            samples[n] += batch_samples[n]
            chunks[n].append(counts[n])  # the warm-up call's result: the chunk count
    us = {n: statistics.median(samples[n]) / 1000 for n in names}
    return {
        "us": {n: round(v, 2) for n, v in us.items()},
        "ratio": {n: round(us[n] / us["vllm"], 3) for n in names if n != "vllm"},
        "ratio_upstream": {n: round(us[n] / us["vllm_upstream"], 3) for n in names if n != "vllm_upstream"},
        "chunks": {n: int(np.median(chunks[n])) for n in names},
    }


def random_batch(rng: np.random.Generator, size: int) -> Batch:
    context = np.where(rng.random(size) < 0.2, 0, rng.integers(16, 4097, size))
    return Batch(context.tolist(), rng.integers(1, 513, size).tolist())


def chunk_batch(rng: np.random.Generator, target: int, workspace_size: int, size: int = 64) -> Batch:
    """``size`` requests whose contexts add up to about ``target`` workspaces."""
    mean = target * workspace_size / size
    context = np.maximum(1, (mean * rng.uniform(0.5, 1.5, size)).astype(np.int64))
    context = np.maximum(1, context * (target * workspace_size) // max(int(context.sum()), 1))
    return Batch(context.tolist(), rng.integers(1, 513, size).tolist())


def run(trace: str | Path, *, rounds: int = 15, trace_rounds: int = 5, limit: int | None = None, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    result = {"block_size": BLOCK_SIZE, "planners": list(planners(1024)), "python": platform.python_version(),
              "torch": torch.__version__, "batch_size": [], "chunk_count": []}
    for size in BATCH_SIZES:
        count = max(2, min(16, 4096 // size))  # more batches where each is cheap
        entry = time_batches([random_batch(rng, size) for _ in range(count)], 65536, max(3, rounds * 8 // count))
        result["batch_size"].append({"B": size, "workspace_size": 65536, "batches": count, **entry})
        print(f"B={size:>5}: {entry['us']}  ratio {entry['ratio']}", flush=True)
    for target in CHUNK_TARGETS:
        count = 4 if target <= 100 else 2
        entry = time_batches([chunk_batch(rng, target, 1024) for _ in range(count)], 1024, rounds)
        result["chunk_count"].append({"target_chunks": target, "B": 64, "workspace_size": 1024, **entry})
        print(f"chunks~{target:>4}: {entry['chunks']} {entry['us']}  ratio {entry['ratio']}", flush=True)

    headline = Batch([60000] + [16] * 31, [513] * 32)
    result["headline"] = {"B": 32, "workspace_size": 65536, **time_batches([headline], 65536, rounds * 20)}
    print(f"headline: {result['headline']['us']}  ratio {result['headline']['ratio']}", flush=True)

    steps = [Batch(s.context_lens, s.query_lens) for s in simulate(load_trace(trace, limit))]
    per_step = [time_batches([b], 65536, trace_rounds) for b in steps]
    names = list(per_step[0]["us"])
    result["trace"] = {
        "trace": Path(trace).name,
        "workspace_size": 65536,
        "steps": len(steps),
        "median_B": statistics.median(len(b.query_lens) for b in steps),
        "us_median": {n: round(statistics.median(s["us"][n] for s in per_step), 2) for n in names},
        "ratio_median": {n: round(statistics.median(s["ratio"][n] for s in per_step), 3) for n in names if n != "vllm"},
        "ratio_max": {n: round(max(s["ratio"][n] for s in per_step), 3) for n in names if n != "vllm"},
        "ratio_of_totals": {
            n: round(sum(s["us"][n] for s in per_step) / sum(s["us"]["vllm"] for s in per_step), 3)
            for n in names if n != "vllm"
        },
        "step_ratios": {n: [s["ratio"][n] for s in per_step] for n in names if n != "vllm"},
        "ratio_median_upstream": {
            n: round(statistics.median(s["ratio_upstream"][n] for s in per_step), 3)
            for n in names if n != "vllm_upstream"
        },
        "ratio_max_upstream": {
            n: round(max(s["ratio_upstream"][n] for s in per_step), 3) for n in names if n != "vllm_upstream"
        },
        "step_ratios_upstream": {
            n: [s["ratio_upstream"][n] for s in per_step] for n in names if n != "vllm_upstream"
        },
    }
    t = result["trace"]
    print(f"trace ({t['steps']} steps): median {t['us_median']}  ratio {t['ratio_median']}  "
          f"max {t['ratio_max']}", flush=True)
    return result


def plot(result: dict, path: str | Path) -> None:
    plt = plotting.pyplot()
    ours = [n for n in result["planners"] if n != "vllm_upstream"]  # vllm: #50613 against upstream
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for ax, family, key, label in ((axes[0], "batch_size", "B", "requests B (W = 65,536)"),
                                   (axes[1], "chunk_count", "vllm", "vLLM PR #50613's chunk count (B = 64, W = 1,024)")):
        rows = result[family]
        x = [r[key] if key == "B" else r["chunks"]["vllm"] for r in rows]
        for n in ours:
            ax.plot(x, [r["ratio_upstream"][n] for r in rows], marker="o",
                    label="vLLM PR #50613" if n == "vllm" else n, ls="--" if n == "vllm" else "-")
        ax.axhline(0.5, color="k", ls="--", lw=1, label="goal 0.5")
        ax.axhline(1.0, color="gray", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("time / vLLM upstream planner time")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_title("Median planner time ratio by batch size")
    axes[1].set_title("... by chunk count")
    trace = result["trace"]
    bins = np.linspace(0, 2, 41)  # the last bin also counts the steps past 2
    for n in ours:
        axes[2].hist(np.minimum(trace["step_ratios_upstream"][n], 2), bins=bins, histtype="step", lw=1.5,
                     label=f"{'vLLM PR #50613' if n == 'vllm' else n} (median {trace['ratio_median_upstream'][n]})")
    axes[2].axvline(0.5, color="k", ls="--", lw=1)
    axes[2].set_yscale("log")
    axes[2].set_xlabel("time / vLLM upstream planner time, per step (2: 2 or more)")
    axes[2].set_ylabel("trace steps (log)")
    axes[2].set_title(f"Mooncake replay: {trace['steps']:,} steps, median B = {trace['median_B']:g}")
    axes[2].legend()
    head = result["headline"]
    fig.suptitle(f"Host planner vs vLLM upstream's (tail split; with its per-chunk metadata); headline batch: "
                 f"vLLM upstream {head['us']['vllm_upstream']} µs, PR #50613 {head['us']['vllm']} µs, "
                 f"packed {head['us']['packed']} µs", fontsize=10)
    plotting.save(fig, path, dpi=110)


def write_json(result: dict, path: str | Path) -> None:
    """Indented, except the per-step ratios: ``trace_step_ratios``, last, one line per planner."""
    per_step = ("step_ratios", "step_ratios_upstream")
    trace = {k: v for k, v in result["trace"].items() if k not in per_step}
    write_json_atomic(path, dict(result, trace=trace, trace_step_ratios=result["trace"]["step_ratios"],
                                 trace_step_ratios_upstream=result["trace"]["step_ratios_upstream"]),
                      one_line=("trace_step_ratios", "trace_step_ratios_upstream"))


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="trace .jsonl (Mooncake format)")
    parser.add_argument("--json", required=True, help="where to write the results JSON")
    parser.add_argument("--plot", help="where to write a PNG summary")
    parser.add_argument("--rounds", type=int, default=15, help="timed calls per planner and batch")
    parser.add_argument("--trace-rounds", type=int, default=5, help="timed calls per planner and trace step")
    parser.add_argument("--limit", type=int, help="replay only the first N trace requests")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the planners are host code; keep intra-op threads out of the timing
    result = run(args.trace, rounds=args.rounds, trace_rounds=args.trace_rounds, limit=args.limit)
    write_json(result, args.json)
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
