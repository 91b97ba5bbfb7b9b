"""The lightning indexer's top-k (``mla_ops.index_topk``, DESIGN §12) against a dense float64 oracle.

q_index [T, H_I, D_I]   index_weights [T, H_I]   k_index [T, D_I]   index_cache [num_blocks, block_size, D_I]
-> [T, K] int32: per token its K best positions as a set (valid first), then -1

The oracle (tests/support/indexer.py) scores each request's whole causal matrix at once; the op
folds the plan's index chunks. Batches mix sparse requests with contexts over W (several chunks
each), a zero-context sparse request, dense-routed requests (c + q <= K: every candidate) and a
budget of two query tokens per chunk, so chunks split queries too.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import mla_ops
from mla_ops._checks import k_scale_tensor
from tests.support.gpu import DEVICE, needs_cuda
from tests.support.indexer import FP8, POISONS, check_poisoned_topk, check_topk, indexer_batch, poison

OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")

TOPK, WORKSPACE, BUDGET = 6, 16, 32  # M = 2 query tokens per chunk
# Sparse with contexts over W; sparse without context; dense with context; dense without; sparse, one token.
CONTEXTS, QUERIES = [40, 0, 3, 25, 0, 9], [5, 10, 2, 7, 3, 1]


def op_args(batch, plan):
    """The op's arguments as ``index_topk`` passes them."""
    s = plan.index_schedule
    return (*batch.args, plan.block_table, plan.query_start_loc, plan.context_lens, plan.sparse, s.starts,
            s.cu_seq_lens, s.token_start, s.token_end, k_scale_tensor(batch.k_scale, batch.index_cache),
            plan.index_topk, s.rows, s.tokens, [m for m, _ in s.piece_shapes], [w for _, w in s.piece_shapes])


@pytest.mark.parametrize("form, block_size, dtype", [
    ("host", 1, torch.float64), ("device", 16, torch.float64), ("host", 16, torch.float32),
    ("device", 1, torch.float32),
])
def test_matches_the_dense_oracle(form, block_size, dtype):
    batch = indexer_batch(CONTEXTS, QUERIES, TOPK, block_size=block_size, dtype=dtype, seed=block_size)
    plan = batch.plan(TOPK, WORKSPACE, BUDGET, max_chunks=60 if form == "device" else None)
    assert plan.sparse.tolist() == [True, True, False, True, False, True]
    if form == "host":  # chunks split requests and queries, each sized to its requests' rows
        shapes = plan.index_schedule.piece_shapes
        assert len(shapes) > 10 and all(m * w <= BUDGET for m, w in shapes) and {m for m, _ in shapes} > {1, 2}
    else:
        assert not plan.truncated.any() and (plan.index_schedule.token_end == 0).any()  # dead chunks too
    check_topk(mla_ops.index_topk(*batch.args, plan), batch.expected, TOPK)


@pytest.mark.parametrize("form", ["host", "device"])
@pytest.mark.parametrize("query_block", [1, 3])
def test_blocks_scoring_only_the_rows_their_tokens_see_match_the_oracle(monkeypatch, form, query_block):
    """The CPU scorer's token blocks (``INDEX_QUERY_BLOCK``) score only the rows from their first request's first
    row to their last candidate: blocks across requests, within one, and past a piece's live slots."""
    from mla_ops.ops import indexer

    monkeypatch.setattr(indexer, "INDEX_QUERY_BLOCK", query_block)
    batch = indexer_batch(CONTEXTS, QUERIES, TOPK, block_size=4, dtype=torch.float64, seed=7)
    for workspace, budget in ((WORKSPACE, BUDGET), (128, 128 * 64)):
        plan = batch.plan(TOPK, workspace, budget, max_chunks=60 if form == "device" else None)
        check_topk(mla_ops.index_topk(*batch.args, plan), batch.expected, TOPK)


def test_one_chunk_for_everything_and_one_token_per_chunk_agree():
    """The fold's bounds: all rows and tokens in one chunk (W, M large), and M = 1 (budget = W)."""
    batch = indexer_batch(CONTEXTS, QUERIES, TOPK, block_size=4, weights_dtype=torch.float32, seed=3)
    wide = batch.plan(TOPK, 128, 128 * 64)
    assert wide.index_schedule.max_chunks == 1
    check_topk(mla_ops.index_topk(*batch.args, wide), batch.expected, TOPK)
    check_topk(mla_ops.index_topk(*batch.args, batch.plan(TOPK, 8, 8)), batch.expected, TOPK)


@pytest.mark.parametrize("tensor_scale", [False, True])
def test_fp8_index_cache_is_dequantized(tensor_scale):
    batch = indexer_batch(CONTEXTS, QUERIES, TOPK, block_size=4, fp8_scale=0.5, seed=4)
    assert batch.index_cache.dtype == FP8
    scale = torch.tensor([0.5]) if tensor_scale else 0.5
    got = mla_ops.index_topk(*batch.args, batch.plan(TOPK, WORKSPACE, BUDGET), k_scale_index=scale)
    check_topk(got, batch.expected, TOPK)


@pytest.mark.parametrize("kind", POISONS)
@pytest.mark.parametrize("request_", [0, 3, 2])  # sparse with a long context, sparse, dense-routed
@pytest.mark.parametrize("form", ["host", "device"])
def test_a_non_finite_input_marks_the_tokens_it_reaches_and_the_row_format_holds(kind, request_, form):
    """A NaN or inf in a token's index query or weights, or in a key it sees: that token's ranking is undefined,
    so its row is all -2 (sparse_attention makes its output NaN). Never -1 before valid positions, never a
    finite selection made from NaN scores; the other tokens' rows are unchanged."""
    batch = indexer_batch(CONTEXTS, QUERIES, TOPK, block_size=4, seed=11)
    if kind == "cache key nan" and CONTEXTS[request_] == 0:
        pytest.skip("no context")
    reached = poison(batch, kind, request_)
    plan = batch.plan(TOPK, WORKSPACE, BUDGET, max_chunks=60 if form == "device" else None)
    check_poisoned_topk(mla_ops.index_topk(*batch.args, plan), batch, TOPK, plan.sparse.tolist(), reached, request_)


def test_padding_tokens_get_no_candidates():
    """T past query_start_loc[-1] (a device plan inside a graph allows it; here the op itself): -1 rows,
    and the padding rows (NaN) are never read."""
    batch = indexer_batch(CONTEXTS, QUERIES, TOPK, block_size=4, pad_tokens=3, seed=5)
    plan = batch.plan(TOPK, WORKSPACE, BUDGET, max_chunks=60)
    check_topk(torch.ops.mla_ops.index_topk(*op_args(batch, plan)), batch.expected, TOPK)


def test_a_truncated_device_plan_keeps_the_other_requests_exact():
    batch = indexer_batch(CONTEXTS, QUERIES, TOPK, block_size=4, seed=6)
    plan = batch.plan(TOPK, WORKSPACE, BUDGET, max_chunks=8)
    truncated = plan.index_schedule.truncated.tolist()
    assert any(truncated) and not all(truncated)
    got = mla_ops.index_topk(*batch.args, plan)
    qsl, ctx = plan.query_start_loc.tolist(), plan.context_lens.tolist()
    exact = [t for r in range(len(ctx)) if not truncated[r] for t in range(qsl[r], qsl[r + 1])]
    check_topk(got, batch.expected, TOPK, exact)
    for r in range(len(ctx)):  # truncated: whatever comes out, but positions of the request
        rows = got[qsl[r] : qsl[r + 1]]
        assert ((rows >= -1) & (rows <= ctx[r] + torch.arange(rows.shape[0]).unsqueeze(1))).all()


def test_a_step_without_new_tokens():
    batch = indexer_batch([9, 4], [0, 0], TOPK, block_size=4)
    got = mla_ops.index_topk(*batch.args, batch.plan(TOPK, WORKSPACE, BUDGET))
    assert got.shape == (0, TOPK) and got.dtype == torch.int32


def test_opcheck():
    batch = indexer_batch([12, 0, 2], [3, 8, 2], TOPK, block_size=4, seed=7)
    for max_chunks in (None, 12):
        args = op_args(batch, batch.plan(TOPK, WORKSPACE, BUDGET, max_chunks=max_chunks))
        torch.library.opcheck(torch.ops.mla_ops.index_topk.default, args, test_utils=OPCHECK_UTILS)


def compile_inputs(context_lens, query_lens, seed, pad_tokens=0):
    """A batch on the runner's fixed buffers: the cache and the block table's width are static, T and B
    dynamic (both >= 2: sizes 0 and 1 specialise)."""
    batch = indexer_batch(context_lens, query_lens, TOPK, block_size=4, pad_tokens=pad_tokens, seed=seed)
    cache = torch.full((24, 4, 16), float("nan"))
    cache[: batch.index_cache.shape[0]] = batch.index_cache
    table = torch.zeros(len(context_lens), 12, dtype=torch.int32)
    table[:, : batch.block_table.shape[1]] = batch.block_table
    args = (*batch.args[:3], cache, table, batch.query_start_loc, batch.context_lens)
    for t, dims in zip(args, [(1, 2), (1,), (1,), (0, 1, 2), (1,), (), ()]):
        for d in dims:
            torch._dynamo.mark_static(t, d)
    return args, batch.expected


def indexer_step(q_index, index_weights, k_index, index_cache, block_table, query_start_loc, context_lens):
    plan = mla_ops.plan_prefill(query_start_loc, context_lens, block_table, block_size=4, workspace_size=WORKSPACE,
                                max_chunks=48, index_topk=TOPK, index_scores_budget=BUDGET)
    return mla_ops.index_topk(q_index, index_weights, k_index, index_cache, plan)


def test_compiles_with_the_plan_in_the_graph_and_no_recompiles_across_batch_mixes():
    """One graph for both mixes. aot_eager: the op's fake and Dynamo's guards are the point here (the
    planner's Inductor lowering is tests/prefill/test_compile.py's)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(indexer_step, backend=counter, fullgraph=True, dynamic=True)
    mixes = [(([20, 0, 3], [4, 9, 2]), 0), (([7, 30, 0, 2], [3, 2, 5, 3]), 3)]  # the second with padding tokens
    for i, ((context_lens, query_lens), pad) in enumerate(mixes):
        args, expected = compile_inputs(context_lens, query_lens, seed=10 + i, pad_tokens=pad)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            check_topk(compiled(*args), expected, TOPK)
    assert counter.frame_count == 1


BAD_INPUTS = [
    ("plan", lambda a, p: (a, "not a plan"), TypeError, "plan must be a PrefillPlan"),
    ("plan", lambda a, p: (a, mla_ops.plan_prefill(p.query_start_loc, p.context_lens, p.block_table, block_size=4,
                                                   workspace_size=WORKSPACE)), ValueError, "without index_topk"),
    ("q_index", lambda a, p: ((a[0][:, 0], *a[1:]), p), ValueError, "q_index must be 3-D"),
    ("q_index", lambda a, p: ((a[0].int(), *a[1:]), p), TypeError, "q_index must be float16"),
    ("q_index", lambda a, p: ((a[0].to("meta"), *a[1:]), p), ValueError, "q_index must be on cpu"),
    ("index_weights", lambda a, p: ((a[0], a[1][:, :-1], *a[2:]), p), ValueError, r"index_weights must be \[T, H_I\]"),
    ("index_weights", lambda a, p: ((a[0], a[1].half(), *a[2:]), p), TypeError, "index_weights must be float32"),
    ("k_index", lambda a, p: ((*a[:2], a[2][:, :-1], a[3]), p), ValueError, r"k_index must be \[T, D_I\]"),
    ("k_index", lambda a, p: ((*a[:2], a[2].double(), a[3]), p), TypeError, "k_index must have the dtype"),
    ("index_cache", lambda a, p: ((*a[:3], a[3][..., :-1]), p), ValueError, "index_cache rows must be D_I"),
    ("index_cache", lambda a, p: ((*a[:3], a[3].half()), p), TypeError, "index_cache must have the dtype"),
    ("index_cache", lambda a, p: ((*a[:3], a[3][:, :2]), p), ValueError, "index_cache has block_size 2"),
    ("index_cache", lambda a, p: ((*a[:3], a[3][:3]), p), ValueError, "blocks of index_cache"),
    ("k_scale_index", lambda a, p: ((*a[:3], a[3].to(FP8)), p), ValueError, "k_scale_index is required"),
    ("T", lambda a, p: ((a[0][:-1], a[1][:-1], a[2][:-1], a[3]), p), ValueError, "plan was made for T=15"),
]


@pytest.mark.parametrize("name, corrupt, error, match", BAD_INPUTS, ids=[f"{c[0]}-{i}" for i, c in
                                                                         enumerate(BAD_INPUTS)])
def test_bad_input_is_refused_naming_the_argument(name, corrupt, error, match):
    batch = indexer_batch([12, 0, 2], [3, 10, 2], TOPK, block_size=4, seed=8)
    args, plan = corrupt(batch.args, batch.plan(TOPK, WORKSPACE, BUDGET))
    with pytest.raises(error, match=match):
        mla_ops.index_topk(*args, plan)


@pytest.mark.parametrize("scale", [-1.0, float("nan"), torch.tensor([0.5], dtype=torch.float64),
                                   1e-46, 1e39, 1e-40, torch.tensor([1e-40])])  # 0, inf, subnormal in float32
def test_a_bad_k_scale_index_is_refused(scale):
    batch = indexer_batch([12, 0, 2], [3, 10, 2], TOPK, block_size=4, fp8_scale=0.5, seed=8)
    with pytest.raises(ValueError, match="k_scale_index"):
        mla_ops.index_topk(*batch.args, batch.plan(TOPK, WORKSPACE, BUDGET), k_scale_index=scale)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_bf16_on_the_gpu_matches_the_oracle(fp8):
    """The fused Triton score + top-k on CUDA (bf16 dots, fp32 accumulation), both plan forms."""
    batch = indexer_batch(CONTEXTS, QUERIES, TOPK, block_size=16, heads=8, width=64, dtype=torch.bfloat16,
                          fp8_scale=0.5 if fp8 else None, seed=9).to(DEVICE)
    for max_chunks in (None, 60):
        plan = batch.plan(TOPK, WORKSPACE, BUDGET, max_chunks=max_chunks)
        got = mla_ops.index_topk(*batch.args, plan, k_scale_index=batch.k_scale)
        check_topk(got, batch.expected, TOPK)


@pytest.mark.cuda
@needs_cuda
def test_fused_top_k_at_a_production_budget_on_the_gpu():
    """K = 2048 (V3.2's): a running width of 2048 keys per token against 64-row tiles, H_I = 64, D_I = 128;
    a long sparse request split into pieces, a dense-routed one, opcheck on the CUDA kernel."""
    topk = 2048
    batch = indexer_batch([2300, 0, 1500], [24, 16, 600], topk, block_size=64, heads=64, width=128,
                          dtype=torch.bfloat16, seed=11, gap=1e-4).to(DEVICE)
    for max_chunks in (None, 40):
        plan = batch.plan(topk, 1024, 2**16, max_chunks=max_chunks)
        check_topk(mla_ops.index_topk(*batch.args, plan), batch.expected, topk)
    torch.library.opcheck(torch.ops.mla_ops.index_topk.default, op_args(batch, plan), test_utils=OPCHECK_UTILS)
