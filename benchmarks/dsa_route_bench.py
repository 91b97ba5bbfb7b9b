"""A DSA sparse request's two routes on a CPU: absorbed sparse attention against top-k-masked MHA.

``run_prefill(topk_indices=)`` for one sparse request (``c`` context rows in the paged cache, ``q`` new tokens, a
random selection of K_I keys per query), once with ``masked_mha_ratio=0`` (every request on the absorbed sparse
path) and once with ``inf`` (every request on masked MHA), interleaved. Per configuration: both times, both
routes' FLOPs by the cost model (``mla_ops.planning.routing``), and the ratio of their FLOP rates, MHA's over the
sparse path's: the ``masked_mha_ratio`` at which the cost model would call the two routes equal there. The
suggested ratio is the geometric mean over the configurations (``routing.MEASURED_MASKED_MHA_RATIO`` holds it);
``picks_faster`` says whether that ratio sends each configuration to its faster route.

Dims: ``dsa_cpu_bench``'s (DeepSeek-V3.2's widths, N = 16 heads, K_I = 256); float32, 2 threads; ``--smoke``: tiny.

    python -m benchmarks.dsa_route_bench --json benchmarks/results/dsa_route_bench.json
"""

from __future__ import annotations

import math

import torch

import mla_ops
from benchmarks import dsa_cpu_bench
from benchmarks._lib import cli
from benchmarks._lib.report import Report
from benchmarks._lib.timing import best_of_interleaved_s
from mla_ops.planning.routing import masked_mha_flops, sparse_flops

CONFIGS = [(0, 512), (0, 1024), (0, 2048), (0, 4096), (2048, 256), (8192, 256)]  # (context, query): c + q > K_I
SMOKE_CONFIGS = [(0, 40), (24, 8)]


def request(context: int, query: int, dims: dict, block_size: int = 64, seed: int = 0):
    """One sparse request's tensors, a plan maker and a top-k selection (K_I random candidates per query)."""
    g = torch.Generator().manual_seed(seed)
    n, latent, nope, rope, value = (dims[k] for k in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                                                      "qk_rope_head_dim", "v_head_dim"))
    topk = dims["index_topk"]
    blocks = -(-(context + query) // block_size)
    q = torch.randn(query, n, nope + rope, generator=g)
    kv_c, k_pe = torch.randn(query, latent, generator=g), torch.randn(query, rope, generator=g)
    kv_cache = torch.randn(blocks, block_size, latent + rope, generator=g)
    weight = torch.randn(n * (nope + value), latent, generator=g) / latent**0.5
    seq = context + query
    scores = torch.rand(query, seq, generator=g)
    scores = scores.masked_fill(torch.arange(seq) > context + torch.arange(query)[:, None], -1.0)
    value_, index = scores.topk(min(topk, seq), dim=1)
    selection = torch.where(value_ >= 0, index, -1).to(torch.int32)
    selection = torch.nn.functional.pad(selection, (0, topk - selection.shape[1]), value=-1)
    table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    lens = (torch.tensor([0, query], dtype=torch.int32), torch.tensor([context], dtype=torch.int32), table)

    def plan(ratio: float):
        return mla_ops.plan_prefill(*lens, block_size=block_size, index_topk=topk, masked_mha_ratio=ratio)

    return (q, kv_c, k_pe, kv_cache, weight, (nope + rope) ** -0.5), plan, selection


@torch.no_grad()
def main(argv=None):
    parser = cli.parser(__doc__)
    cli.add_common_args(parser, reps=3, device="cpu")
    args = cli.parse_args(parser, argv, "dsa_route_bench.json")
    dims, configs = (dsa_cpu_bench.SMOKE_DIMS, SMOKE_CONFIGS) if args.smoke else (dsa_cpu_bench.DIMS, CONFIGS)
    torch.set_num_threads(2)
    report = Report(args.json, dict(benchmark="dsa_route_bench", dims=dims, threads=2, dtype="float32"), args.dry_run)
    widths = tuple(dims[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    for context, query in configs:
        tensors, plan, selection = request(context, query, dims)
        plans = {"sparse": plan(0.0), "masked_mha": plan(math.inf)}
        if not bool(plans["sparse"].sparse.all()):
            raise ValueError(f"c={context}, q={query}: c + q must exceed index_topk for a sparse request")
        outs = {name: mla_ops.run_prefill(*tensors, p, topk_indices=selection) for name, p in plans.items()}
        best = best_of_interleaved_s({name: (lambda p=p: mla_ops.run_prefill(*tensors, p, topk_indices=selection))
                                      for name, p in plans.items()}, args.reps)
        flops = dict(sparse=sparse_flops(query, dims["index_topk"], *widths),
                     masked_mha=masked_mha_flops(context, query, *widths))
        ratio = (flops["masked_mha"] / best["masked_mha"]) / (flops["sparse"] / best["sparse"])
        row = dict(context=context, query=query, sparse_ms=best["sparse"] * 1e3, masked_mha_ms=best["masked_mha"] * 1e3,
                   sparse_flops_per_head=flops["sparse"], masked_mha_flops_per_head=flops["masked_mha"],
                   break_even_ratio=ratio, max_abs_diff=float((outs["sparse"] - outs["masked_mha"]).abs().max()))
        report.add(row)
        print(f"c={context:5d} q={query:5d}: sparse {row['sparse_ms']:8.1f} ms  "
              f"masked MHA {row['masked_mha_ms']:8.1f} ms"
              f"  FLOP-rate ratio {ratio:5.2f}  max |diff| {row['max_abs_diff']:.1e}", flush=True)
    ratios = [r["break_even_ratio"] for r in report.results]
    suggested = math.exp(sum(map(math.log, ratios)) / len(ratios))
    for r in report.results:  # does the suggested ratio send each configuration to its faster route?
        mha = r["masked_mha_flops_per_head"] < suggested * r["sparse_flops_per_head"]
        r["picks_faster"] = mha == (r["masked_mha_ms"] < r["sparse_ms"])
    print(f"suggested masked_mha_ratio: {suggested:.2f}")
    report.finish(suggested_masked_mha_ratio=suggested)


if __name__ == "__main__":
    main()
