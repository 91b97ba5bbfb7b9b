"""A non-finite input never becomes a finite answer (docs/limitations.md): a NaN or inf in a token's ``q``
makes that (token, head) NaN, out and lse, and a NaN or inf in a cached key makes every (token, head) that
sees it NaN, on every path (the suffix of a request without context, the chunk loop over several chunks and
their continuations, the absorbed path, sparse attention), host and device plans; a row that sees no key
still gets the empty partial. Every other (token, head) equals the dense float64 reference.
"""

import pytest
import torch

import mla_ops
from tests.support.batches import TOL, dense_reference, make_batch
from tests.support.sparse import masked_reference, random_topk

# Requests 0 and 3 have no context (suffix only); 1 (context 13) spans several 4-row chunks, with continuations.
CONTEXTS, QUERIES = [0, 13, 5, 0, 9, 2], [3, 4, 2, 3, 1, 5]
BLOCK, WORKSPACE = 4, 4
# (token, head) pairs poisoned in q: request 0 (no context), request 1 (chunked), request 5 (short context).
POISONED_Q = [(1, 0), (4, 1), (6, 0), (6, 1), (17, 1)]
VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
PATHS = {"chunk loop": dict(absorb_max_query_len=0), "absorbed": dict(absorb_max_query_len=64)}
# A sparse request's two routes (masked_mha_ratio): absorbed sparse attention, top-k-masked MHA.
ROUTES = {"sparse": 0.0, "masked MHA": float("inf")}


def plan_for(batch, form, path, **kwargs):
    return mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=BLOCK,
                                workspace_size=WORKSPACE, max_chunks=12 if form == "device" else None,
                                **PATHS[path], **kwargs)


def check(out, lse, reached, want_out, want_lse, dtype):
    """``reached`` [T, N]: NaN there (every value of out, and lse), the reference elsewhere (finite)."""
    assert torch.equal(out.isnan().any(-1), reached) and out[reached].isnan().all(), "NaN where a score was not finite"
    assert torch.equal(lse.t().isnan(), reached)
    torch.testing.assert_close(out[~reached].double(), want_out[~reached], rtol=0, atol=TOL[dtype] * 10)
    torch.testing.assert_close(lse.t()[~reached].double(), want_lse.t()[~reached], rtol=0, atol=TOL[dtype] * 10)


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("form", ["host", "device"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_non_finite_query_gives_nan_in_its_token_and_head_only(dtype, form, path, value):
    batch = make_batch(CONTEXTS, QUERIES, seed=1, block_size=BLOCK, dtype=dtype)
    want_out, want_lse = dense_reference(*batch.args(), return_lse=True)
    q = batch.q.clone()
    reached = torch.zeros(q.shape[0], q.shape[1], dtype=torch.bool)
    for t, h in POISONED_Q:
        q[t, h, 2] = VALUES[value]
        reached[t, h] = True
    plan = plan_for(batch, form, path)
    out, lse = mla_ops.run_prefill(q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight,
                                   batch.softmax_scale, plan, backend="torch", return_lse=True)
    check(out, lse, reached, want_out, want_lse, dtype)
    once = mla_ops.mla_prefill(q, *batch.args()[1:], workspace_size=WORKSPACE, backend="torch", **PATHS[path])
    assert torch.equal(once.isnan().any(-1), reached)


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("form", ["host", "device"])
def test_a_non_finite_cached_key_gives_nan_in_every_token_that_sees_it(form, path, value):
    """Context position 6 of request 1 (its second chunk): all of request 1's tokens see it, in every head."""
    dtype = torch.float32
    batch = make_batch(CONTEXTS, QUERIES, seed=2, block_size=BLOCK, dtype=dtype)
    want_out, want_lse = dense_reference(*batch.args(), return_lse=True)
    cache = batch.kv_cache.clone()
    cache[batch.block_table[1, 6 // BLOCK], 6 % BLOCK, 3] = VALUES[value]
    reached = torch.zeros(batch.q.shape[0], batch.q.shape[1], dtype=torch.bool)
    reached[3:7] = True  # request 1's tokens
    out, lse = mla_ops.run_prefill(batch.q, batch.kv_c, batch.k_pe, cache, batch.kv_b_proj_weight, batch.softmax_scale,
                                   plan_for(batch, form, path), backend="torch", return_lse=True)
    check(out, lse, reached, want_out, want_lse, dtype)


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("form", ["host", "device"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_non_finite_query_of_a_sparse_token_gives_nan_in_its_token_and_head_only(dtype, form, value, route):
    """DSA: requests 1 and 4 (c_r + q_r > 8) are sparse; a poisoned query there goes through sparse attention."""
    batch = make_batch(CONTEXTS, QUERIES, seed=3, block_size=BLOCK, dtype=dtype)
    plan = plan_for(batch, form, "chunk loop", index_topk=8, index_scores_budget=32, masked_mha_ratio=ROUTES[route])
    assert plan.sparse.tolist() == [False, True, False, False, True, False]
    topk = random_topk(CONTEXTS, QUERIES, 8, seed=4, sparse=plan.sparse.tolist(), empty=0.0)
    sparse_out, sparse_lse, rows = masked_reference(batch, topk, plan.sparse)
    dense_out, dense_lse = dense_reference(*batch.args(), return_lse=True)
    want_out = torch.where(rows[:, None, None], sparse_out, dense_out)
    want_lse = torch.where(rows, sparse_lse, dense_lse)
    q = batch.q.clone()
    reached = torch.zeros(q.shape[0], q.shape[1], dtype=torch.bool)
    for t, h in [(4, 1), (5, 0), (5, 1), (12, 0), (1, 1)]:  # request 1, request 4 (sparse), request 0 (dense)
        q[t, h, 5] = VALUES[value]
        reached[t, h] = True
    out, lse = mla_ops.run_prefill(q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight,
                                   batch.softmax_scale, plan, backend="torch", topk_indices=topk, return_lse=True)
    check(out, lse, reached, want_out, want_lse, dtype)


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_row_without_keys_keeps_the_empty_partial(route):
    """The suffix alone (no context anywhere) and a sparse token that selects nothing: 0 / -inf, never NaN."""
    from mla_ops.ops.attention import varlen_attention_reference

    cu = torch.tensor([0, 3], dtype=torch.int32)
    keys = torch.tensor([0, 1], dtype=torch.int32)  # causal, bottom-right: 3 queries over 1 key, query 0 sees none
    q, k_nope, k_pe, v = torch.randn(3, 2, 6), torch.randn(1, 2, 4), torch.randn(1, 2), torch.randn(1, 2, 5)
    out, lse = varlen_attention_reference(q, k_nope, k_pe, v, cu, keys, 0.5, causal=True)
    assert (out[0] == 0).all() and (lse[:, 0] == float("-inf")).all() and not out.isnan().any()
    batch = make_batch(CONTEXTS, QUERIES, seed=5, block_size=BLOCK)
    plan = plan_for(batch, "host", "chunk loop", index_topk=8, index_scores_budget=32, masked_mha_ratio=ROUTES[route])
    topk = random_topk(CONTEXTS, QUERIES, 8, seed=5, sparse=plan.sparse.tolist(), empty=0.0)
    topk[4] = -1  # request 1's second token selects no key
    out, lse = mla_ops.run_prefill(*batch.args()[:4], batch.kv_b_proj_weight, batch.softmax_scale, plan,
                                   backend="torch", topk_indices=topk, return_lse=True)
    assert (out[4] == 0).all() and (lse[:, 4] == float("-inf")).all() and not out.isnan().any()


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("form", ["host", "device"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_non_finite_cached_key_gives_nan_in_the_sparse_tokens_that_select_it(form, value, route):
    """A NaN or inf in request 1's context position 6 (a sparse request): exactly the tokens whose top-k row
    selects it come out NaN, in every head; the others, which skip it, equal the masked reference."""
    batch = make_batch(CONTEXTS, QUERIES, seed=6, block_size=BLOCK, dtype=torch.float64)
    plan = plan_for(batch, form, "chunk loop", index_topk=8, index_scores_budget=32, masked_mha_ratio=ROUTES[route])
    topk = random_topk(CONTEXTS, QUERIES, 8, seed=7, sparse=plan.sparse.tolist(), empty=0.0)
    topk[3, :3] = torch.tensor([6, 0, 1], dtype=torch.int32)  # token 3 selects position 6 with finite ones
    topk[4] = torch.where(topk[4] == 6, -1, topk[4])  # token 4 does not
    sparse_out, sparse_lse, rows = masked_reference(batch, topk, plan.sparse)
    dense_out, dense_lse = dense_reference(*batch.args(), return_lse=True)
    want_out = torch.where(rows[:, None, None], sparse_out, dense_out)
    want_lse = torch.where(rows, sparse_lse, dense_lse)
    cache = batch.kv_cache.clone()
    cache[batch.block_table[1, 6 // BLOCK], 6 % BLOCK, 1] = VALUES[value]
    reached = torch.zeros(batch.q.shape[0], batch.q.shape[1], dtype=torch.bool)
    reached[3:7] = (topk[3:7] == 6).any(1, keepdim=True)
    assert reached[3].all() and not reached[4].any()
    out, lse = mla_ops.run_prefill(batch.q, batch.kv_c, batch.k_pe, cache, batch.kv_b_proj_weight,
                                   batch.softmax_scale, plan, backend="torch", topk_indices=topk, return_lse=True)
    check(out, lse, reached, want_out, want_lse, torch.float64)
