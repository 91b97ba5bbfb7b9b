"""The Triton indexer scorer against the torch scorer, chunk by chunk, and the top-k it feeds against the
dense float64 oracle, under Triton's CPU interpreter (TRITON_INTERPRET=1, set by this folder's conftest).

scores [M, W] per index chunk (-inf off the candidates)   topk [T, K] int32
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 set before import", allow_module_level=True)
pytest.importorskip("triton")

import torch  # noqa: E402

from mla_ops._checks import k_scale_tensor  # noqa: E402
from mla_ops.ops.indexer import chunk_scores_reference, index_topk_chunked, slot_tokens  # noqa: E402
from mla_ops.planning.index_schedule import sparse_token_loc  # noqa: E402
from mla_ops.triton.indexer import chunk_scores  # noqa: E402
from tests.support.indexer import POISONS, check_poisoned_topk, check_topk, indexer_batch, poison  # noqa: E402

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
        s = plan.index_schedule
        token_loc = sparse_token_loc(plan.query_start_loc, plan.sparse)
        for i in range(s.max_chunks):
            m, w = s.piece_shapes[i] if s.piece_shapes else (s.tokens, s.rows)
            got, want = (torch.full((m, w), 7.0) for _ in range(2))
            t = slot_tokens(plan.query_start_loc, token_loc, s.token_start.narrow(0, i, 1), s.token_end.narrow(0, i, 1),
                            m, plan.num_tokens)
            chunk = (*batch.args, plan.block_table, plan.query_start_loc, plan.context_lens, s.starts[i],
                     s.cu_seq_lens[i], t, k_scale)
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
        s = plan.index_schedule
        k_scale = k_scale_tensor(batch.k_scale, batch.index_cache)
        token_loc = sparse_token_loc(plan.query_start_loc, plan.sparse)
        for i in range(s.max_chunks):  # NaN in the same places as the torch scorer's
            m, w = s.piece_shapes[i] if s.piece_shapes else (s.tokens, s.rows)
            got_scores, want_scores = (torch.full((m, w), 7.0) for _ in range(2))
            t = slot_tokens(plan.query_start_loc, token_loc, s.token_start.narrow(0, i, 1), s.token_end.narrow(0, i, 1),
                            m, plan.num_tokens)
            chunk = (*batch.args, plan.block_table, plan.query_start_loc, plan.context_lens, s.starts[i],
                     s.cu_seq_lens[i], t, k_scale)
            chunk_scores(*chunk, got_scores)
            chunk_scores_reference(*chunk, want_scores)
            assert torch.equal(torch.isnan(got_scores), torch.isnan(want_scores)), i
            assert torch.equal(torch.isinf(got_scores), torch.isinf(want_scores)), i
