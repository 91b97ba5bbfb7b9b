"""One rank of a context-parallel test run (tests/parallel/test_context_parallel.py launches D of these).

    python -m tests.support.cp_worker RANK WORLD_SIZE STORE_PORT CASE [CASE ...]   # from the repository root

Joins a gloo group through the launcher's TCPStore on 127.0.0.1, then per case: builds the same
global batch on every rank (seeded), computes the dense float64 reference of all heads, shards the
cache with ``mla_ops.shard_context`` (and shuffles the local blocks), runs ``plan_prefill(...,
context_parallel=...)`` + ``run_prefill`` for this rank's heads and compares. Prints one
``RESULT {json}`` line per case; the first failure exits non-zero (the launcher stops the others).
Every all-gather of the all-gather path is recorded (``recorded_all_gathers``): its parts must have
the planned rows and travel in the compute dtype, or as the fp8 cache's bytes (1 byte an element).

Shapes: global heads N = D * H (H per rank), kv_b_proj_weight [N*(P+V), L] (rank r: rows of heads
r*H .. r*H+H), q [T, N, P+R]; the reference is the tests' dense float64 one (tests/support/batches.py),
written from DESIGN §1, not from the library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

import mla_ops
from mla_ops.parallel import collectives
from tests.support import batches

H, L, P, R, V = 2, 16, 8, 8, 8  # per-rank heads and MLA dims (small)
BLOCK_SIZE = 4


@dataclass
class Case:
    contexts: list[int]
    queries: list[int]
    workspace_size: int
    interleave: int = 1
    absorb_max_query_len: int | None = None
    max_chunks: int | None = None
    max_absorbed_tokens: int | None = None
    policy: str = "packed"
    dtype: torch.dtype = torch.float64
    fp8_scale: float | None = None
    tol: float = 1e-10
    expect: str = "mixed"  # which context paths must run: all_gather / absorbed / mixed
    min_chunks: int = 0
    truncates: bool = False  # some requests' gathered context runs past max_chunks: their tokens are NaN
    seed: int = 0


# Zero contexts first, in the middle and last, contexts of one token, requests with no new tokens,
# contexts shorter than one stripe (some ranks hold nothing), several chunks with continuations.
CONTEXTS = [0, 37, 5, 0, 1, 64, 12, 0]
QUERIES = [3, 2, 7, 1, 4, 0, 9, 2]


def cases(world: int) -> dict[str, Case]:
    return {
        "all_gather": Case(CONTEXTS, QUERIES, 8 * world, absorb_max_query_len=0, expect="all_gather", min_chunks=4),
        "absorbed": Case(CONTEXTS, QUERIES, 8 * world, absorb_max_query_len=10**6, expect="absorbed"),
        "mixed": Case(CONTEXTS, QUERIES, 4 * world, absorb_max_query_len=3, min_chunks=2),
        "interleave_4": Case(CONTEXTS, QUERIES, 8 * world, interleave=4, absorb_max_query_len=3, min_chunks=2, seed=1),
        "interleave_4_all_gather": Case(CONTEXTS, QUERIES, 4 * world, interleave=4, absorb_max_query_len=0,
                                        expect="all_gather", min_chunks=8, seed=2),
        "cost_model": Case([300, 2, 0, 80], [1, 40, 3, 2], 16 * world, seed=3),  # long context, few queries: absorbed
        "whole_requests": Case(CONTEXTS, QUERIES, 16 * world, policy="whole_requests", absorb_max_query_len=2, seed=4),
        "fp8_cache": Case(CONTEXTS, QUERIES, 4 * world, absorb_max_query_len=3, dtype=torch.float32, fp8_scale=0.5,
                          tol=2e-5, min_chunks=2, seed=5),
        "fp8_all_gather": Case(CONTEXTS, QUERIES, 4 * world, interleave=2, absorb_max_query_len=0, dtype=torch.float32,
                               fp8_scale=0.25, tol=2e-5, expect="all_gather", min_chunks=4, seed=9),
        "fp8_device_form": Case(CONTEXTS, QUERIES, 8 * world, absorb_max_query_len=3, max_chunks=6,
                                max_absorbed_tokens=8, dtype=torch.float32, fp8_scale=0.5, tol=2e-5, min_chunks=6,
                                seed=10),
        "device_form": Case(CONTEXTS, QUERIES, 8 * world, absorb_max_query_len=3, max_chunks=6, max_absorbed_tokens=8,
                            min_chunks=6, seed=6),
        "device_form_truncated": Case(CONTEXTS, QUERIES, 8 * world, absorb_max_query_len=0, max_chunks=3,
                                      expect="all_gather", min_chunks=3, truncates=True, seed=7),
        "no_context": Case([0, 0, 0], [2, 3, 1], 4 * world, expect="none", min_chunks=0, seed=8),
    }


# ---- the batch and its dense reference ---------------------------------------------------------


def dequantized(b):
    """The batch with its fp8 cache dequantized beforehand (float32 ``stored * k_scale``, cast to the
    compute dtype: what ``gather_context`` writes on one device) and no ``k_scale``."""
    return {**b, "cache": (b["cache"].float() * b["k_scale"]).to(b["q"].dtype), "k_scale": None}


def make_batch(case: Case, world: int):
    g = torch.Generator().manual_seed(case.seed)
    randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    heads = H * world
    blocks = [-(-c // BLOCK_SIZE) for c in case.contexts]
    num_blocks, table = batches.paged_block_table(blocks, g, spare_blocks=2, pad_cols=1)
    cache = randn(num_blocks, BLOCK_SIZE, L + R)
    k_scale = None
    if case.fp8_scale is not None:
        cache, k_scale = (cache / case.fp8_scale).to(torch.float8_e4m3fn), torch.tensor([case.fp8_scale])
    else:
        cache = cache.to(case.dtype)
    tokens = sum(case.queries)
    qsl = torch.tensor([0, *torch.tensor(case.queries).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        q=randn(tokens, heads, P + R).to(case.dtype), kv_c=randn(tokens, L).to(case.dtype),
        k_pe=randn(tokens, R).to(case.dtype), cache=cache, table=table, qsl=qsl,
        ctx=torch.tensor(case.contexts, dtype=torch.int32),
        weight=(randn(heads * (P + V), L) / math.sqrt(L)).to(case.dtype), scale=1.0 / math.sqrt(P + R),
        k_scale=k_scale,
    )


def dense_reference(b) -> torch.Tensor:
    """float64 [T, N, V] of all heads: per request, its context rows then its new tokens, one masked softmax."""
    return batches.dense_reference(b["q"], b["kv_c"], b["k_pe"], b["cache"], b["table"], b["qsl"], b["ctx"],
                                   b["weight"], b["scale"], k_scale=b["k_scale"])


def shuffled_shard(b, rank: int, world: int, interleave: int, seed: int):
    """This rank's shard, its blocks permuted (a block table that is not the identity)."""
    cache, table = mla_ops.shard_context(b["cache"], b["table"], b["ctx"], rank=rank, world_size=world,
                                         interleave=interleave)
    perm = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(seed + 100 * rank))
    stored = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    moved = torch.empty_like(stored)
    moved[perm] = stored
    return moved.view(cache.dtype), perm[table.long()].to(torch.int32)


# ---- running one rank ----------------------------------------------------------------------------


@contextlib.contextmanager
def recorded_all_gathers():
    """Every tensor handed to ``collectives.all_gather`` meanwhile, as ``(dtype, shape)``."""
    sent, original = [], collectives.all_gather

    def record(x, group):
        sent.append((x.dtype, tuple(x.shape)))
        return original(x, group)

    collectives.all_gather = record
    try:
        yield sent
    finally:
        collectives.all_gather = original


def check_parts_sent(name: str, plan, sent, fp8: bool, dtype: torch.dtype) -> int:
    """The all-gather path's parts (2-D, L+R wide; the absorbed queries are 3-D, the agreement check's
    checksum 1-D): one per chunk, of the planned rows, as the fp8 cache's bytes or in ``dtype``.
    Returns the bytes this rank sent in them."""
    cpp = plan.context_parallel
    parts = [(t, shape) for t, shape in sent if len(shape) == 2 and shape[1] == L + R]
    rows = list(cpp.chunk_part_rows) if cpp.chunk_part_rows is not None else [cpp.part_rows] * cpp.num_chunks
    assert [shape[0] for _, shape in parts] == rows, f"{name}: parts of {parts}, planned rows {rows}"
    want = torch.uint8 if fp8 else dtype
    assert all(t == want for t, _ in parts), f"{name}: parts sent as {[t for t, _ in parts]}, expected {want}"
    return sum(rows) * (L + R) * want.itemsize


def rank_inputs(b, rank: int):
    heads = slice(rank * H, (rank + 1) * H)
    rows = slice(rank * H * (P + V), (rank + 1) * H * (P + V))
    return b["q"][:, heads], b["weight"][rows], heads


def run_rank(case: Case, b, rank: int, world: int, cache, table, check=None):
    q, weight, _ = rank_inputs(b, rank)
    cp = mla_ops.ContextParallel(interleave=case.interleave, check=check)
    plan = mla_ops.plan_prefill(b["qsl"], b["ctx"], table, BLOCK_SIZE, workspace_size=case.workspace_size,
                                policy=case.policy, max_chunks=case.max_chunks,
                                absorb_max_query_len=case.absorb_max_query_len,
                                max_absorbed_tokens=case.max_absorbed_tokens, context_parallel=cp)
    out = mla_ops.run_prefill(q, b["kv_c"], b["k_pe"], cache, weight, b["scale"], plan, k_scale=b["k_scale"])
    return plan, out


def check_case(name: str, case: Case, rank: int, world: int) -> dict:
    b = make_batch(case, world)
    reference = dense_reference(b)
    cache, table = shuffled_shard(b, rank, world, case.interleave, case.seed)
    with recorded_all_gathers() as sent:
        plan, out = run_rank(case, b, rank, world, cache, table)
    cpp = plan.context_parallel
    fp8 = case.fp8_scale is not None
    part_bytes = check_parts_sent(name, plan, sent, fp8, case.dtype)
    _, _, heads = rank_inputs(b, rank)
    expect = reference[:, heads]
    qsl, stripe = b["qsl"].tolist(), case.interleave * world
    nan_rows = torch.zeros(out.shape[0], dtype=torch.bool)
    if case.truncates:  # DESIGN: whole stripes per chunk, K chunks of workspace_size // stripe stripes
        stripes = torch.tensor([-(-c // stripe) for c in case.contexts])
        past = (stripes.cumsum(0) > case.max_chunks * (case.workspace_size // stripe)) & (stripes > 0)
        for r in past.nonzero().flatten().tolist():
            nan_rows[qsl[r] : qsl[r + 1]] = True
        assert nan_rows.any() and not nan_rows.all()
    assert torch.isnan(out[nan_rows]).all(), "truncated requests must come out NaN"
    err = ((out[~nan_rows].double() - expect[~nan_rows]).abs().max().item() if (~nan_rows).any() else 0.0)
    err /= max(1.0, expect.abs().max().item())
    assert err <= case.tol, f"{name}: max |out - dense reference| = {err:.3e} > {case.tol:.0e}"

    absorbed = bool((plan.absorbed_context_lens > 0).any())
    ran = {"all_gather": cpp.num_chunks > 0 and not absorbed, "absorbed": absorbed and int(
        (plan.context_lens > 0).sum()) == int((plan.absorbed_context_lens > 0).sum()),
        "mixed": absorbed and cpp.num_chunks > 0, "none": not absorbed}
    assert ran[case.expect], f"{name}: expected the {case.expect} path(s); chunks {cpp.num_chunks}, absorbed {absorbed}"
    assert cpp.num_chunks >= case.min_chunks, f"{name}: {cpp.num_chunks} chunks, wanted >= {case.min_chunks}"

    if case.max_chunks is None:  # equal to one device (one process, the same fp8 cache and k_scale), too
        single = mla_ops.mla_prefill(b["q"], b["kv_c"], b["k_pe"], b["cache"], b["table"], b["qsl"], b["ctx"],
                                     b["weight"], b["scale"], workspace_size=8, absorb_max_query_len=0,
                                     k_scale=b["k_scale"])
        single_err = (out.double() - single[:, heads].double()).abs().max().item()
        assert single_err <= case.tol, f"{name}: differs from single-device mla_prefill by {single_err:.3e}"
    if fp8:  # the rows dequantized after the all-gather are those dequantized before it: the same bits out
        plain = dequantized(b)
        _, out_plain = run_rank(case, plain, rank, world, *shuffled_shard(plain, rank, world, case.interleave,
                                                                          case.seed))
        assert torch.equal(out.nan_to_num(), out_plain.nan_to_num()), (
            f"{name}: fp8 rows sent as fp8 differ from rows dequantized before sending by "
            f"{(out - out_plain).abs().max().item():.3e}")
    return {"case": name, "err": err, "chunks": cpp.num_chunks, "absorbed_tokens": cpp.num_absorbed_tokens,
            "part_bytes_sent": part_bytes}


def check_disagreement(rank: int, world: int) -> dict:
    """The last rank passes other lengths: with check=True every rank raises, naming it."""
    case = cases(world)["mixed"]
    b = make_batch(case, world)
    cache, table = shuffled_shard(b, rank, world, case.interleave, case.seed)
    if rank == world - 1:
        b["ctx"] = b["ctx"].clone()
        b["ctx"][1] -= 1  # one row fewer: a plan that would mix silently or hang
    try:
        run_rank(case, b, rank, world, cache, table, check=True)
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError("ranks that disagree on context_lens were not detected")
    culprit = f"rank {world - 1} differs from rank 0" if world > 1 else ""
    assert culprit in message and "context_lens checksum" in message, message
    # The group still works: the check's one collective lined up on every rank.
    run_rank(case, make_batch(case, world), rank, world, cache, table, check=True)
    return {"case": "disagreement", "message": message}


def check_compiled(rank: int, world: int, backend: str, fp8: bool = False) -> dict:
    """torch.compile(fullgraph=True) of a device-form step, planning inside the graph, vs eager
    (``fp8``: from an fp8 cache, whose rows travel as its bytes).

    ``aot_eager`` traces the whole step (Dynamo, functional collectives, functionalization) into one
    graph without Inductor's C++ code generation, which takes minutes on a loaded 2-core machine.
    """
    case = dataclasses.replace(cases(world)["fp8_device_form" if fp8 else "device_form"], max_chunks=2)  # D=2
    b = make_batch(case, world)
    cache, table = shuffled_shard(b, rank, world, case.interleave, case.seed)
    q, weight, heads = rank_inputs(b, rank)
    cp = mla_ops.ContextParallel(check=True)

    def step(q, kv_c, k_pe, cache, weight, qsl, ctx, table):
        plan = mla_ops.plan_prefill(qsl, ctx, table, BLOCK_SIZE, workspace_size=case.workspace_size,
                                    max_chunks=case.max_chunks, absorb_max_query_len=case.absorb_max_query_len,
                                    max_absorbed_tokens=case.max_absorbed_tokens, context_parallel=cp)
        return mla_ops.run_prefill(q, kv_c, k_pe, cache, weight, b["scale"], plan, k_scale=b["k_scale"])

    args = (q, b["kv_c"], b["k_pe"], cache, weight, b["qsl"], b["ctx"], table)
    t0 = time.perf_counter()
    compiled = torch.compile(step, fullgraph=True, backend=backend)(*args)
    seconds = time.perf_counter() - t0
    eager = step(*args)
    err = (compiled.double() - eager.double()).abs().max().item()
    ref_err = (compiled.double() - dense_reference(b)[:, heads]).abs().max().item()
    assert err <= case.tol and ref_err <= case.tol, f"compiled vs eager {err:.3e}, vs dense reference {ref_err:.3e}"
    return {"case": f"compiled_{backend}{'_fp8' if fp8 else ''}", "err": ref_err, "compile_s": round(seconds, 1)}


def run_cases(argv: list[str], run_case) -> int:
    """A worker's life: ``argv`` = RANK WORLD_SIZE STORE_PORT CASE..., a gloo group over the launcher's
    store, ``run_case(name, rank, world) -> dict`` for each case, one ``RESULT {json}`` line each; the
    first failure prints its traceback as the result and exits non-zero (the launcher stops the others)."""
    rank, world, port, names = int(argv[0]), int(argv[1]), int(argv[2]), argv[3:]
    timeout = datetime.timedelta(seconds=90)
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    torch.set_num_threads(1)
    try:
        for name in names:
            try:
                result = {"case": name, **run_case(name, rank, world)}
            except Exception:
                print(f"RESULT {json.dumps({'case': name, 'rank': rank, 'error': traceback.format_exc()})}",
                      flush=True)
                return 1
            print(f"RESULT {json.dumps({**result, 'rank': rank})}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def run_case(name: str, rank: int, world: int) -> dict:
    if name == "rank_0_fails":  # the launcher must stop rank 1, which hangs
        # Rank 0 fails only once rank 1 is past its set-up: a rank still joining the group when its
        # peer exits can fail on its own (exit code 1, seen once in CI), which this case does not test.
        ready = torch.zeros(1)
        if rank == 0:
            dist.recv(ready, src=1)
            raise RuntimeError("rank 0 fails on purpose")
        dist.send(ready, dst=0)
        time.sleep(600)
        return {}
    if name == "disagreement":
        return check_disagreement(rank, world)
    if name.startswith("compiled_"):
        backend = name.removeprefix("compiled_").removesuffix("_fp8")
        return check_compiled(rank, world, backend, fp8=name.endswith("_fp8"))
    return check_case(name, cases(world)[name], rank, world)


def main(argv: list[str]) -> int:
    return run_cases(argv, run_case)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
