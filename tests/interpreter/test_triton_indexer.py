"""The Triton indexer scorer against the torch scorer, chunk by chunk, and the top-k it feeds against the
dense float64 oracle, under Triton's CPU interpreter (TRITON_INTERPRET=1, set by this folder's conftest);
then the fused score + running top-k kernel (the op's CUDA path) against the same oracle.

scores [M, W] per index chunk (-inf off the candidates)   topk [T, K] int32
running keys [T, K_PAD] int64 (the fused kernel's top-k so far, sorted descending)
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 set before import", allow_module_level=True)
pytest.importorskip("triton")

import torch  # noqa: E402

from mla_ops._checks import k_scale_tensor  # noqa: E402
from mla_ops.ops.indexer import (chunk_scores_reference, index_topk_chunked, index_topk_fused,  # noqa: E402
                                  slot_tokens)
from mla_ops.planning.index_schedule import sparse_token_loc  # noqa: E402
from mla_ops.triton.indexer import chunk_scores, fold_piece_topk, key_positions, running_keys  # noqa: E402
from tests.interpreter.test_triton_cache_formats import pack_per_token, per_token_round_trip  # noqa: E402
from tests.support.indexer import (POISONS, check_poisoned_topk, check_topk, indexer_batch, plan_chunks,  # noqa: E402
                                   poison)

TOPK, WORKSPACE, BUDGET = 6, 16, 32  # M = 2 query tokens per chunk
CONTEXTS, QUERIES = [21, 0, 3, 9], [3, 7, 2, 1]  # several chunks, a zero context, a dense request


def op_args(batch, plan):
    s = plan.index_schedule
    return (*batch.args, plan.block_table, plan.query_start_loc, plan.context_lens, plan.sparse, s.starts,
            s.cu_seq_lens, s.token_start, s.token_end, k_scale_tensor(batch.k_scale, batch.index_cache),
            plan.index_topk, s.rows, s.tokens, [m for m, _ in s.piece_shapes], [w for _, w in s.piece_shapes])


@pytest.mark.parametrize("dtype, block_size, fp8", [(torch.float32, 1, False), (torch.float16, 4, False),
                                                    (torch.float16, 4, True)])
def test_chunk_scores_match_the_torch_scorer(dtype, block_size, fp8):
    batch = indexer_batch(CONTEXTS, QUERIES, TOPK, block_size=block_size, width=20, dtype=dtype,
                          fp8_scale=0.5 if fp8 else None, seed=1)
    k_scale = k_scale_tensor(batch.k_scale, batch.index_cache)
    for max_chunks in (None, 24):  # the host form's tiles sized per piece; the device form's [M, W], dead slots
        plan = batch.plan(TOPK, WORKSPACE, BUDGET, max_chunks=max_chunks)
        for i, m, w, chunk in plan_chunks(batch.args, plan, k_scale):
            got, want = (torch.full((m, w), 7.0) for _ in range(2))
            chunk_scores(*chunk, got)
            chunk_scores_reference(*chunk, want)
            assert torch.equal(torch.isinf(got), torch.isinf(want)), i
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_top_k_on_the_triton_scorer_matches_the_oracle_in_both_plan_forms():
    batch = indexer_batch(CONTEXTS, QUERIES, TOPK, block_size=4, seed=2)
    for max_chunks in (None, 24):
        plan = batch.plan(TOPK, WORKSPACE, BUDGET, max_chunks=max_chunks)
        check_topk(index_topk_chunked(chunk_scores, *op_args(batch, plan)), batch.expected, TOPK)


@pytest.mark.parametrize("kind", POISONS)
def test_non_finite_inputs_mark_the_tokens_they_reach_on_the_triton_scorer(kind):
    """A candidate's non-finite score is NaN in the Triton scorer too (an inf would rank, a -inf would pass for
    the mask), so the fold marks the token: a row of -2, the other rows as the oracle's."""
    batch = indexer_batch(CONTEXTS, QUERIES, TOPK, block_size=4, seed=5)
    reached = poison(batch, kind, 0)  # request 0: sparse, with context over W
    for max_chunks in (None, 24):
        plan = batch.plan(TOPK, WORKSPACE, BUDGET, max_chunks=max_chunks)
        got = index_topk_chunked(chunk_scores, *op_args(batch, plan))
        check_poisoned_topk(got, batch, TOPK, plan.sparse.tolist(), reached, 0)
        k_scale = k_scale_tensor(batch.k_scale, batch.index_cache)
        for i, m, w, chunk in plan_chunks(batch.args, plan, k_scale):  # NaN where the torch scorer has NaN
            got_scores, want_scores = (torch.full((m, w), 7.0) for _ in range(2))
            chunk_scores(*chunk, got_scores)
            chunk_scores_reference(*chunk, want_scores)
            assert torch.equal(torch.isnan(got_scores), torch.isnan(want_scores)), i
            assert torch.equal(torch.isinf(got_scores), torch.isinf(want_scores)), i


# The fused kernel at DeepSeek-V3.2's indexer scaled down (H_I = 64, D_I = 128, K = 2048 there): several pieces
# and row tiles per piece, two sparse requests, two dense-routed ones (never scored).
HEADS, WIDTH = 4, 32
FUSED_CONTEXTS, FUSED_QUERIES = [70, 0, 3, 40], [3, 7, 2, 5]


def fused_batch(topk, seed, dtype=torch.float32, fp8=False, stored=None, width=WIDTH):
    return indexer_batch(FUSED_CONTEXTS, FUSED_QUERIES, topk, block_size=4, heads=HEADS, width=width, dtype=dtype,
                         fp8_scale=0.5 if fp8 else None, seed=seed, stored=stored)


@pytest.mark.parametrize("topk, workspace, budget", [(8, 16, 32), (32, 64, 256), (16, 64, 128), (32, 16, 64)])
def test_fused_top_k_matches_the_oracle_in_both_plan_forms(topk, workspace, budget):
    """K below, at and above W; pieces split along their queries; the device form's dead slots."""
    batch = fused_batch(topk, seed=topk + workspace)
    for max_chunks in (None, 40):
        plan = batch.plan(topk, workspace, budget, max_chunks=max_chunks)
        assert plan.index_schedule.max_chunks > 2
        check_topk(index_topk_fused(*op_args(batch, plan)), batch.expected, topk)


def test_fused_top_k_merges_row_tiles_into_a_wider_running_top_k():
    """K = 100: a running width of 128 keys (K_PAD) against 64-row tiles, of which only the K best are read."""
    topk = 100
    batch = indexer_batch([230, 0, 3, 120], [3, 7, 2, 4], topk, block_size=8, heads=HEADS, width=WIDTH, seed=12)
    for max_chunks in (None, 12):
        plan = batch.plan(topk, 128, 1024, max_chunks=max_chunks)
        check_topk(index_topk_fused(*op_args(batch, plan)), batch.expected, topk)


@pytest.mark.parametrize("dtype, fp8", [(torch.float16, False), (torch.bfloat16, False), (torch.float16, True),
                                        (torch.bfloat16, True)])
def test_fused_top_k_reads_16_bit_and_fp8_caches(dtype, fp8):
    batch = fused_batch(16, seed=3, dtype=dtype, fp8=fp8)
    for max_chunks in (None, 40):
        plan = batch.plan(16, 32, 64, max_chunks=max_chunks)
        check_topk(index_topk_fused(*op_args(batch, plan)), batch.expected, 16)


@pytest.mark.parametrize("width", [128, 256])  # D_I: a float32 scale per 128 values
def test_fused_top_k_reads_fp8_per_token_keys(width):
    batch = fused_batch(16, seed=4, dtype=torch.float16, stored=per_token_round_trip, width=width)
    packed = pack_per_token(batch.index_cache.float())
    for max_chunks in (None, 40):
        plan = batch.plan(16, 32, 64, max_chunks=max_chunks)
        args = list(op_args(batch, plan))
        args[3], args[12] = packed, None  # the packed cache holds its own scales
        check_topk(index_topk_fused(*args), batch.expected, 16)


def test_a_dead_slot_tile_writes_nothing():
    """The device form's pieces past the step: every slot dead, the launch exits before scoring or merging."""
    batch = fused_batch(8, seed=6)
    plan = batch.plan(8, 16, 32, max_chunks=40)
    s = plan.index_schedule
    last = s.max_chunks - 1
    assert int(s.token_start[last]) == int(s.token_end[last])  # a dead piece
    t = slot_tokens(plan.query_start_loc, sparse_token_loc(plan.query_start_loc, plan.sparse),
                    s.token_start.narrow(0, last, 1), s.token_end.narrow(0, last, 1), s.tokens, plan.num_tokens)
    assert bool((t == plan.num_tokens).all())
    best = running_keys(plan.num_tokens, 8, "cpu").random_()  # any contents: none may change
    not_finite = torch.full((plan.num_tokens,), 5, dtype=torch.int32)
    before = best.clone()
    fold_piece_topk(*batch.args, plan.block_table, plan.query_start_loc, plan.context_lens, s.starts[last],
                    s.cu_seq_lens[last], t, None, best, not_finite)
    assert torch.equal(best, before) and bool((not_finite == 5).all())


def test_fused_ties_keep_the_lower_positions():
    """Equal scores (repeated keys) rank the lower position first, across pieces and row tiles; any top-k rule
    must hold the higher scores, and this one is deterministic."""
    topk = 8
    batch = fused_batch(topk, seed=7)
    g = torch.Generator().manual_seed(7)
    distinct = torch.randn(3, WIDTH, generator=g)
    r = 0  # sparse, 70 context keys and 3 new ones: each key one of three vectors
    for p in range(FUSED_CONTEXTS[r]):
        batch.index_cache[batch.block_table[r, p // 4], p % 4] = distinct[p % 3]
    first = int(batch.query_start_loc[r])
    for j in range(FUSED_QUERIES[r]):
        batch.k_index[first + j] = distinct[(FUSED_CONTEXTS[r] + j) % 3]
    for j in range(FUSED_QUERIES[r]):  # rank (score descending, position ascending), in float64
        t, candidates = first + j, FUSED_CONTEXTS[r] + j + 1
        scores = (batch.index_weights[t].double().unsqueeze(1)
                  * torch.relu(batch.q_index[t].double() @ distinct.double().T)).sum(0)
        assert (scores.unsqueeze(0) - scores.unsqueeze(1)).abs().add(torch.eye(3)).min() > 1e-3  # 3 distinct
        order = sorted(range(candidates), key=lambda p: (-scores[p % 3].item(), p))
        batch.expected[t] = sorted(order[:topk])
    for max_chunks in (None, 40):
        plan = batch.plan(topk, 16, 32, max_chunks=max_chunks)
        got = index_topk_fused(*op_args(batch, plan))
        check_topk(got, batch.expected, topk)


@pytest.mark.parametrize("kind", POISONS)
def test_non_finite_inputs_mark_the_tokens_they_reach_on_the_fused_kernel(kind):
    batch = fused_batch(8, seed=5)
    reached = poison(batch, kind, 0)  # request 0: sparse, with context over W
    for max_chunks in (None, 40):
        plan = batch.plan(8, 16, 32, max_chunks=max_chunks)
        got = index_topk_fused(*op_args(batch, plan))
        check_poisoned_topk(got, batch, 8, plan.sparse.tolist(), reached, 0)


def test_running_keys_decode_to_positions():
    """The fold's identity decodes to -1, and only the first K columns are read."""
    best = running_keys(2, 5, "cpu")
    assert best.shape == (2, 16)
    assert torch.equal(key_positions(best, 5), torch.full((2, 5), -1))
