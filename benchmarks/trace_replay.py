"""Replay a real request trace through a simulated prefix-caching, chunked-prefill scheduler and
count the context chunks each step needs under every chunk-schedule policy.

The trace format and the scheduler model are those of ``benchmarks/_lib/trace.py`` (``load_trace``,
``simulate``; the flags below set its parameters). For every step with at least one prefill, the
batch ``(context_lens, query_lens)`` (in the scheduler's order) is planned for each workspace size
with the old vLLM batch-column schedule (``benchmarks.batch_column``), with
``mla_ops.plan_context_chunks`` under ``whole_requests`` (= vLLM PR #50613) and ``packed``, and
with vLLM's newer upstream planner, which splits a request's tail at ``split_alignment`` multiples
(``vllm_upstream``: ``benchmarks.vllm_planner.plan_mla_context_chunks_upstream``, its plan only).
Per-step arrays in the JSON follow ``chunks_by_workspace_order``. A routing sweep costs the
steps at DeepSeek-V2-Lite dims for several ``absorb_max_query_len`` (modeled FLOPs, no timing).
Planner time is ``planner_bench``'s question, not this script's.

    python -m benchmarks.trace_replay \
        --json benchmarks/results/trace_replay.json --plot benchmarks/results/trace_replay.png

replays the Mooncake conversation trace kept in ``benchmarks/traces/``; ``--trace`` takes another.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Sequence

import numpy as np

import mla_ops
from benchmarks._lib import plot as plotting
from benchmarks._lib.batches import V2_LITE
from benchmarks._lib.costs import modeled_flops
from benchmarks._lib.report import write_json_atomic
from benchmarks._lib.trace import DEFAULT_TRACE, Request, load_trace, repo_path, simulate
from benchmarks.batch_column import batch_column_chunks
from benchmarks.vllm_planner import plan_mla_context_chunks_upstream

# vllm_upstream is last so that the first three columns of the per-step arrays keep their order.
POLICIES = ("batch_column", "whole_requests", "packed", "vllm_upstream")
PLANNER_POLICIES = ("whole_requests", "packed")
PLOT_ORDER = ("batch_column", "whole_requests", "vllm_upstream", "packed")  # most chunks to fewest
# DeepSeek-V2-Lite's attention dims for the routing cost model (N, L, P, R, V).
MLA_DIMS = V2_LITE._asdict()


def count_chunks(
    context_lens: np.ndarray, query_lens: np.ndarray, workspace_size: int, split_alignment: int
) -> dict[str, int | None]:
    """Chunks of one batch under each policy; batch_column is None where its formula fails."""
    try:
        counts: dict[str, int | None] = {
            "batch_column": batch_column_chunks(context_lens, workspace_size, split_alignment)
        }
    except ValueError:  # too many requests for one alignment step each
        counts = {"batch_column": None}
    for policy in PLANNER_POLICIES:
        sched = mla_ops.plan_context_chunks(
            context_lens, query_lens, workspace_size, policy=policy, split_alignment=split_alignment
        )
        counts[policy] = sched.num_chunks
    # vLLM's upstream planner as its metadata builder calls it without DCP (row budget W, pieces
    # of at most round_down(W, alignment) rows, identity row cost).
    counts["vllm_upstream"] = len(plan_mla_context_chunks_upstream(
        context_lens.tolist(), workspace_size, workspace_size // split_alignment * split_alignment,
        split_alignment, _same_rows,
    ))
    return counts


def _same_rows(rows: int) -> int:
    return rows


def routing_summary(batches, thresholds: Sequence[int], workspace_size: int) -> list[dict]:
    """For each absorb_max_query_len: the share of context work each path takes, the modeled
    FLOPs against all-MHA, and the packed MHA chunks left (DESIGN §1 cost model)."""
    rows = []
    for threshold in thresholds:
        mha = routed = absorbed_tokens = mha_tokens = chunks = 0
        for context_lens, query_lens in batches:
            f = modeled_flops(context_lens, query_lens, absorb_max_query_len=threshold, **MLA_DIMS)
            mha += f["mha_only"]
            routed += f["routed"]
            absorbed_tokens += f["absorbed_context_tokens"]
            mha_tokens += f["mha_context_tokens"]
            chunks += -(-f["mha_context_tokens"] // workspace_size)
        total = absorbed_tokens + mha_tokens
        rows.append({
            "absorb_max_query_len": threshold,
            "absorbed_context_share": round(absorbed_tokens / total, 4) if total else 0.0,
            "modeled_tflop_mha_only": round(mha / 1e12, 3),
            "modeled_tflop_routed": round(routed / 1e12, 3),
            "flops_saved": round(1 - routed / mha, 4) if mha else 0.0,
            "packed_mha_chunks": chunks,
        })
    return rows


def replay(
    requests: Sequence[Request],
    workspace_sizes: Sequence[int],
    *,
    token_budget: int = 8192,
    max_running: int = 256,
    step_ms: float = 50.0,
    block_size: int = 512,
    split_alignment: int = 1,
    progress: bool = True,
    absorb_thresholds: Sequence[int] = (0, 16, 64, 128, 170, 256, 512),
) -> dict:
    """Simulate the trace and plan every prefill step; return the JSON-ready result (no "trace")."""
    from tqdm import tqdm

    bar = tqdm(total=len(requests), unit="req", desc="replay", disable=not progress, mininterval=1.0)
    steps = []
    start = time.perf_counter()
    for step in simulate(
        requests,
        token_budget=token_budget,
        max_running=max_running,
        step_ms=step_ms,
        block_size=block_size,
        on_finish=lambda r: bar.update(),
    ):
        context_lens = np.asarray(step.context_lens, dtype=np.int32)
        query_lens = np.asarray(step.query_lens, dtype=np.int32)
        by_ws = {w: count_chunks(context_lens, query_lens, w, split_alignment) for w in workspace_sizes}
        steps.append((step, by_ws))
    bar.close()
    wall_s = time.perf_counter() - start

    primary = workspace_sizes[0]
    by_workspace = {}
    for w in workspace_sizes:
        per_step = [by_ws[w] for _, by_ws in steps]
        by_workspace[str(w)] = {
            "totals": {p: sum(c[p] or 0 for c in per_step) for p in POLICIES},
            "steps_needing_multiple_chunks": {
                p: sum(1 for c in per_step if (c[p] or 0) > 1) for p in POLICIES
            },
            "max_chunks_in_a_step": {p: max((c[p] or 0 for c in per_step), default=0) for p in POLICIES},
            "lower_bound_total": sum(-(-sum(s.context_lens) // w) for s, _ in steps),
            "batch_column_infeasible_steps": sum(1 for c in per_step if c["batch_column"] is None),
        }
    return {
        "workspace_size": primary,
        "workspace_sizes": list(workspace_sizes),
        "token_budget": token_budget,
        "max_running": max_running,
        "step_ms": step_ms,
        "block_size": block_size,
        "split_alignment": split_alignment,
        "num_requests": len(requests),
        "num_prefill_steps": len(steps),
        "simulated_s": round((steps[-1][0].t_ms - steps[0][0].t_ms) / 1000.0, 3) if steps else 0.0,
        "replay_wall_s": round(wall_s, 2),
        "totals": by_workspace[str(primary)]["totals"],
        "by_workspace": by_workspace,
        "chunks_by_workspace_order": list(POLICIES),
        "routing": routing_summary(
            [(s.context_lens, s.query_lens) for s, _ in steps], absorb_thresholds, primary
        ),
        "routing_dims": MLA_DIMS,
        "steps": [
            {
                "t_ms": s.t_ms,
                "num_decodes": s.num_decodes,
                "context_lens": s.context_lens,
                "query_lens": s.query_lens,
                "chunks": by_ws[primary],
                "chunks_by_workspace": {str(w): [by_ws[w][p] for p in POLICIES] for w in workspace_sizes},
            }
            for s, by_ws in steps
        ],
    }


def write_json(result: dict, path: str | Path) -> None:
    """Summary fields indented, then one compact line per step (valid JSON, greppable, small)."""
    write_json_atomic(path, result, one_line=("steps",))


def _chunk_bins(max_count: int) -> tuple[list[int], list[str]]:
    """Histogram edges and labels for chunk counts: 0, 1, 2, 3, 4, 5-8, 9-16, 17-32, ..."""
    edges = [0, 1, 2, 3, 4, 5]
    while edges[-1] <= max_count:
        edges.append(2 * edges[-1] - 1)
    labels = [str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}" for lo, hi in zip(edges[:-1], edges[1:])]
    return edges, labels


def plot(result: dict, path: str | Path) -> None:
    """Totals per policy and workspace size, and per-step chunk-count histograms."""
    plt = plotting.pyplot()

    colors = {"batch_column": "tab:red", "whole_requests": "tab:orange", "packed": "tab:green",
              "vllm_upstream": "tab:blue"}
    names = {"batch_column": "batch column (old vLLM)", "whole_requests": "whole_requests (vLLM PR #50613)",
             "packed": "packed", "vllm_upstream": "vLLM upstream (tail split)"}
    sizes = result["workspace_sizes"]
    hist_sizes = list(dict.fromkeys([sizes[0], min(sizes)]))  # primary and smallest
    fig, axes = plt.subplots(1, 1 + len(hist_sizes), figsize=(8 + 6 * len(hist_sizes), 5.5))
    ax_bar = axes[0]
    width = 0.8 / len(POLICIES)

    x = np.arange(len(sizes))
    for i, p in enumerate(PLOT_ORDER):
        totals = [result["by_workspace"][str(w)]["totals"][p] for w in sizes]
        packed = [result["by_workspace"][str(w)]["totals"]["packed"] for w in sizes]
        labels = [f"{t:,}" + (f"\n{t / b:.2f}x" if b and p != "packed" else "") for t, b in zip(totals, packed)]
        bars = ax_bar.bar(x + (i - (len(POLICIES) - 1) / 2) * width, totals, width, label=names[p], color=colors[p])
        ax_bar.bar_label(bars, labels=labels, fontsize=7, padding=2)
    ax_bar.set_xticks(x, [f"W = {w:,} rows" for w in sizes])
    ax_bar.set_yscale("log")
    all_totals = [v for w in sizes for v in result["by_workspace"][str(w)]["totals"].values() if v]
    if all_totals:
        ax_bar.set_ylim(min(all_totals) / 3, max(all_totals) * 3)
    ax_bar.set_ylabel("total context chunks over the replay (log)")
    ax_bar.set_title(
        f"Total chunks (ratio to packed), {result['num_prefill_steps']:,} prefill steps"
    )
    ax_bar.legend(loc="upper left")
    ax_bar.grid(axis="y", alpha=0.3)

    order = result["chunks_by_workspace_order"]
    for ax, w in zip(axes[1:], hist_sizes):
        per_policy = {
            p: np.array([s["chunks_by_workspace"][str(w)][order.index(p)] or 0 for s in result["steps"]])
            for p in POLICIES
        }
        edges, labels = _chunk_bins(max(int(c.max(initial=0)) for c in per_policy.values()))
        hx = np.arange(len(labels))
        for i, p in enumerate(PLOT_ORDER):
            steps_in_bin = np.histogram(per_policy[p], bins=edges)[0]
            ax.bar(hx + (i - (len(POLICIES) - 1) / 2) * width, steps_in_bin, width, label=names[p], color=colors[p])
        ax.set_xticks(hx, labels, rotation=30 if len(labels) > 9 else 0)
        ax.set_yscale("log")
        ax.set_xlabel("context chunks in a step")
        ax.set_ylabel("prefill steps (log)")
        ax.set_title(f"Chunks per step, W = {w:,} rows")
        # The bar chart's legend names the colors for all panels.
        ax.grid(axis="y", alpha=0.3)

    fig.suptitle(
        f"{Path(result.get('trace', '')).name}: {result['num_requests']:,} requests, "
        f"budget {result['token_budget']:,} tokens/step, max {result['max_running']} running, "
        f"split_alignment {result['split_alignment']}",
        fontsize=10,
    )
    plotting.save(fig, path, dpi=110)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="trace .jsonl (Mooncake format)")
    parser.add_argument("--json", required=True, help="where to write the results JSON")
    parser.add_argument("--plot", help="where to write a PNG summary")
    parser.add_argument("--token-budget", type=int, default=8192, help="tokens per step")
    parser.add_argument("--max-running", type=int, default=256, help="max running requests")
    parser.add_argument(
        "--workspace-sizes", default="65536,16384,4096", help="comma-separated; the first is primary"
    )
    parser.add_argument("--block-size", type=int, default=512, help="tokens per trace hash id")
    parser.add_argument("--step-ms", type=float, default=50.0, help="modeled time of one step")
    parser.add_argument("--split-alignment", type=int, default=1)
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)

    workspace_sizes = [int(w) for w in args.workspace_sizes.split(",") if w.strip()]
    if not workspace_sizes:
        parser.error("--workspace-sizes: expected at least one size")
    for name in ("token_budget", "max_running", "block_size", "split_alignment"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive int")

    requests = load_trace(args.trace, args.limit)
    result = {"trace": repo_path(args.trace)}
    result.update(
        replay(
            requests,
            workspace_sizes,
            token_budget=args.token_budget,
            max_running=args.max_running,
            step_ms=args.step_ms,
            block_size=args.block_size,
            split_alignment=args.split_alignment,
            progress=not args.no_progress,
        )
    )
    write_json(result, args.json)
    if args.plot:
        plot(result, args.plot)

    print(f"{result['num_prefill_steps']:,} prefill steps in {result['replay_wall_s']} s")
    print(f"{'workspace':>10} " + " ".join(f"{p:>15}" for p in POLICIES) + f" {'lower bound':>12}")
    for w in workspace_sizes:
        entry = result["by_workspace"][str(w)]
        row = " ".join(f"{entry['totals'][p]:>15,}" for p in POLICIES)
        print(f"{w:>10,} {row} {entry['lower_bound_total']:>12,}")
    print(f"routing (W={workspace_sizes[0]:,}, DeepSeek-V2-Lite dims):")
    for r in result["routing"]:
        print(f"  absorb q <= {r['absorb_max_query_len']:>4}: {r['absorbed_context_share']:6.1%} of context rows "
              f"absorbed, modeled FLOPs {r['flops_saved']:6.1%} lower, {r['packed_mha_chunks']:,} MHA chunks")
    return result


if __name__ == "__main__":
    main()
