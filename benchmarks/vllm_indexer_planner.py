"""How many indexer chunks, and how large a workspace, does vLLM's DSA indexer planner need on the
steps of a real trace, against the library's plan (``plan_prefill(..., index_topk=2048).index_schedule``)?

The steps are the Mooncake conversation trace through the scheduler model of ``benchmarks/_lib/trace.py``
(``load_trace`` + ``simulate``: 8,192 tokens a step, up to 256 running requests). Every step is planned
both ways at each scores budget (the float32 logits one indexer chunk may hold) and counted, not timed:
chunks, the peak key rows a chunk gathers (its key buffer) and the peak logits bytes of a chunk
(query tokens x key rows x 4, the tile a scores kernel writes).

**vLLM** (``split_indexer_prefill_chunks`` below): every prefill of the batch is scored, its keys the
whole sequence ``c + q``; requests are packed in order while the chunk's rows N stay within the
workspace and its logits M x N x 4 within ``max_logits_bytes``; a request that alone breaks the logits
budget is split along its queries. vLLM's defaults: ``workspace_size = 40 * max_model_len`` rows
(``get_max_prefill_buffer_size``; 6,553,600 at DeepSeek-V3.2's max_model_len of 163,840) and
``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB = 512`` (256 on sm_12x, 64 on integrated GPUs). Requests with one
new token are vLLM's decodes (``decode_threshold = 1`` without speculation) and not in its prefill
chunks.

**The library** (the host plan): only requests with ``c + q > index_topk`` (the sparse ones) are scored, the
others take the dense paths; their sequences are cut into row chunks of W rows (``workspace_size``, shared
with the dense chunk loop), and each row chunk into pieces by vLLM's rule applied to its requests' rows:
requests packed while (their query tokens x their rows) stays within the budget, a request that alone
breaks it split along its queries into pieces of ``budget // its rows`` tokens (causally: queries that see
none of a chunk's rows are skipped). The logits budget is the same byte count as vLLM's, as float32
entries (``index_scores_budget = MiB * 2**20 / 4``).

Key-buffer bytes use vLLM's fp8 index row, 128 fp8 bytes + a 4-byte scale = 132 bytes.

    python -m benchmarks.vllm_indexer_planner \
        --json benchmarks/results/vllm_indexer_planner.json --plot benchmarks/results/vllm_indexer_planner.png
"""

from __future__ import annotations

import argparse
import time
from typing import Sequence

import numpy as np
import torch

import mla_ops
from benchmarks._lib import plot as plotting
from benchmarks._lib.report import write_json_atomic
from benchmarks._lib.trace import DEFAULT_TRACE, load_trace, repo_path, simulate

VLLM_SOURCE = ("split_indexer_prefill_chunks and its caller DeepseekV32IndexerMetadataBuilder.build in "
               "vllm/v1/attention/backends/mla/indexer.py, read at MatthewBonanni/vllm@"
               "e32eae27652a3b9977ab66fc8b80778c08e4c54f (a vLLM maintainer's fork; the search index's "
               "vllm-project/vllm copy, 07492607, predates the function)")
MAX_MODEL_LEN = 163840  # DeepSeek-V3.2's max_position_embeddings
VLLM_WORKSPACE = 40 * MAX_MODEL_LEN  # vLLM's get_max_prefill_buffer_size
VLLM_LOGITS_MIB = (512, 256, 64)  # VLLM_SPARSE_INDEXER_MAX_LOGITS_MB: default, sm_12x, integrated GPUs
INDEX_TOPK = 2048
INDEX_ROW_BYTES = 132  # vLLM's fp8 index key row: 128 fp8 bytes and a float32 scale
MIB = 1 << 20


def split_indexer_prefill_chunks(
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    workspace_size: int,
    max_logits_bytes: int,
    request_offset: int = 0,
) -> list[tuple[slice, slice]]:
    """vLLM's indexer prefill chunks, re-expressed (source: ``VLLM_SOURCE``): ``(request slice, query
    slice)`` pairs, the query slice relative to the chunk's first query token.

    * A chunk packs requests in order while its rows N (the sum of their sequence lengths) stay
      within ``workspace_size`` and M x N (M: their query tokens) within ``max_logits_bytes // 4``.
    * A request that fits neither alone is taken alone anyway.
    * The chunk is then split along its queries into pieces of ``max(1, (max_logits_bytes // 4) // N)``
      tokens (only a lone request can need more than one); a chunk without rows is one piece.
    """
    chunks: list[tuple[slice, slice]] = []
    n = len(seq_lens)
    max_logits_elems = max_logits_bytes // 4
    end = 0
    while end < n:
        start, chunk_m, chunk_n = end, 0, 0
        while end < n:
            new_m, new_n = chunk_m + query_lens[end], chunk_n + seq_lens[end]
            if new_n <= workspace_size and new_m * new_n <= max_logits_elems:
                chunk_m, chunk_n = new_m, new_n
                end += 1
            else:
                break
        if end == start:  # one request alone breaks a budget: it is its own chunk, split below
            chunk_m, chunk_n = query_lens[end], seq_lens[end]
            end += 1
        req_slice = slice(start + request_offset, end + request_offset)
        max_q = max(1, max_logits_elems // chunk_n) if chunk_n > 0 else max(1, chunk_m)
        for q_off in range(0, chunk_m, max_q):
            chunks.append((req_slice, slice(q_off, q_off + min(max_q, chunk_m - q_off))))
    return chunks


def vllm_chunks(context_lens: Sequence[int], query_lens: Sequence[int], workspace_size: int,
                logits_bytes: int) -> list[tuple[int, int]]:
    """(key rows, query tokens) of each of vLLM's indexer chunks for one step: its prefills (more than
    one new token) with their whole sequences as keys."""
    prefills = [(c + q, q) for c, q in zip(context_lens, query_lens) if q > 1]
    seq = [s for s, _ in prefills]
    specs = split_indexer_prefill_chunks(seq, [q for _, q in prefills], workspace_size, logits_bytes)
    return [(sum(seq[r]), s.stop - s.start) for r, s in specs]


def step_tensors(context_lens: Sequence[int], query_lens: Sequence[int], block_size: int):
    """``plan_prefill``'s inputs for one step: query_start_loc, context_lens and a block table that
    gives every request the blocks it needs (ids are irrelevant to the plan's chunks)."""
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    width = max(1, -(-max(context_lens, default=0) // block_size))
    return qsl, ctx, torch.arange(width, dtype=torch.int32).expand(len(query_lens), width)


def our_chunks(context_lens: Sequence[int], query_lens: Sequence[int], workspace_size: int, scores_budget: int,
               block_size: int = 64) -> list[tuple[int, int]]:
    """(key rows, query tokens) of each index chunk of the library's host plan for one step."""
    qsl, ctx, block_table = step_tensors(context_lens, query_lens, block_size)
    plan = mla_ops.plan_prefill(qsl, ctx, block_table, block_size=block_size, workspace_size=workspace_size,
                                index_topk=INDEX_TOPK, index_scores_budget=scores_budget)
    s = plan.index_schedule
    return list(zip(s.cu_seq_lens[:, -1].tolist(), (s.token_end - s.token_start).tolist()))


def summarize(per_step: list[list[tuple[int, int]]]) -> dict:
    """Chunk counts and peak workspace over the steps' chunks (each a (rows, tokens) pair)."""
    counts = np.array([len(chunks) for chunks in per_step])
    flat = [c for chunks in per_step for c in chunks]
    rows = np.array([r for r, _ in flat], dtype=np.int64)
    tiles = np.array([r * t for r, t in flat], dtype=np.int64)
    peak_rows = int(rows.max(initial=0))
    peak_tile = int(tiles.max(initial=0))
    return dict(total_chunks=int(counts.sum()), steps_with_chunks=int((counts > 0).sum()),
                steps_needing_multiple_chunks=int((counts > 1).sum()), max_chunks_in_a_step=int(counts.max(initial=0)),
                peak_key_rows=peak_rows, peak_key_buffer_mib=round(peak_rows * INDEX_ROW_BYTES / MIB, 2),
                peak_logits_mib=round(peak_tile * 4 / MIB, 2),
                mean_key_rows_per_chunk=round(float(rows.mean()), 1) if rows.size else 0.0,
                total_logits_gib=round(float(tiles.sum()) * 4 / 2**30, 2))


def chunk_histogram(per_step: list[list], edges: Sequence[int]) -> list[int]:
    return np.histogram([len(chunks) for chunks in per_step], bins=list(edges))[0].tolist()


def compare(steps, logits_mib: Sequence[int], workspace_sizes: Sequence[int], *, vllm_workspace: int = VLLM_WORKSPACE,
            block_size: int = 64) -> dict:
    """Every step planned by vLLM at each logits budget and by the library at each (W, budget)."""
    edges = [0, 1, 2, 3, 5, 9, 17, 33, 65, 1 << 30]
    requests = [(c, q) for s in steps for c, q in zip(s.context_lens, s.query_lens)]
    seq = np.array([c + q for c, q in requests])
    tokens = np.array([q for _, q in requests])
    dense = seq <= INDEX_TOPK
    configs = []
    for mib in logits_mib:
        start = time.perf_counter()
        per_step = [vllm_chunks(s.context_lens, s.query_lens, vllm_workspace, mib * MIB) for s in steps]
        configs.append(dict(planner="vllm", workspace_size=vllm_workspace, logits_mib=mib,
                            **summarize(per_step), chunks_per_step_histogram=chunk_histogram(per_step, edges),
                            wall_s=round(time.perf_counter() - start, 2)))
        for w in workspace_sizes:
            if mib * MIB // 4 < w:
                continue  # PlanOptions: the budget holds one token's scores over W rows
            start = time.perf_counter()
            per_step = [our_chunks(s.context_lens, s.query_lens, w, mib * MIB // 4, block_size) for s in steps]
            configs.append(dict(planner="mla_ops", workspace_size=w, logits_mib=mib, tokens_per_chunk=mib * MIB // 4 // w,
                                **summarize(per_step), chunks_per_step_histogram=chunk_histogram(per_step, edges),
                                wall_s=round(time.perf_counter() - start, 2)))
    return {
        "num_prefill_steps": len(steps),
        "num_prefill_requests": len(requests),
        "requests": dict(
            dense_routed=int(dense.sum()), dense_routed_share=round(float(dense.mean()), 4) if requests else 0.0,
            dense_routed_token_share=round(float(tokens[dense].sum() / tokens.sum()), 4) if requests else 0.0,
            vllm_decodes=int((tokens <= 1).sum()),
            max_sequence=int(seq.max(initial=0)),
        ),
        "histogram_edges": edges[:-1],
        "configs": configs,
    }


def _label(config: dict) -> str:
    return "vLLM" if config["planner"] == "vllm" else f"mla_ops, W = {config['workspace_size']:,}"


def plot(result: dict, path: str) -> None:
    """Total chunks, peak key buffer and peak logits per budget and planner; chunks per step at the first budget."""
    plt = plotting.pyplot()
    configs = result["configs"]
    budgets = list(dict.fromkeys(c["logits_mib"] for c in configs))
    planners = list(dict.fromkeys(_label(c) for c in configs))
    colors = dict(zip(planners, ["tab:blue", "tab:green", "yellowgreen", "darkolivegreen", "tab:olive"]))
    fig, axes = plt.subplots(1, 4, figsize=(22, 5.2))
    width = 0.8 / len(planners)
    for ax, key, title in ((axes[0], "total_chunks", "indexer chunks over the replay"),
                           (axes[1], "peak_key_buffer_mib", "peak key buffer of a chunk (MiB, 132 B a row)"),
                           (axes[2], "peak_logits_mib", "peak logits of a chunk (MiB, float32)")):
        for i, name in enumerate(planners):
            at = [(budgets.index(c["logits_mib"]), c[key]) for c in configs if _label(c) == name]
            bars = ax.bar([b + (i - (len(planners) - 1) / 2) * width for b, _ in at], [v for _, v in at], width,
                          color=colors[name], label=name)
            ax.bar_label(bars, labels=[f"{v:,.0f}" if v >= 10 else f"{v:,.2f}" for _, v in at], fontsize=7)
        ax.set_xticks(range(len(budgets)), [f"{b} MiB logits budget" for b in budgets], fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    ax = axes[3]
    edges = result["histogram_edges"]
    names = [str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}" for lo, hi in zip(edges[:-1], edges[1:])]
    names.append(f">={edges[-1]}")
    shown = [c for c in configs if c["logits_mib"] == budgets[0]]
    width = 0.8 / len(shown)
    for i, c in enumerate(shown):
        ax.bar(np.arange(len(names)) + (i - (len(shown) - 1) / 2) * width, c["chunks_per_step_histogram"], width,
               color=colors[_label(c)], label=_label(c))
    ax.set_xticks(np.arange(len(names)), names, fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("indexer chunks in a step")
    ax.set_ylabel("prefill steps (log)")
    ax.set_title(f"chunks per step, {budgets[0]} MiB logits budget", fontsize=10)
    ax.legend(fontsize=8)
    r = result["requests"]
    fig.suptitle(f"{result['num_prefill_steps']:,} Mooncake prefill steps, {result['num_prefill_requests']:,} prefills; "
                 f"vLLM scores every prefill (workspace {result['vllm_workspace']:,} rows), mla_ops only c + q > "
                 f"{INDEX_TOPK} ({r['dense_routed_share']:.0%} of prefills are dense-routed); counted, not timed",
                 fontsize=10)
    plotting.save(fig, path, dpi=110)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="trace .jsonl (Mooncake format)")
    parser.add_argument("--json", required=True, help="where to write the results JSON")
    parser.add_argument("--plot", help="where to write a PNG")
    parser.add_argument("--logits-mib", default=",".join(map(str, VLLM_LOGITS_MIB)),
                        help="logits budgets per chunk (MiB), comma-separated")
    parser.add_argument("--workspace-sizes", default="65536,16384", help="the library's W (rows), comma-separated")
    parser.add_argument("--vllm-workspace", type=int, default=VLLM_WORKSPACE,
                        help="vLLM's indexer workspace (rows): 40 * max_model_len")
    parser.add_argument("--token-budget", type=int, default=8192, help="the scheduler's tokens per step")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    steps = list(simulate(load_trace(args.trace, args.limit), token_budget=args.token_budget))
    result = {"benchmark": "vllm_indexer_planner", "kind": "counted from the plans; nothing timed",
              "trace": repo_path(args.trace), "vllm_source": VLLM_SOURCE, "index_topk": INDEX_TOPK,
              "vllm_workspace": args.vllm_workspace, "token_budget": args.token_budget,
              "index_row_bytes": INDEX_ROW_BYTES}
    result.update(compare(steps, _ints(args.logits_mib), _ints(args.workspace_sizes),
                          vllm_workspace=args.vllm_workspace))
    result["wall_s"] = round(time.perf_counter() - start, 1)
    write_json_atomic(args.json, result, one_line=("configs",))
    if args.plot:
        plot(result, args.plot)

    r = result["requests"]
    print(f"{result['num_prefill_steps']:,} prefill steps, {result['num_prefill_requests']:,} prefills, "
          f"{r['dense_routed_share']:.1%} with c + q <= {INDEX_TOPK} ({r['dense_routed_token_share']:.1%} of tokens)")
    print(f"{'planner':>8} {'W':>9} {'MiB':>4} {'chunks':>8} {'multi':>6} {'max':>4} {'peak rows':>10} "
          f"{'keys MiB':>9} {'logits MiB':>11}")
    for c in result["configs"]:
        print(f"{c['planner']:>8} {c['workspace_size']:>9,} {c['logits_mib']:>4} {c['total_chunks']:>8,} "
              f"{c['steps_needing_multiple_chunks']:>6,} {c['max_chunks_in_a_step']:>4} {c['peak_key_rows']:>10,} "
              f"{c['peak_key_buffer_mib']:>9,.1f} {c['peak_logits_mib']:>11,.1f}")
    return result


if __name__ == "__main__":
    main()
