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
is rewritten after every step (``benchmarks/_lib/report.py``), so a run cut short keeps what it measured.

    python -m benchmarks.graphs_bench --json benchmarks/results/gpu_graphs.json --plot ...png
    python -m benchmarks.graphs_bench --dry-run   # tiny sizes on CPU, modes "eager" and "compile",
                                                  # marked dry_run, never under benchmarks/results/
"""

from __future__ import annotations

import dataclasses
import time

import torch

import mla_ops
from benchmarks._lib import cli
from benchmarks._lib import plot as plotting
from benchmarks._lib.batches import model_step
from benchmarks._lib.report import Report, machine
from benchmarks._lib.timing import per_step_ms

# V2-Lite attention dims, 2 dense layers: the step's launch pattern is what is measured, not MoE.
V2_LITE_2_LAYERS = dataclasses.replace(mla_ops.MLAConfig.from_name("deepseek-v2-lite"), num_hidden_layers=2,
                                       n_routed_experts=None)
TINY = dataclasses.replace(mla_ops.MLAConfig.from_name("tiny"), num_hidden_layers=1)  # the dry run: quick to trace


def steps(dry_run: bool, long: bool):
    """(name, context_lens, query_lens, workspace_size, absorb_max_query_len or None)."""
    if dry_run:
        return [("launch-bound", [32] * 4, [4] * 4, 64, None), ("launch-bound-mha", [32] * 4, [4] * 4, 64, 0)]
    out = [("launch-bound", [8192] * 4, [16] * 4, 65536, None),
           ("launch-bound-mha", [8192] * 4, [16] * 4, 16384, 0)]
    sweep = (64, 256, 1024, 2048, 4096) if long else (64, 256, 1024)
    out += [(f"q{n}", [8192] * 4, [n] * 4, 65536, None) for n in sweep]
    return out


def run_step(model, device, mode, name, context_lens, query_lens, workspace_size, absorb, args) -> dict:
    config, block_size = model.config, args.block_size
    x = model_step(config, context_lens, query_lens, block_size, device)
    caches = model.allocate_kv_caches(x.pop("num_blocks"), block_size)
    for cache in caches.tensors:
        torch.nn.init.normal_(cache, std=0.5)
    call = dict(x, kv_caches=caches)
    tokens, requests = sum(query_lens), len(query_lens)

    def eager():
        plan = mla_ops.plan_prefill(x["query_start_loc"], x["context_lens"], x["block_table"], block_size,
                                    workspace_size, absorb_max_query_len=absorb)
        return model(x["input_ids"], x["positions"], caches, x["slot_mapping"], plan)

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
    config = TINY if args.dry_run else V2_LITE_2_LAYERS
    with torch.device(device):  # initialised where it runs: quick for the full-size layers
        model = mla_ops.MLAModel(config).to(dtype).eval()
    modes = ("eager", "compile") if args.dry_run else ("cuda_graph",)
    report = Report(args.json, dict(
        machine(device), dtype=str(dtype), layers=config.num_hidden_layers, block_size=args.block_size,
    ), dry_run=args.dry_run)
    for name, context_lens, query_lens, workspace_size, absorb in steps(args.dry_run, args.long):
        for mode in modes:
            report.add(run_step(model, device, mode, name, context_lens, query_lens, workspace_size, absorb, args))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report.finish()


def plot(report: dict, path: str) -> None:
    plt = plotting.pyplot()
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
    plotting.save(fig, path, dpi=120)


def main(argv=None) -> dict:
    parser = cli.parser(__doc__)
    cli.add_common_args(parser, reps=20, device="cuda", smoke=False)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--compile-backend", help="torch.compile backend of mode 'compile' (default inductor; "
                        "aot_eager for --dry-run, which checks the code paths, not Inductor)")
    args = cli.parse_args(parser, argv, "gpu_graphs.json")  # --dry-run: also modes eager and compile
    if args.compile_backend is None:
        args.compile_backend = "aot_eager" if args.dry_run else "inductor"
    if args.dry_run:
        args.block_size = 4
    report = run(args)
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
