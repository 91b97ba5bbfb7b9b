"""Non-finite inputs through the Triton kernels (interpreter), as ``tests/prefill/test_non_finite.py`` checks
the torch ops: a NaN or inf in a token's ``q`` (or in a cached key) makes the (token, head) rows that see it
NaN, out and lse, through the suffix, the chunk loop and its merges, the absorbed path and sparse attention,
host and device plans; every other (token, head) equals the torch backend. The merge kernel keeps a NaN
partial NaN.
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (make test does)", allow_module_level=True)
pytest.importorskip("triton")

import mla_ops  # noqa: E402
from mla_ops.triton.merge import merge_attn_states  # noqa: E402
from tests.support.batches import make_batch  # noqa: E402
from tests.support.sparse import random_topk  # noqa: E402

CONTEXTS, QUERIES = [0, 13, 5, 0, 9, 2], [3, 4, 2, 3, 1, 5]  # 0, 3: no context; 1: several chunks
BLOCK, WORKSPACE = 4, 4
VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
PATHS = {"chunk loop": dict(absorb_max_query_len=0), "absorbed": dict(absorb_max_query_len=64)}
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN and inf, in the interpreter


def run_both(batch, q, cache, plan, **kwargs):
    """(triton, torch) ``(out, lse)`` of one step."""
    return [mla_ops.run_prefill(q, batch.kv_c, batch.k_pe, cache, batch.kv_b_proj_weight, batch.softmax_scale, plan,
                                backend=backend, return_lse=True, **kwargs) for backend in ("triton", "torch")]


def check(got, want, reached):
    (out, lse), (want_out, want_lse) = got, want
    assert torch.equal(out.isnan().any(-1), reached) and out[reached].isnan().all()
    assert torch.equal(lse.t().isnan(), reached)
    assert torch.equal(want_out.isnan().any(-1), reached) and torch.equal(want_lse.t().isnan(), reached)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4, equal_nan=True)
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("form", ["host", "device"])
def test_a_non_finite_query_gives_nan_in_its_token_and_head_only(form, path, value):
    batch = make_batch(CONTEXTS, QUERIES, seed=1, block_size=BLOCK, dtype=torch.float32)
    q = batch.q.clone()
    reached = torch.zeros(q.shape[0], q.shape[1], dtype=torch.bool)
    for t, h in [(1, 0), (4, 1), (6, 0), (6, 1), (17, 1)]:  # no context, chunked, short context
        q[t, h, 2] = VALUES[value]
        reached[t, h] = True
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=BLOCK,
                                workspace_size=WORKSPACE, max_chunks=12 if form == "device" else None, **PATHS[path])
    check(*run_both(batch, q, batch.kv_cache, plan), reached)


@pytest.mark.parametrize("value", ["nan", "-inf"])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_non_finite_cached_key_gives_nan_in_every_token_that_sees_it(path, value):
    batch = make_batch(CONTEXTS, QUERIES, seed=2, block_size=BLOCK, dtype=torch.float32)
    cache = batch.kv_cache.clone()
    cache[batch.block_table[1, 6 // BLOCK], 6 % BLOCK, 3] = VALUES[value]  # request 1's context position 6
    reached = torch.zeros(batch.q.shape[0], batch.q.shape[1], dtype=torch.bool)
    reached[3:7] = True
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=BLOCK,
                                workspace_size=WORKSPACE, max_chunks=12, **PATHS[path])
    check(*run_both(batch, batch.q, cache, plan), reached)


@pytest.mark.parametrize("value", list(VALUES))
def test_a_non_finite_query_of_a_sparse_token_gives_nan_in_its_token_and_head_only(value):
    batch = make_batch(CONTEXTS, QUERIES, seed=3, block_size=BLOCK, dtype=torch.float32)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=BLOCK,
                                workspace_size=WORKSPACE, absorb_max_query_len=0, index_topk=8,
                                index_scores_budget=32)
    assert plan.sparse.tolist() == [False, True, False, False, True, False]
    topk = random_topk(CONTEXTS, QUERIES, 8, seed=4, sparse=plan.sparse.tolist(), empty=0.0)
    topk[5] = -1  # request 1's third token selects nothing: the empty partial
    q = batch.q.clone()
    reached = torch.zeros(q.shape[0], q.shape[1], dtype=torch.bool)
    for t, h in [(4, 1), (6, 0), (12, 0), (1, 1)]:  # request 1, request 4 (sparse), request 0 (dense)
        q[t, h, 5] = VALUES[value]
        reached[t, h] = True
    got, want = run_both(batch, q, batch.kv_cache, plan, topk_indices=topk)
    check(got, want, reached)
    assert (got[0][5] == 0).all() and (got[1][:, 5] == float("-inf")).all()


@pytest.mark.parametrize("value", list(VALUES))
def test_a_non_finite_selected_key_gives_nan_in_the_sparse_tokens_that_select_it(value):
    """A NaN or inf in a cached row that sparse token 3 selects among finite ones, token 4 not."""
    batch = make_batch(CONTEXTS, QUERIES, seed=6, block_size=BLOCK, dtype=torch.float32)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=BLOCK,
                                workspace_size=WORKSPACE, absorb_max_query_len=0, index_topk=8,
                                index_scores_budget=32, max_chunks=12)
    topk = random_topk(CONTEXTS, QUERIES, 8, seed=7, sparse=plan.sparse.tolist(), empty=0.0)
    topk[3, :3] = torch.tensor([6, 0, 1], dtype=torch.int32)
    topk[4] = torch.where(topk[4] == 6, -1, topk[4])
    cache = batch.kv_cache.clone()
    cache[batch.block_table[1, 6 // BLOCK], 6 % BLOCK, 1] = VALUES[value]
    reached = torch.zeros(batch.q.shape[0], batch.q.shape[1], dtype=torch.bool)
    reached[3:7] = (topk[3:7] == 6).any(1, keepdim=True)
    assert reached[3].all() and not reached[4].any()
    check(*run_both(batch, batch.q, cache, plan, topk_indices=topk), reached)


def test_merge_keeps_a_nan_partial_nan():
    """A NaN partial (lse NaN, out NaN) merged with a finite one, an empty one or another NaN one: NaN, out and
    lse; two empty partials still give 0 / -inf."""
    nan, inf = float("nan"), float("inf")
    pairs = [(nan, 1.0), (2.0, nan), (nan, -inf), (inf, nan), (nan, nan), (-inf, -inf), (0.5, 1.5)]
    prefix_lse = torch.tensor([[a for a, _ in pairs]])
    suffix_lse = torch.tensor([[b for _, b in pairs]])
    prefix_out, suffix_out = torch.randn(len(pairs), 1, 8), torch.randn(len(pairs), 1, 8)
    prefix_out[prefix_lse[0].isnan()] = nan
    suffix_out[suffix_lse[0].isnan()] = nan
    out, lse = merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse)
    poisoned = torch.tensor([True] * 5 + [False] * 2)
    assert out[poisoned].isnan().all() and lse[0, poisoned].isnan().all()
    assert (out[5] == 0).all() and lse[0, 5] == -inf and not out[6].isnan().any() and torch.isfinite(lse[0, 6])
