"""Whole prefill steps replayed from CUDA graphs (``mla_ops.PrefillGraphs``) against the eager model.

A 2-layer model with DeepSeek-V2-Lite's attention dims (N=16, L=512, P=128, R=64, V=128, hidden
2048, dense MLP 10944), bf16, 64-row cache blocks. Steps:

* ``launch-bound``: 4 requests x 16 new tokens over 8,192 cached tokens each (default routing:
  16 <= 170 new tokens, so the absorbed path; no chunk), the goal being >= 2x from replay;
* ``launch-bound-mha``: the same with the absorbed path off and a 16,384-row workspace (2 chunks);
* ``q<n>``: 4 requests x n new tokens over 8,192 each, n = 64, 256, 1024 (``--long``: also 2048 and
  4096): where graphs stop mattering.

Per step: ``eager_ms`` (the model with a host plan, as an eager caller runs it) and ``runner_ms``
(``PrefillGraphs``: host bucketing, refill of the static buffers, replay), both steady-state
milliseconds per step measured back to back in this run, their ratio, the first call (which
captures), the graph memory the capture added, and the largest difference of the outputs. The JSON
is rewritten after every step (``benchmarks/report.py``), so a run cut short keeps what it measured.

    python benchmarks/graphs_bench.py --json benchmarks/results/gpu_graphs.json --plot ...png
    python benchmarks/graphs_bench.py --dry-run   # tiny sizes on CPU, modes "eager" and "compile",
                                                  # marked dry_run, never under benchmarks/results/
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mla_ops  # noqa: E402
from benchmarks.report import Report, output_path  # noqa: E402

# V2-Lite attention dims, 2 dense layers: the step's launch pattern is what is measured, not MoE.
V2_LITE_2_LAYERS = dict(mla_ops.models.config.mla_configs["deepseek-v2-lite"], num_hidden_layers=2, n_routed_experts=None)
TINY = dict(mla_ops.models.config.mla_configs["tiny"], num_hidden_layers=1)  # the dry run: quick to trace


def steps(dry_run: bool, long: bool):
    """(name, context_lens, query_lens, workspace_size, absorb_max_query_len or None)."""
    if dry_run:
        return [("launch-bound", [32] * 4, [4] * 4, 64, None), ("launch-bound-mha", [32] * 4, [4] * 4, 64, 0)]
    out = [("launch-bound", [8192] * 4, [16] * 4, 65536, None),
           ("launch-bound-mha", [8192] * 4, [16] * 4, 16384, 0)]
    sweep = (64, 256, 1024, 2048, 4096) if long else (64, 256, 1024)
    out += [(f"q{n}", [8192] * 4, [n] * 4, 65536, None) for n in sweep]
    return out


def step_inputs(config, context_lens, query_lens, block_size, device, seed=0):
    """One step's inputs (new tokens right after each context) and the cache blocks it uses."""
    g = torch.Generator().manual_seed(seed)
    blocks = [math.ceil((c + q) / block_size) for c, q in zip(context_lens, query_lens)]
    order = torch.randperm(sum(blocks), generator=g).to(torch.int32)
    table = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
    slots, used = [], 0
    for r, n in enumerate(blocks):
        table[r, :n] = order[used : used + n]
        used += n
        c, q = context_lens[r], query_lens[r]
        pos = torch.arange(c, c + q)
        slots.append(table[r, pos // block_size].long() * block_size + pos % block_size)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)])
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.randint(0, config.vocab_size, (sum(query_lens),), generator=g)
    return dict(input_ids=ids.to(device), positions=positions.to(device), slot_mapping=torch.cat(slots).to(device),
                block_table=table.to(device), query_start_loc=qsl,
                context_lens=torch.tensor(context_lens, dtype=torch.int32),
                num_blocks=sum(blocks))


def per_step_ms(fn, device, reps: int) -> float:
    """Steady-state milliseconds per step: ``reps`` steps back to back, one sync at the end (so a
    host-bound step shows its host time, a GPU-bound one its GPU time)."""
    for _ in range(2 if device.type == "cuda" else 1):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) * 1e3 / reps


def run_step(model, device, mode, name, context_lens, query_lens, workspace_size, absorb, args) -> dict:
    config, block_size = model.config, args.block_size
    x = step_inputs(config, context_lens, query_lens, block_size, device)
    caches = model.allocate_kv_caches(x.pop("num_blocks"), block_size)
    torch.nn.init.normal_(caches, std=0.5)
    call = dict(x, kv_caches=caches)
    tokens, requests = sum(query_lens), len(query_lens)

    def eager():
        plan = mla_ops.plan_prefill(x["query_start_loc"], x["context_lens"], x["block_table"], block_size,
                                    workspace_size, absorb_max_query_len=absorb)
        return model(x["input_ids"], x["positions"], caches, x["slot_mapping"], x["block_table"], plan)

    runner = mla_ops.PrefillGraphs(
        model, max_tokens=tokens, max_requests=requests, max_blocks_per_request=x["block_table"].shape[1],
        block_size=block_size, workspace_size=workspace_size, chunk_buckets=(1, 2, 4), mode=mode,
        absorb_max_query_len=absorb, compile_backend=args.compile_backend,
    )
    start = time.perf_counter()
    out = runner(**call).clone()  # builds (captures / compiles) the step's bucket
    first_call_s = time.perf_counter() - start
    with torch.no_grad():
        expect = eager()
    diff = (out.float() - expect.float()).abs().max().item()
    with torch.no_grad():
        eager_ms = per_step_ms(eager, device, args.reps)
    runner_ms = per_step_ms(lambda: runner(**call), device, args.reps)
    row = dict(step=name, mode=mode, requests=requests, query_tokens=tokens, context_tokens=sum(context_lens),
               workspace_size=workspace_size, absorb_max_query_len=absorb, buckets=[str(v) for v in runner.built],
               eager_ms=eager_ms, runner_ms=runner_ms, speedup=eager_ms / runner_ms, first_call_s=first_call_s,
               graphs=runner.stats["graphs"], eager_steps=runner.stats["eager"],
               graph_bytes=sum(runner.stats["graph_bytes"].values()), static_bytes=runner.stats["static_bytes"],
               max_abs_diff=diff, max_abs_output=expect.float().abs().max().item())
    print(f"{name:<18} {mode:<10} T={tokens:<5} eager {eager_ms:8.3f} ms  runner {runner_ms:8.3f} ms  "
          f"x{row['speedup']:5.2f}  first call {first_call_s:6.2f} s  "
          f"graph memory {row['graph_bytes'] / 2**20:7.1f} MiB"
          f"  diff {diff:.2e}", flush=True)
    return row


def run(args) -> dict:
    device = torch.device("cpu" if args.dry_run else args.device)
    if not args.dry_run and device.type != "cuda":
        raise SystemExit("graphs_bench measures CUDA-graph replay: it needs a GPU (or --dry-run on CPU)")
    torch.manual_seed(0)
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    config = mla_ops.MLAConfig(**(TINY if args.dry_run else V2_LITE_2_LAYERS))
    with torch.device(device):  # initialised where it runs: quick for the full-size layers
        model = mla_ops.MLAModel(config).to(dtype).eval()
    modes = ("eager", "compile") if args.dry_run else ("cuda_graph",)
    report = Report(args.json, dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
        dtype=str(dtype), layers=config.num_hidden_layers, block_size=args.block_size,
    ), dry_run=args.dry_run)
    for name, context_lens, query_lens, workspace_size, absorb in steps(args.dry_run, args.long):
        for mode in modes:
            report.add(run_step(model, device, mode, name, context_lens, query_lens, workspace_size, absorb, args))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report.finish()


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(rows)), 4.5))
    xs = range(len(rows))
    ax.bar([i - 0.2 for i in xs], [r["eager_ms"] for r in rows], 0.4, label="eager model (host plan)")
    ax.bar([i + 0.2 for i in xs], [r["runner_ms"] for r in rows], 0.4, label="PrefillGraphs (bucketed step)")
    for i, r in enumerate(rows):
        ax.annotate(f"x{r['speedup']:.2f}", (i, max(r["eager_ms"], r["runner_ms"])), ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(list(xs), [f"{r['step']}\n{r['mode']}, T={r['query_tokens']}" for r in rows], fontsize=8)
    ax.set_ylabel("ms per step")
    ax.set_yscale("log")
    dry = " (dry run: no GPU result)" if report["dry_run"] else ""
    ax.set_title(f"{report['device']}, {report['dtype']}, {report['layers']} layers{dry}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the report here (rewritten after every step)")
    parser.add_argument("--plot", help="write a PNG here")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--compile-backend", help="torch.compile backend of mode 'compile' (default inductor; "
                        "aot_eager for --dry-run, which checks the code paths, not Inductor)")
    parser.add_argument("--long", action="store_true", help="also the largest steps")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on CPU, modes eager and compile, marked dry_run, "
                        "never under benchmarks/results/")
    args = parser.parse_args(argv)
    if args.compile_backend is None:
        args.compile_backend = "aot_eager" if args.dry_run else "inductor"
    if args.dry_run:
        args.block_size = 4
        args.json = output_path(args.json, True, "gpu_graphs.json")
        if args.plot:
            output_path(args.plot, True, "gpu_graphs.png")
        print(f"dry run (CPU, no GPU result): {args.json}", flush=True)
    report = run(args)
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
