"""Absorbed (MQA over the latent cache) versus chunked MHA context attention: where is the break-even?

A sweep over query length x context length (B identical requests each, DeepSeek-V2-Lite dims,
bf16): the context partial by the chunked MHA pipeline (gather, up-project, attend; packed
schedule) and by the absorbed op (Triton, and FlashMLA where ``flash_mla`` imports), side by side
in one run, then one batch of mixed query lengths. The suggested ``absorb_max_query_len`` is the
largest query length up to which the absorbed path is faster at every context length of the sweep;
``mla_ops.planning.routing`` takes it as ``MEASURED_ABSORB_MAX_QUERY_LEN`` once measured.

FlashMLA is timed as it is meant to be called: one call per group of requests with the same
query length (its ``s_q``, so no request is padded), each group with its own scheduling metadata
from ``get_mla_metadata()``, filled by the warm-up call and reused by every timed call.

    python -m benchmarks.absorbed_bench --json benchmarks/results/gpu_absorbed.json --plot ...png
    python -m benchmarks.absorbed_bench --long       # more contexts and query lengths
    python -m benchmarks.absorbed_bench --smoke      # tiny sizes on any device
    python -m benchmarks.absorbed_bench --dry-run    # smoke on CPU into a temporary folder, marked dry_run
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from benchmarks._lib import cli
from benchmarks._lib import plot as plotting
from benchmarks._lib.batches import V2_LITE, paged_batch
from benchmarks._lib.pipeline import chunk_tensors, context_pipeline
from benchmarks._lib.report import Report, machine
from benchmarks._lib.timing import median_ms
from mla_ops.planning.routing import cost_model_threshold

DIMS = V2_LITE
HEADS, LATENT, NOPE, ROPE, VALUE = DIMS
BLOCK_SIZE = 64
WORKSPACE = 65536


def sweep(smoke: bool, long: bool):
    """(context lengths, query lengths, requests per batch, mixed query lengths of one extra batch)."""
    if smoke:
        return [64, 256], [1, 8, 32], 2, [1, 8, 8, 32]
    if long:
        return ([1024, 4096, 8192, 32768, 65536], [1, 2, 4, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024], 8,
                [1, 1, 4, 16, 16, 64, 128, 256])
    return [1024, 8192, 32768], [1, 16, 64, 128, 192, 256, 384, 512], 8, [1, 1, 16, 16, 64, 64, 128, 128]


def query_len_groups(query_lens, context_lens) -> list[tuple[int, list[int]]]:
    """``(s_q, requests)`` per distinct query length of the requests with queries and context: one
    FlashMLA call each, nothing padded (the others have no absorbed partial)."""
    groups: dict[int, list[int]] = {}
    for r, (q, c) in enumerate(zip(query_lens, context_lens)):
        if q > 0 and c > 0:
            groups.setdefault(int(q), []).append(r)
    return sorted(groups.items())


@dataclass
class FlashMLAGroup:
    s_q: int
    metadata: object  # flash_mla.FlashMLASchedMeta, filled by the first call, then reused
    tokens: torch.Tensor | None  # the group's token rows in the batch; None: the group is the batch
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor


def flashmla_runner(x, lens: torch.Tensor, query_lens):
    """fn(out, lse): the absorbed partial by FlashMLA, one call per query-length group (module doc)."""
    from mla_ops.ops import flashmla

    device = x["q"].device
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    groups = []
    for s_q, requests in query_len_groups(query_lens, lens.tolist()):
        if len(requests) == len(query_lens):
            groups.append(FlashMLAGroup(s_q, flashmla.new_metadata(), None, x["block_table"], x["query_start_loc"],
                                        lens))
            continue
        index = torch.tensor(requests, device=device)
        tokens = torch.cat([torch.arange(qsl[r], qsl[r + 1]) for r in requests]).to(device)
        group_qsl = torch.arange(len(requests) + 1, dtype=torch.int32, device=device) * s_q
        groups.append(FlashMLAGroup(s_q, flashmla.new_metadata(), tokens, x["block_table"].index_select(0, index),
                                    group_qsl, lens.index_select(0, index)))

    def run(out, lse):
        for g in groups:
            if g.tokens is None:
                q, g_out, g_lse = x["q"], out, lse
            else:  # the group's rows in, its partial out (timed: a host-grouping caller pays these copies)
                q, g_out, g_lse = (t.index_select(d, g.tokens) for t, d in ((x["q"], 0), (out, 0), (lse, 1)))
            flashmla.absorbed_context_attention(q, x["kv_cache"], g.block_table, g.query_start_loc, g.context_lens,
                                                x["kv_b_proj_weight"], NOPE ** -0.5, None, g_out, g_lse,
                                                max_query_len=g.s_q, metadata=g.metadata)
            if g.tokens is not None:
                out.index_copy_(0, g.tokens, g_out)
                lse.index_copy_(1, g.tokens, g_lse)

    return run


def absorbed_runners(device):
    """name -> make(x, lens, query_lens) -> fn(out, lse), for each absorbed implementation available."""
    def op(x, lens, query_lens):
        return lambda out, lse: torch.ops.mla_ops.absorbed_context_attention(
            x["q"], x["kv_cache"], x["block_table"], x["query_start_loc"], lens, x["kv_b_proj_weight"], NOPE ** -0.5,
            None, out, lse)

    runners = {"absorbed_triton" if device.type == "cuda" else "absorbed_torch": op}
    if device.type == "cuda":
        from mla_ops.ops import flashmla

        ok, reason = flashmla.available()
        if ok:
            runners["absorbed_flashmla"] = flashmla_runner
        else:
            print(f"FlashMLA not measured: {reason}", flush=True)
    return runners


def measure(context_lens, query_lens, runners, device, dtype, reps) -> dict:
    x = paged_batch(context_lens, query_lens, DIMS, BLOCK_SIZE, device, dtype)
    lens = x["context_lens"]
    starts, cu = chunk_tensors(context_lens, query_lens, WORKSPACE, "packed", device)
    q = query_lens[0] if len(set(query_lens)) == 1 else None
    row = dict(context_len=context_lens[0], query_len=q, query_lens=list(query_lens), requests=len(context_lens),
               mha_ms=median_ms(lambda: context_pipeline(x, DIMS, starts, cu, WORKSPACE), device, reps))
    out = x["q"].new_empty(sum(query_lens), HEADS, VALUE)
    lse = torch.empty(HEADS, sum(query_lens), device=device)
    for name, make in runners.items():
        fn = make(x, lens, query_lens)
        row[f"{name}_ms"] = median_ms(lambda: fn(out, lse), device, reps)
    return row


def suggested_threshold(rows, query_lens_sweep, absorbed_names) -> int:
    """The largest query length up to which the absorbed path wins at every context length."""
    suggested = 0
    for q in query_lens_sweep:
        rows_q = [r for r in rows if r["query_len"] == q]
        if not rows_q or not all(min(r[n] for n in absorbed_names) < r["mha_ms"] for r in rows_q):
            break
        suggested = q
    return suggested


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_grad_enabled(False)
    context_sweep, query_lens_sweep, batch, mixed = sweep(args.smoke, args.long)
    runners = absorbed_runners(device)
    report = Report(args.json, dict(
        machine(device), dtype=str(dtype), dims=DIMS.header(), workspace_size=WORKSPACE, long=args.long,
        implementations=list(runners), cost_model_threshold=cost_model_threshold(LATENT, NOPE, ROPE, VALUE),
    ), dry_run=args.dry_run)
    configs = [([c] * batch, [q] * batch) for c in context_sweep for q in query_lens_sweep]
    configs.append(([context_sweep[len(context_sweep) // 2]] * len(mixed), mixed))
    for context_lens, query_lens in configs:
        row = measure(context_lens, query_lens, runners, device, dtype, args.reps)
        report.add(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    names = [f"{n}_ms" for n in runners]
    return report.finish(suggested_absorb_max_query_len=suggested_threshold(report.results, query_lens_sweep, names))


def plot(report: dict, path: str) -> None:
    plt = plotting.pyplot()
    swept = [r for r in report["results"] if r["query_len"] is not None]
    contexts = sorted({r["context_len"] for r in swept})
    fig, axes = plt.subplots(1, max(1, len(contexts)), figsize=(5 * max(1, len(contexts)), 4), squeeze=False)
    for ax, c in zip(axes[0], contexts):
        rows = [r for r in swept if r["context_len"] == c]
        qs = [r["query_len"] for r in rows]
        for key in [k for k in rows[0] if k.endswith("_ms")]:
            ax.plot(qs, [r[key] for r in rows], marker="o", label=key[:-3])
        ax.axvline(report["cost_model_threshold"], color="gray", ls="--", label="cost model")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("query tokens per request")
        ax.set_ylabel("context partial, ms")
        ax.set_title(f"{rows[0]['requests']} requests x {c} context tokens")
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['device']}: absorbed vs chunked MHA; suggested absorb_max_query_len = "
                 f"{report.get('suggested_absorb_max_query_len', '(run incomplete)')}")
    plotting.save(fig, path, dpi=120)


def main(argv=None) -> None:
    parser = cli.parser(__doc__)
    cli.add_common_args(parser)
    args = cli.parse_args(parser, argv, "gpu_absorbed.json")
    report = run(args)
    print("suggested absorb_max_query_len:", report["suggested_absorb_max_query_len"],
          "(cost model:", report["cost_model_threshold"], ")")
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
