"""The model across ranks, measured: a sharded prefill step's time, its collectives and memory per rank.

Run on one node with torchrun (NCCL on GPUs; it has not run there yet):

    torchrun --nproc-per-node 8 -m benchmarks.cp_step --json benchmarks/results/gpu_cp_step.json

``MLAForCausalLM(config, context_parallel=ContextParallel(group, interleave))`` with DeepSeek-V3's
attention dims (128 heads, L=512, P=128, R=64, V=128, hidden 7168, q LoRA 1536) and ``--layers``
dense layers, random bf16 weights, each rank holding its shard (N / D heads, 1/D of the MLP). Per
step of ``--batch`` (the vLLM PR's headline batch: 32 requests, contexts 60,000 + 31 x 16, 513 new
tokens each; or ``continuations``: 4 x 131,072 context, 16 new tokens) each rank writes its context
shard once, then times (CUDA events, median of ``--reps``):

* ``step_ms``: the whole sharded forward (all layers, the plan shared by all);
* ``all_reduce_ms``: one all-reduce of the step's hidden states ([T, hidden], bf16) as the layers
  issue two per layer, and ``all_gather_bf16_ms`` / ``all_gather_fp8_ms``: one all-gather of a
  workspace's latent rows (``--workspace`` x 576) as the chunk loop issues per chunk, in bf16 and as
  fp8 bytes;
* ``peak_gib``: ``torch.cuda.max_memory_allocated`` (weights, cache shard, workspace).

Rank 0 writes the JSON. ``--dry-run``: two gloo processes on CPU at tiny sizes (what the tests run),
the report marked ``dry_run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import mla_ops
from benchmarks._lib.ranks import spawn
from benchmarks._lib.report import write_json_atomic
from mla_ops.parallel.layout import slot_mapping, tokens_per_block

BATCHES = {
    "headline": ([60000] + [16] * 31, [513] * 32),
    "continuations": ([131072] * 4, [16] * 4),
    "dry": ([37, 0, 12], [5, 3, 2]),  # --dry-run
}


def model_config(layers: int, dry_run: bool) -> mla_ops.MLAConfig:
    if dry_run:
        return dataclasses.replace(mla_ops.MLAConfig.from_name("tiny"), num_hidden_layers=layers)
    v3 = mla_ops.MLAConfig.from_name("deepseek-v3")
    return dataclasses.replace(v3, num_hidden_layers=layers, first_k_dense_replace=layers)  # dense layers only


def step_inputs(config, context_lens, query_lens, block_size, rank, world, interleave, device):
    """This rank's block table and the slots of the step's new tokens (written by their owners only)."""
    per_block = tokens_per_block(block_size, world, interleave)
    widths = [-(-(c + q) // per_block) for c, q in zip(context_lens, query_lens)]
    width = max(widths)
    table = torch.arange(len(context_lens) * width, dtype=torch.int32).view(len(context_lens), width)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)])
    request = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    slots = slot_mapping(positions.numpy(), table[request].numpy(), block_size, rank, world, interleave)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.randint(0, config.vocab_size, (positions.shape[0],))
    return dict(input_ids=ids.to(device), positions=positions.to(device),
                slot_mapping=torch.from_numpy(slots).to(device), block_table=table.to(device),
                query_start_loc=qsl, context_lens=torch.tensor(context_lens, dtype=torch.int32),
                num_blocks=len(context_lens) * width)


# torch 2.13 renames all_gather_into_tensor; the GPU machine's 2.11 has only the old name.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def timed(fn, reps: int, device) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU, wall clock elsewhere)."""
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 3)


@torch.no_grad()
def run(args) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cp = mla_ops.ContextParallel(None, interleave=args.interleave)
    config = model_config(args.layers, args.dry_run)
    torch.manual_seed(0)
    model = mla_ops.MLAForCausalLM(config, context_parallel=cp).to(device, dtype).eval()
    context_lens, query_lens = BATCHES["dry" if args.dry_run else args.batch]
    x = step_inputs(config, context_lens, query_lens, args.block_size, rank, world, args.interleave, device)
    caches = model.allocate_kv_caches(x.pop("num_blocks"), args.block_size)
    for cache in caches.tensors:
        torch.nn.init.normal_(cache, std=0.5)  # the context shard, as if written by earlier steps
    plan = mla_ops.plan_prefill(x["query_start_loc"].to(device), x["context_lens"].to(device), x["block_table"],
                                args.block_size, args.workspace, context_parallel=cp)
    step = lambda: model.model(x["input_ids"], x["positions"], caches, x["slot_mapping"], plan)  # noqa: E731
    step()  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens = x["input_ids"].shape[0]
    hidden = torch.randn(tokens, config.hidden_size, device=device, dtype=dtype)
    rows = torch.randn(args.workspace // world, config.kv_lora_rank + config.qk_rope_head_dim, device=device,
                       dtype=dtype)
    fp8_rows = rows.to(torch.float8_e4m3fn).view(torch.uint8)
    row = dict(
        batch="dry" if args.dry_run else args.batch, world_size=world, interleave=args.interleave,
        layers=args.layers, tokens=tokens, device=str(device),
        step_ms=timed(step, args.reps, device),
        all_reduce_ms=timed(lambda: dist.all_reduce(hidden), args.reps, device),
        all_gather_bf16_ms=timed(lambda: all_gather(rows.new_empty(world * rows.shape[0], rows.shape[1]), rows),
                                 args.reps, device),
        all_gather_fp8_ms=timed(lambda: all_gather(fp8_rows.new_empty(world * fp8_rows.shape[0], fp8_rows.shape[1]),
                                                   fp8_rows), args.reps, device),
        peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None,
        parameters_per_rank=sum(p.numel() for p in model.parameters()),
    )
    every = [None] * world
    dist.all_gather_object(every, row)
    if rank != 0:
        return None
    result = dict(benchmark="cp_step", dry_run=args.dry_run, torch=torch.__version__, ranks=every)
    print(every[0], flush=True)
    if args.json:
        write_json_atomic(args.json, result)
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cp_step", description=__doc__.split("\n")[0])
    p.add_argument("--json")
    p.add_argument("--batch", choices=("headline", "continuations"), default="headline")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--interleave", type=int, default=1)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--workspace", type=int, default=65536)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--dry-run", action="store_true", help="two gloo processes on CPU, tiny sizes")
    return p


def main(argv=None) -> dict | None:
    args = parser().parse_args(argv)
    if args.dry_run and "RANK" not in os.environ:  # launch the two processes ourselves
        given = list(sys.argv[1:] if argv is None else argv)
        spawn(main, [*given, "--layers", "1", "--block-size", "4", "--workspace", "32", "--reps", "2"])
        return None
    backend = "nccl" if torch.cuda.is_available() and not args.dry_run else "gloo"
    dist.init_process_group(backend)
    try:
        result = run(args)
        dist.barrier()  # every rank done before any tears its group down (gloo aborts otherwise)
        return result
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
