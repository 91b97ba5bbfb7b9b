"""Per-rank memory and collective bytes of DeepSeek-V3 under context parallel (DESIGN §10), at D ranks.

Three figures per D (default 1, 2, 4, 8), none of them measured on GPUs (no multi-GPU machine):

* **parameters** per rank, from the model's shapes (``mla_configs["deepseek-v3"]``: 61 layers, hidden
  7168, 128 heads, q_lora 1536, kv_lora 512, P=128, R=64, V=128, 3 dense layers of intermediate
  18432, then 256 routed experts + 1 shared of intermediate 2048, vocab 129280) under the tensor
  parallel sharding of §10 "End to end": each rank keeps N/D heads' ``q_b_proj`` rows,
  ``kv_b_proj`` rows and ``o_proj`` columns, the dense MLP's and every expert's (shared and routed)
  gate/up rows and down columns (1/D of the intermediate size); ``embed_tokens``, the norms,
  ``q_a_proj``, ``kv_a_proj_with_mqa``, the router (``mlp.gate``) and ``lm_head`` whole. Two weight
  formats: ``bf16`` (every tensor 2 bytes), and ``fp8`` as DeepSeek releases V3 (the decoder's linear
  weights float8_e4m3fn, 1 byte, plus float32 128x128 block scales ``[ceil(rows/128),
  ceil(cols/128)]`` of the rank's shard; embeddings, lm_head, norms and router bf16). The router's
  ``e_score_correction_bias`` is float32 in both.
* **latent cache** per rank for one request of C cached tokens (default 128k and 1M): the rank
  holding the most rows under the interleave rule (token p on rank ``(p // I) % D``), rounded up to
  whole blocks, times 576-wide rows (L+R) x 61 layers, bf16 (2 bytes) or fp8 (1 byte).
* **collective bytes** each rank receives per step (all 61 layers), for a few batches:
  - attention (context parallel), from the plans ``mla_ops.plan_prefill(..., context_parallel=...)``
    builds (rank 0's host plan, in a ``fake`` process group of D ranks: planning reads only the
    group's size and rank): the all-gathered parts, ``(D-1) * sum(chunk_part_rows) * (L+R) * b``
    (b = 2 for a bf16 cache; 1 for an fp8 cache, whose rows travel as fp8), plus, for requests the
    absorbed-queries path takes, ``(D-1) * A * N/D * ((L+R) * 2 + (L+1) * 4)`` (their bf16 folded
    queries, then float32 latent partials and LSEs). Two routings: ``all_gather`` (every request,
    ``absorb_max_query_len=0``) and ``routed`` (the cost model's choice, ``None``). The bf16 numbers
    are checked against ``benchmarks.context_parallel_cost.planned_bytes``.
  - tensor parallel all-reduces: one after ``o_proj`` and one after each MLP / MoE, each of the
    step's T tokens x hidden 7168 in bf16; a ring all-reduce sends (and receives) ``2 (D-1)/D`` of
    the buffer per rank, so per step ``61 x 2 x 2 (D-1)/D x T x 7168 x 2`` bytes.

Batches: ``headline`` (vLLM PR #50613's: 32 requests, contexts 60,000 + 31 x 16, 513 new tokens
each), two prefill steps of the Mooncake replay (``benchmarks/_lib/trace.py``): the one with the
most context tokens and the median one, and ``continuations`` (4 requests of 131,072 cached tokens,
16 new tokens each), which the cost model sends the absorbed-queries way.

    python -m benchmarks.cp_memory --json benchmarks/results/cp_memory.json --plot benchmarks/results/cp_memory.png
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

import mla_ops
from benchmarks._lib import plot as plotting
from benchmarks._lib.report import write_json_atomic
from benchmarks._lib.trace import DEFAULT_TRACE, load_trace, simulate
from benchmarks.context_parallel_cost import planned_bytes
from mla_ops import parallel
from mla_ops.models.config import mla_configs
from mla_ops.parallel.layout import local_context_lens

GiB = 2**30
BLOCK = 128  # DeepSeek's fp8 weight blocks
ROUTINGS = {"all_gather": 0, "routed": None}  # absorb_max_query_len


@dataclass(frozen=True)
class Tensor:
    """One parameter: its full shape, the axis tensor parallel splits (None: whole on every rank),
    whether DeepSeek's release stores it in fp8 with block scales, and its bytes otherwise."""

    name: str
    shape: tuple[int, ...]
    split: int | None = None
    fp8: bool = False
    count: int = 1  # identical tensors (the routed experts)
    other_bytes: int = 2  # bf16 (float32 for the router's bias)

    def shard(self, world: int) -> tuple[int, ...]:
        if self.split is None:
            return self.shape
        if self.shape[self.split] % world:
            raise ValueError(f"{self.name}: {self.shape[self.split]} does not split over {world} ranks")
        return tuple(n // world if i == self.split else n for i, n in enumerate(self.shape))

    def bytes(self, world: int, weights: str) -> int:
        shape = self.shard(world)
        n = math.prod(shape)
        if weights == "fp8" and self.fp8:
            rows, cols = shape
            return self.count * (n + math.ceil(rows / BLOCK) * math.ceil(cols / BLOCK) * 4)
        return self.count * n * self.other_bytes


def parameters(config: dict) -> list[Tensor]:
    """Every parameter of the model (not the Multi-Token-Prediction layer), layer tensors once per layer."""
    c = config
    h, heads, lat, rope = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    qk, kv = c["qk_nope_head_dim"] + rope, c["qk_nope_head_dim"] + c["v_head_dim"]
    layers, dense = c["num_hidden_layers"], c["first_k_dense_replace"]
    experts, inter, moe_inter = c["n_routed_experts"], c["intermediate_size"], c["moe_intermediate_size"]
    shared = moe_inter * c["n_shared_experts"]
    attention = [
        Tensor("input_layernorm", (h,)), Tensor("post_attention_layernorm", (h,)),
        Tensor("q_a_proj", (c["q_lora_rank"], h), fp8=True), Tensor("q_a_layernorm", (c["q_lora_rank"],)),
        Tensor("q_b_proj", (heads * qk, c["q_lora_rank"]), 0, fp8=True),
        Tensor("kv_a_proj_with_mqa", (lat + rope, h), fp8=True), Tensor("kv_a_layernorm", (lat,)),
        Tensor("kv_b_proj", (heads * kv, lat), 0, fp8=True),
        Tensor("o_proj", (h, heads * c["v_head_dim"]), 1, fp8=True),
    ]
    mlp = lambda prefix, inter_size, count=1: [  # noqa: E731
        Tensor(f"{prefix}.gate_proj", (inter_size, h), 0, True, count),
        Tensor(f"{prefix}.up_proj", (inter_size, h), 0, True, count),
        Tensor(f"{prefix}.down_proj", (h, inter_size), 1, True, count)]
    moe = [Tensor("mlp.gate", (experts, h)), Tensor("mlp.gate.e_score_correction_bias", (experts,), other_bytes=4),
           *mlp("mlp.shared_experts", shared), *mlp("mlp.experts", moe_inter, experts)]
    out = [Tensor("embed_tokens", (c["vocab_size"], h)), Tensor("norm", (h,)), Tensor("lm_head", (c["vocab_size"], h))]
    for layer in range(layers):
        body = attention + (mlp("mlp", inter) if layer < dense else moe)
        out += [Tensor(f"layers.{layer}.{t.name}", t.shape, t.split, t.fp8, t.count, t.other_bytes) for t in body]
    return out


def parameter_bytes(tensors: list[Tensor], world: int) -> dict:
    """Per rank: the parameter count and bytes in each weight format."""
    return {"parameters": sum(t.count * math.prod(t.shard(world)) for t in tensors),
            "bf16_bytes": sum(t.bytes(world, "bf16") for t in tensors),
            "fp8_bytes": sum(t.bytes(world, "fp8") for t in tensors)}


def cache_bytes(tokens: int, world: int, interleave: int, block_size: int, width: int, layers: int) -> dict:
    """Per rank, one request of ``tokens`` cached: the fullest rank's rows, in whole blocks, every layer."""
    rows = max(int(local_context_lens(np.array([tokens]), r, world, interleave)[0]) for r in range(world))
    blocks = -(-rows // block_size)
    return {"rows": rows, "blocks": blocks,
            "bf16_bytes": blocks * block_size * width * 2 * layers, "fp8_bytes": blocks * block_size * width * layers}


# ---- collective bytes from the plans --------------------------------------------------------------


def fake_group(world: int) -> None:
    """A process group of ``world`` ranks in this process, this one rank 0 (``fake``: no collective
    runs; planning only reads the group's size and rank)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("cp_memory plans in a fake process group of its own: one exists already")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def attention_bytes(context_lens, query_lens, world: int, threshold: int | None, workspace_size: int,
                    block_size: int, model: parallel.CostModel) -> dict:
    """Bytes rank 0 receives in one layer's context-parallel collectives, from ``plan_prefill``'s plan
    (the process group of ``world`` ranks must exist): a bf16 and an fp8 cache."""
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    qsl = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    local = local_context_lens(ctx, 0, world, 1)
    blocks = (local + block_size - 1) // block_size
    table = torch.zeros(len(context_lens), max(int(blocks.max()), 1), dtype=torch.int32)
    first = 0
    for r, n in enumerate(blocks.tolist()):  # the rank's blocks in order (the ids don't change the bytes)
        table[r, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    cp = mla_ops.ContextParallel(cost_model=model)
    plan = mla_ops.plan_prefill(qsl, ctx, table, block_size, workspace_size=workspace_size,
                                absorb_max_query_len=threshold, context_parallel=cp)
    cpp = plan.context_parallel
    part_rows = sum(cpp.chunk_part_rows or ())  # every chunk's parts, D of them all-gathered
    heads, row = model.num_heads // world, model.latent + model.rope
    absorbed = (world - 1) * cpp.num_absorbed_tokens * heads * (row * model.activation_bytes
                                                                 + (model.latent + 1) * model.partial_bytes)
    gathered = {b: (world - 1) * part_rows * row * n for b, n in (("bf16", model.activation_bytes), ("fp8", 1))}
    return {"chunks": cpp.num_chunks, "part_rows": part_rows, "absorbed_tokens": cpp.num_absorbed_tokens,
            "absorbed_bytes": absorbed, "bf16_cache_bytes": gathered["bf16"] + absorbed,
            "fp8_cache_bytes": gathered["fp8"] + absorbed}


def all_reduce_bytes(tokens: int, world: int, hidden: int, layers: int, dtype_bytes: int = 2) -> int:
    """Ring all-reduces after o_proj and each MLP / MoE: ``layers * 2 * 2 (D-1)/D * T * hidden * bytes``."""
    return round(layers * 2 * 2 * (world - 1) / world * tokens * hidden * dtype_bytes)


def batches(trace: Path, limit: int | None) -> dict:
    steps = list(simulate(load_trace(trace, limit)))
    total = np.array([sum(s.context_lens) for s in steps])
    most, median = int(np.argmax(total)), int(np.argsort(total, kind="stable")[len(total) // 2])
    pick = lambda i: (list(steps[i].context_lens), list(steps[i].query_lens))  # noqa: E731
    return {"headline": ([60000] + [16] * 31, [513] * 32),
            f"trace_most_context (step {most})": pick(most), f"trace_median (step {median})": pick(median),
            "continuations": ([131072] * 4, [16] * 4)}


def collective_bytes(named: dict, worlds: Sequence[int], config: dict, workspace_size: int, block_size: int,
                     model: parallel.CostModel) -> dict:
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    out = {}
    for name, (ctx, q) in named.items():
        entry = {"requests": len(ctx), "context_tokens": int(sum(ctx)), "new_tokens": int(sum(q)), "by_world_size": {}}
        for d in worlds:
            fake_group(d)
            try:
                per_layer = {s: attention_bytes(ctx, q, d, t, workspace_size, block_size, model)
                             for s, t in ROUTINGS.items()}
            finally:
                dist.destroy_process_group()
            for s, t in ROUTINGS.items():  # the library's host planning steps, as context_parallel_cost counts
                check, _ = planned_bytes(np.asarray(ctx), np.asarray(q), d, t, model, workspace_size)
                assert check == per_layer[s]["bf16_cache_bytes"], (name, d, s, check, per_layer[s])
            row = {"all_reduce_bytes": all_reduce_bytes(sum(q), d, hidden, layers)}
            for s in ROUTINGS:
                row[s] = {**per_layer[s], **{f"{k}_per_step": v * layers for k, v in per_layer[s].items()
                                             if k.endswith("cache_bytes")}}
            entry["by_world_size"][str(d)] = row
        out[name] = entry
    return out


# ---- report ---------------------------------------------------------------------------------------


def plot(result: dict, path: str | Path) -> None:
    plt = plotting.pyplot()
    worlds = result["world_sizes"]
    x = np.arange(len(worlds))
    fig, (mem, comm) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.2
    params = [result["parameters"][str(d)] for d in worlds]
    for i, (label, values) in enumerate([
        ("parameters, fp8", [p["fp8_bytes"] for p in params]),
        ("parameters, bf16", [p["bf16_bytes"] for p in params]),
        *[(f"cache {t:,} tokens, fp8", [result["cache"][str(t)][str(d)]["fp8_bytes"] for d in worlds])
          for t in result["cached_tokens"]],
    ]):
        mem.bar(x + (i - 1.5) * width, np.array(values) / GiB, width, label=label)
    mem.axhline(141e9 / GiB, color="k", linestyle=":", linewidth=1)
    mem.text(x[-1] + 0.45, 141e9 / GiB, "one H200: 141 GB", ha="right", va="bottom", fontsize=8)
    mem.set_xticks(x, [f"D = {d}" for d in worlds])
    mem.set_ylabel("GiB per rank")
    mem.set_title("Per-rank memory (DeepSeek-V3, 61 layers)")
    mem.legend(fontsize=8)
    name = next(iter(result["batches"]))
    rows = [result["batches"][name]["by_world_size"][str(d)] for d in worlds]
    series = [("all-reduce (TP)", [r["all_reduce_bytes"] for r in rows]),
              ("CP all-gather, bf16 rows", [r["all_gather"]["bf16_cache_bytes_per_step"] for r in rows]),
              ("CP all-gather, fp8 rows", [r["all_gather"]["fp8_cache_bytes_per_step"] for r in rows]),
              ("CP routed, fp8 rows", [r["routed"]["fp8_cache_bytes_per_step"] for r in rows])]
    for i, (label, values) in enumerate(series):
        comm.bar(x + (i - 1.5) * width, np.array(values) / GiB, width, label=label)
    comm.set_xticks(x, [f"D = {d}" for d in worlds])
    comm.set_ylabel("GiB received per rank, per step (61 layers)")
    comm.set_title(f"Collectives, {name} batch (from the plans)")
    comm.legend(fontsize=8)
    fig.suptitle("Context parallel + tensor parallel: per-rank bytes (from shapes and plans; not measured on GPUs)")
    plotting.save(fig, path, dpi=120)


def print_tables(result: dict) -> None:
    worlds, g = result["world_sizes"], lambda b: f"{b / GiB:,.2f}"  # noqa: E731
    print("Per rank, GiB: parameters (fp8 release / bf16) and latent cache of one request (fp8 / bf16 cache)")
    head = " ".join(f"{f'cache {t // 1024}k fp8/bf16':>22}" for t in result["cached_tokens"])
    print(f"{'D':>3} {'params fp8':>11} {'params bf16':>12} {head}")
    for d in worlds:
        p = result["parameters"][str(d)]
        cache = " ".join(f"{g(c['fp8_bytes']) + ' / ' + g(c['bf16_bytes']):>22}"
                         for c in (result["cache"][str(t)][str(d)] for t in result["cached_tokens"]))
        print(f"{d:>3} {g(p['fp8_bytes']):>11} {g(p['bf16_bytes']):>12} {cache}")
    print("\nBytes each rank receives per step (61 layers), GiB: TP all-reduces; CP attention with every request "
          "all-gathered (bf16 / fp8 cache) and routed by the cost model (bf16 / fp8 cache)")
    for name, entry in result["batches"].items():
        print(f"{name}: {entry['requests']} requests, {entry['context_tokens']:,} context tokens, "
              f"{entry['new_tokens']:,} new tokens")
        print(f"{'D':>3} {'all-reduce':>11} {'all-gather bf16':>16} {'all-gather fp8':>15} {'routed bf16':>12} "
              f"{'routed fp8':>11} {'absorbed tok':>13}")
        for d in worlds:
            r = entry["by_world_size"][str(d)]
            ag, rt = r["all_gather"], r["routed"]
            print(f"{d:>3} {g(r['all_reduce_bytes']):>11} {g(ag['bf16_cache_bytes_per_step']):>16} "
                  f"{g(ag['fp8_cache_bytes_per_step']):>15} {g(rt['bf16_cache_bytes_per_step']):>12} "
                  f"{g(rt['fp8_cache_bytes_per_step']):>11} {rt['absorbed_tokens']:>13,}")


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="where to write the results JSON")
    parser.add_argument("--plot", help="where to write a PNG summary (needs matplotlib)")
    parser.add_argument("--world-sizes", default="1,2,4,8")
    parser.add_argument("--cached-tokens", default="131072,1048576", help="cached tokens of one request")
    parser.add_argument("--workspace-size", type=int, default=65536)
    parser.add_argument("--block-size", type=int, default=64, help="cache rows per block (FlashMLA's 64)")
    parser.add_argument("--interleave", type=int, default=1, help="for the cache figures (plans: 1)")
    parser.add_argument("--trace", help=f"trace .jsonl (Mooncake format); default: {DEFAULT_TRACE.name}")
    parser.add_argument("--limit", type=int, help="replay only the first N requests of the trace")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    config = mla_configs["deepseek-v3"]
    worlds = [int(d) for d in args.world_sizes.split(",")]
    cached = [int(t) for t in args.cached_tokens.split(",")]
    width, layers = config["kv_lora_rank"] + config["qk_rope_head_dim"], config["num_hidden_layers"]
    tensors = parameters(config)
    model = parallel.CostModel()  # DeepSeek-V3 dims, bf16 activations, float32 partials
    result = {
        "model": "deepseek-v3", "world_sizes": worlds, "cached_tokens": cached, "interleave": args.interleave,
        "block_size": args.block_size, "workspace_size": args.workspace_size, "cache_row_width": width,
        "units": "bytes per rank; collectives: bytes each rank receives per step (every layer)",
        "all_reduce_formula": "layers * 2 * 2*(D-1)/D * T * hidden * 2 (bf16), ring all-reduce",
        "measured_on_gpus": False,
        "parameters": {str(d): parameter_bytes(tensors, d) for d in worlds},
        "cache": {str(t): {str(d): cache_bytes(t, d, args.interleave, args.block_size, width, layers) for d in worlds}
                  for t in cached},
        "batches": collective_bytes(batches(Path(args.trace) if args.trace else DEFAULT_TRACE, args.limit), worlds,
                                    config, args.workspace_size, args.block_size, model),
    }
    result["wall_s"] = round(time.perf_counter() - start, 1)
    write_json_atomic(args.json, result)
    if args.plot:
        plot(result, args.plot)
    print_tables(result)
    return result


if __name__ == "__main__":
    main()
