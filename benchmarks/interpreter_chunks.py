"""The device path's cost of dead chunk iterations, timed under Triton's CPU interpreter.

``mla_prefill(backend="triton", max_chunks=K)`` at K = 1, 4 and 16 on a small batch that needs
one chunk, so K - 1 iterations find no rows. The interpreter runs every launched program in
Python, so a dead iteration costs what its launches cost (no GPU is involved; this is a proxy for
launch overhead, not a GPU time). Two routings: ``chunked`` (``absorb_max_query_len=0``: every
context on the chunk loop) and ``routed`` (the default threshold: the short requests take the
absorbed path, and the chunk loop has nothing left). K values are interleaved, best of
``--repeats``. Goal (issue 10): K = 16 within 1.3x of K = 1.

    python benchmarks/interpreter_chunks.py --json benchmarks/results/interpreter_chunks.json
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before mla_ops.triton defines its kernels

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Sequence  # noqa: E402

import torch  # noqa: E402

if __package__ in (None, ""):  # run as a script: make `mla_ops` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mla_ops  # noqa: E402

MAX_CHUNKS = (1, 4, 16)
CONTEXT_LENS, QUERY_LENS = [40, 0, 23, 9], [5, 3, 1, 7]
HEADS, LATENT, ROPE, NOPE, VALUE, BLOCK_SIZE, WORKSPACE = 2, 16, 4, 8, 8, 16, 128
ROUTINGS = {"chunked": 0, "routed": None}


def make_batch(seed: int = 0) -> dict:
    """A paged batch at tiny dims, in fp32 (the interpreter has no bf16 arithmetic)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-c // BLOCK_SIZE) for c in CONTEXT_LENS]
    num_blocks = sum(blocks) + 2
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks):
        table[r, :n] = order[used : used + n]
        used += n
    tokens = sum(QUERY_LENS)
    qsl = torch.tensor([0] + torch.tensor(QUERY_LENS).cumsum(0).tolist(), dtype=torch.int32)
    return dict(
        q=torch.randn(tokens, HEADS, NOPE + ROPE, generator=g), kv_c=torch.randn(tokens, LATENT, generator=g),
        k_pe=torch.randn(tokens, ROPE, generator=g),
        kv_cache=torch.randn(num_blocks, BLOCK_SIZE, LATENT + ROPE, generator=g), block_table=table,
        query_start_loc=qsl, context_lens=torch.tensor(CONTEXT_LENS, dtype=torch.int32),
        kv_b_proj_weight=torch.randn(HEADS * (NOPE + VALUE), LATENT, generator=g) / LATENT**0.5,
        softmax_scale=(NOPE + ROPE) ** -0.5,
    )


def time_step(batch: dict, max_chunks: int, absorb) -> float:
    start = time.perf_counter()
    mla_ops.mla_prefill(**batch, workspace_size=WORKSPACE, backend="triton", max_chunks=max_chunks,
                        absorb_max_query_len=absorb)
    return time.perf_counter() - start


def run(repeats: int) -> dict:
    torch.set_num_threads(1)  # the interpreter is serial; threads only add noise
    batch = make_batch()
    results = {}
    for name, absorb in ROUTINGS.items():
        for k in MAX_CHUNKS:  # warm-up: each kernel specialisation once
            time_step(batch, k, absorb)
        best = {k: float("inf") for k in MAX_CHUNKS}
        for _ in range(repeats):
            for k in MAX_CHUNKS:
                best[k] = min(best[k], time_step(batch, k, absorb))
        results[name] = {"seconds": {str(k): round(t, 4) for k, t in best.items()},
                         "k16_over_k1": round(best[16] / best[1], 3), "k4_over_k1": round(best[4] / best[1], 3)}
    return {"config": dict(context_lens=CONTEXT_LENS, query_lens=QUERY_LENS, heads=HEADS, latent=LATENT, rope=ROPE,
                           nope=NOPE, value=VALUE, block_size=BLOCK_SIZE, workspace=WORKSPACE, repeats=repeats,
                           torch=torch.__version__),
            **results}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = run(args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({name: result[name]["k16_over_k1"] for name in ROUTINGS}))
    return result


if __name__ == "__main__":
    main()
