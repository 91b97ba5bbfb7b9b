"""What the ranks' per-step agreement costs: ``Generator``'s one int64 all-gather a step, beside the step.

A model across ranks (``MLAForCausalLM(config, context_parallel=...)``) runs ``Generator.generate`` on
every rank; before each step every rank all-gathers whether it got there cleanly, so a rank that
raised makes the others raise at once instead of at the group's timeout. Measured side by side in one
run, per rank: the agreement alone (``gather_fingerprints``, median of ``--reps``) and the mean step of
greedy generation (the tiny preset, ``--prompts`` prompts of 24 tokens, ``--new-tokens`` each), and
their ratio. Two gloo processes on this machine unless launched by torchrun (NCCL on GPUs):

    python -m benchmarks.rank_agreement --json benchmarks/results/rank_agreement.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import mla_ops
from benchmarks._lib.ranks import spawn
from benchmarks._lib.report import write_json_atomic
from mla_ops.parallel import collectives


def run(args) -> dict:
    torch.manual_seed(0)
    model = mla_ops.MLAForCausalLM(mla_ops.MLAConfig.from_name("tiny"), context_parallel=mla_ops.ContextParallel())
    group = model.context_parallel.process_group
    agreement = []
    for _ in range(args.reps):
        start = time.perf_counter()
        collectives.gather_fingerprints(1, group)
        agreement.append(time.perf_counter() - start)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (24,), generator=g).tolist() for _ in range(args.prompts)]
    generator = mla_ops.Generator(model, block_size=4, prefix_caching=False)
    generator.generate(prompts, 2)  # warm
    generator.generate(prompts, args.new_tokens)
    step = generator.stats.seconds / generator.stats.steps
    agree = statistics.median(agreement)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": dist.get_backend(),
            "agreement_ms": round(agree * 1e3, 4), "step_ms": round(step * 1e3, 3), "steps": generator.stats.steps,
            "agreement_per_step": round(agree / step, 4)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rank_agreement", description=__doc__.split("\n")[0])
    p.add_argument("--json")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    return p


def main(argv=None) -> list | None:
    args = parser().parse_args(argv)
    if "RANK" not in os.environ:  # launch two gloo processes ourselves
        spawn(main, sys.argv[1:] if argv is None else argv)
        return None
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        row = run(args)
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        if dist.get_rank() == 0:
            for r in rows:
                print(f"rank {r['rank']}: agreement {r['agreement_ms']:.3f} ms, step {r['step_ms']:.2f} ms "
                      f"({r['agreement_per_step']:.1%} of a step)")
            if args.json:
                write_json_atomic(args.json, {"benchmark": "rank_agreement", "preset": "tiny", "results": rows})
        dist.barrier()  # every rank done before any tears its group down (gloo aborts otherwise)
        return rows
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
