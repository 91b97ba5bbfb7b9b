"""The demo: one DeepSeek-V2-Lite-shaped MLA layer on a heterogeneous prefill batch.

One long cached context among many short ones is the case vLLM PR #50613 fixed: the old
"batch column" schedule gives every request the same slice of the workspace, so the long request
alone forces many chunks. We print the chunk count of each schedule, run ``mla_prefill`` with the
two library policies (and with per-request routing, which sends requests with few new tokens to
the absorbed path) and check it against a dense, unchunked float64 computation.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

import mla_ops

from .ops import backends
from .serving.cli import one_line

PROG = "python -m mla_ops demo"

# DeepSeek-V2-Lite: 16 heads, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128.
HEADS, LATENT, NOPE, ROPE, VALUE = 16, 512, 128, 64, 128


def batch_column_count(context_lens: list[int], workspace_size: int) -> tuple[int | None, float | None]:
    """Chunks and workspace use of the old even split (vLLM before PR #50613; the baseline itself
    lives in benchmarks/batch_column.py): every chunk takes the same ``workspace_size //
    requests_with_context`` rows of each request, so the longest context sets the count."""
    with_context = sum(1 for c in context_lens if c > 0)
    per_request = workspace_size // with_context if with_context else 0
    if per_request == 0:
        return None, None
    count = -(-max(context_lens) // per_request)
    return count, sum(context_lens) / (count * workspace_size)


def make_batch(context_lens, query_lens, block_size, dtype, seed):
    """Random weights and inputs; each request's blocks sit at shuffled places in the cache."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)  # noqa: E731
    blocks = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks) + 8
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    block_table = torch.zeros(len(context_lens), max(max(blocks), 1), dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks):
        block_table[r, :n] = order[used : used + n]
        used += n
    num_tokens = sum(query_lens)
    return dict(
        q=randn(num_tokens, HEADS, NOPE + ROPE),
        kv_c=randn(num_tokens, LATENT),
        k_pe=randn(num_tokens, ROPE),
        kv_cache=randn(num_blocks, block_size, LATENT + ROPE),
        block_table=block_table,
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        kv_b_proj_weight=randn(HEADS * (NOPE + VALUE), LATENT) / math.sqrt(LATENT),
    )


def dense_reference(batch, softmax_scale) -> torch.Tensor:
    """Unchunked float64 MLA attention, one request at a time."""
    d = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    cache, table, qsl = d["kv_cache"], d["block_table"], d["query_start_loc"].tolist()
    block_size = cache.shape[1]
    outs = []
    for r, c in enumerate(d["context_lens"].tolist()):
        t0, t1 = qsl[r], qsl[r + 1]
        pos = torch.arange(c)
        context = cache[table[r, pos // block_size].long(), pos % block_size]
        rows = torch.cat([context, torch.cat([d["kv_c"][t0:t1], d["k_pe"][t0:t1]], 1)])
        kv = (rows[:, :LATENT] @ d["kv_b_proj_weight"].t()).view(-1, HEADS, NOPE + VALUE)
        keys = torch.cat([kv[..., :NOPE], rows[:, None, LATENT:].expand(-1, HEADS, ROPE)], -1)
        scores = torch.einsum("qhd,khd->hqk", d["q"][t0:t1], keys) * softmax_scale
        visible = torch.arange(rows.shape[0])[None, :] <= torch.arange(t1 - t0)[:, None] + c
        scores = scores.masked_fill(~visible, -math.inf)
        outs.append(torch.einsum("hqk,khv->qhv", scores.softmax(-1), kv[..., NOPE:]))
    return torch.cat(outs)


def run(full: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0, backend: str = "torch") -> None:
    if full:  # the PR's headline case
        context_lens, query_lens, workspace_size = [60000] + [16] * 31, [513] * 32, 65536
    else:  # same shape of problem, small enough for two CPU cores
        context_lens, query_lens, workspace_size = [6000] + [16] * 15, [64] * 16, 1024
    block_size = 16
    print(
        f"MLA layer N={HEADS} L={LATENT} P={NOPE} R={ROPE} V={VALUE}, {len(context_lens)} requests, "
        f"contexts {context_lens[0]} + {len(context_lens) - 1} x {context_lens[1]}, "
        f"{query_lens[0]} new tokens each, workspace {workspace_size} rows, {dtype}"
    )
    total = sum(context_lens)
    print(f"\n{'schedule':<16}{'chunks':>8}{'workspace use':>16}{'plan (us)':>12}")
    count, use = batch_column_count(context_lens, workspace_size)
    print(f"{'batch_column':<16}{count if count is not None else 'n/a':>8}"
          f"{f'{use:.1%}' if use is not None else 'n/a':>16}{'':>12}")
    for policy in ("whole_requests", "packed"):
        schedule = mla_ops.plan_context_chunks(context_lens, query_lens, workspace_size, policy=policy)
        start = time.perf_counter()
        for _ in range(100):
            mla_ops.plan_context_chunks(context_lens, query_lens, workspace_size, policy=policy)
        plan_us = (time.perf_counter() - start) / 100 * 1e6
        use = total / (schedule.num_chunks * workspace_size)
        print(f"{policy:<16}{schedule.num_chunks:>8}{use:>16.1%}{plan_us:>12.1f}")

    batch = make_batch(context_lens, query_lens, block_size, dtype, seed)
    softmax_scale = 1.0 / math.sqrt(NOPE + ROPE)
    expect = dense_reference(batch, softmax_scale)
    # Untimed warm-up: the first call pays for one-time initialization of the ops and BLAS.
    mla_ops.mla_prefill(**make_batch([32, 0], [4, 4], block_size, dtype, seed), softmax_scale=softmax_scale,
                        workspace_size=16, backend=backend)
    threshold = mla_ops.routing.cost_model_threshold(LATENT, NOPE, ROPE, VALUE)
    runs = [("whole_requests", dict(policy="whole_requests", absorb_max_query_len=0)),
            ("packed", dict(policy="packed", absorb_max_query_len=0)),
            (f"routed (q<={threshold})", dict(policy="packed"))]  # short requests take the absorbed path
    print(f"\n{'mla_prefill':<22}{'time (s)':>10}{'max |err|':>12}{'rel err':>10}")
    for name, options in runs:
        start = time.perf_counter()
        out = mla_ops.mla_prefill(**batch, softmax_scale=softmax_scale, workspace_size=workspace_size,
                                  backend=backend, **options)
        elapsed = time.perf_counter() - start
        err = (out.double() - expect).abs().max().item()
        print(f"{name:<22}{elapsed:>10.2f}{err:>12.2e}{err / expect.abs().max().item():>10.1e}")


def step_inputs(config, context_lens, query_lens, block_size, max_blocks, seed):
    """One model step: each request's new tokens go right after its context, in its own blocks."""
    g = torch.Generator().manual_seed(seed)
    table = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    slots, positions, used = [], [], 0
    for r, (c, q) in enumerate(zip(context_lens, query_lens)):
        n = -(-(c + q) // block_size)
        table[r, :n] = torch.arange(used, used + n, dtype=torch.int32)
        used += n
        positions += range(c, c + q)
        slots += [int(table[r, p // block_size]) * block_size + p % block_size for p in range(c, c + q)]
    ids = torch.randint(0, config.vocab_size, (sum(query_lens),), generator=g)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return ids, torch.tensor(positions), torch.tensor(slots), table, qsl, torch.tensor(context_lens, dtype=torch.int32)


def compiled_demo(max_chunks: int = 4, workspace_size: int = 32, block_size: int = 4) -> list[tuple[list[int], int, float]]:
    """A tiny model step compiled whole, planned on the device inside the graph: one graph serves
    every batch of the bucket (contexts up to ``max_chunks * workspace_size`` rows). Returns, per batch,
    its context lens, the graphs compiled so far and the largest difference from the eager step."""
    mla_ops.enable()
    torch.manual_seed(0)
    config = mla_ops.MLAConfig.from_name("tiny")
    model = mla_ops.MLAModel(config).eval()
    caches = model.allocate_kv_caches(64, block_size).latent  # one tensor per layer (a list reads as KVCaches)
    for cache in caches:
        torch.nn.init.normal_(cache)

    def step(ids, positions, kv_caches, slots, table, qsl, context_lens):
        plan = mla_ops.plan_prefill(qsl, context_lens, table, block_size, workspace_size, max_chunks=max_chunks)
        return model(ids, positions, kv_caches, slots, plan)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    batches = [([5, 0, 13], [3, 2, 4]), ([40, 7, 0, 2, 11], [1, 2, 3, 4, 5]), ([0, 0], [3, 3]), ([63, 1, 20], [4, 4, 2])]
    print(f"\ntorch.compile(fullgraph=True, dynamic=True), tiny {config.num_hidden_layers}-layer model, "
          f"device plan max_chunks={max_chunks}, workspace {workspace_size} rows")
    print(f"{'batch (context lens)':<24}{'chunks':>8}{'graphs':>8}{'max |eager - compiled|':>25}")
    rows = []
    for i, (context_lens, query_lens) in enumerate(batches):
        ids, positions, slots, table, qsl, lens = step_inputs(config, context_lens, query_lens, block_size, 20, i)
        eager_caches, compiled_caches = [c.clone() for c in caches], [c.clone() for c in caches]
        for cache in compiled_caches:
            torch._dynamo.mark_static(cache)  # a runner's fixed cache buffers, not dynamic shapes
        start = time.perf_counter()
        got = compiled(ids, positions, compiled_caches, slots, table, qsl, lens)
        elapsed = time.perf_counter() - start
        expect = step(ids, positions, eager_caches, slots, table, qsl, lens)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        chunks = -(-sum(context_lens) // workspace_size)
        error = (got - expect).abs().max().item()
        note = f"  (compiled in {elapsed:.1f} s)" if i == 0 else ""
        print(f"{str(context_lens):<24}{chunks:>8}{graphs:>8}{error:>25.2e}{note}")
        rows.append((context_lens, graphs, error))
    return rows


def main(argv: list[str] | None = None) -> None:
    """argparse's conventions, as ``python -m mla_ops generate``'s: a usage error (a backend this machine
    lacks included) exits 2, an error while running exits 1, each with one line on stderr."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    parser.add_argument("--full", action="store_true",
                        help="the PR's full size: 32 x 513 new tokens, contexts 60,000 + 31 x 16, workspace 65,536")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="torch", choices=("auto", "torch", "triton"))
    parser.add_argument("--debug", action="store_true", help="on an error, raise it with its full traceback")
    args = parser.parse_args(argv)
    try:
        backends.select(args.backend, torch.device("cpu"))  # the demo's tensors are on the CPU
    except ValueError as e:
        parser.error(f"argument --backend: {e}")
    try:
        with torch.no_grad():  # not set_grad_enabled: main() may run inside another program's process
            run(full=args.full, dtype=getattr(torch, args.dtype), seed=args.seed, backend=args.backend)
            compiled_demo()
    except Exception as e:
        if args.debug:
            raise
        print(f"{PROG}: error: {one_line(e)} (--debug shows the traceback)", file=sys.stderr)
        raise SystemExit(1) from None
