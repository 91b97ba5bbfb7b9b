"""The Triton sparse attention launcher (DSA) against its torch oracle, under Triton's CPU interpreter
(this directory is its own pytest run, with TRITON_INTERPRET=1 set before import).

q [T, N, P+R]   kv_c [T, L]   k_pe [T, R]   kv_cache [num_blocks, block_size, L+R]
sparse [B] bool   topk_indices [T, K] int32 (-1 pads)
-> out [T, N, V], lse [N, T]; rows of dense requests' tokens stay untouched (NaN sentinels).

Tiny dims (N=3, L=32, R=8, P=V=8), K = 20 selected positions: the interpreter's tiles (16 heads, 16
keys, 16-wide value slices) still cover two key tiles (the second partly masked), two value slices,
rows from the cache and from the new tokens in one tile, and tiles without a valid key. The cache is
NaN outside the context rows, so a load that is not masked out shows.
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 set before import", allow_module_level=True)
pytest.importorskip("triton")

import torch  # noqa: E402

from mla_ops.ops.sparse import sparse_reference  # noqa: E402
from mla_ops.triton import _common  # noqa: E402
from mla_ops.triton.sparse import sparse_attention  # noqa: E402
from tests.support.batches import context_batch  # noqa: E402
from tests.support.sparse import random_topk  # noqa: E402

SMALL = dict(N=3, L=32, R=8, P=8, V=8)
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}  # bf16: upcast to fp32 here
# Zero context with queries, a long context, a request without queries, a dense request.
CONTEXTS, QUERIES = [5, 0, 40, 3, 19, 2], [1, 6, 3, 0, 2, 4]
SPARSE = [True, True, True, True, False, True]
K = 20


def args_of(batch, topk, sparse=SPARSE):
    return (batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.block_table, batch.query_start_loc,
            batch.context_lens, torch.tensor(sparse), topk, batch.kv_b_proj_weight, batch.softmax_scale,
            batch.absorbed_args()[-1])


def check(batch, dtype, topk=None, sparse=SPARSE):
    if topk is None:
        topk = random_topk(CONTEXTS, QUERIES, K, seed=1, sparse=sparse, future=True)
    got, got_lse = batch.sentinels(SMALL["V"], dtype=dtype)
    want, want_lse = batch.sentinels(SMALL["V"], dtype=torch.float32)
    sparse_attention(*args_of(batch, topk, sparse), got, got_lse)
    sparse_reference(*args_of(batch, topk, sparse), want, want_lse)
    rows = torch.repeat_interleave(torch.tensor(sparse), (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).long())
    assert torch.isnan(got[~rows]).all() and torch.isnan(got_lse[:, ~rows]).all(), "dense requests' rows touched"
    assert not torch.isnan(got[rows]).any() and not torch.isnan(got_lse[:, rows]).any()
    torch.testing.assert_close(got[rows].float(), want[rows], atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got_lse[:, rows], want_lse[:, rows], atol=TOL[dtype] * 4, rtol=0)  # -inf where empty
    return got, got_lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_matches_reference(block_size, dtype):
    check(context_batch(CONTEXTS, QUERIES, block_size=block_size, dtype=dtype, seed=block_size, **SMALL), dtype)


def test_fp8_cache_mixed_with_new_rows():
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, fp8_scale=0.25, **SMALL)
    check(batch, torch.float32)


def test_bfloat16():
    check(context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.bfloat16, seed=2, **SMALL), torch.bfloat16)


def test_strided_programs_many_head_groups_and_negative_scale(monkeypatch):
    # 20 heads: two head groups, the second mostly masked; 2 programs stride over every item.
    monkeypatch.setattr(_common, "PROGRAMS_OVERRIDE", 2)
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, seed=3, **dict(SMALL, N=20))
    batch.softmax_scale = -0.7  # masked keys must stay out whatever the scale's sign
    check(batch, torch.float32)


def test_nothing_sparse_writes_nothing_and_empty_selections():
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, seed=6, **SMALL)
    topk = random_topk(CONTEXTS, QUERIES, K, seed=6)
    out, lse = batch.sentinels(SMALL["V"])
    sparse_attention(*args_of(batch, topk, [False] * 6), out, lse)
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    got, got_lse = check(batch, torch.float32, topk=torch.full_like(topk, -1))  # the empty partial: 0 / -inf
    rows = ~torch.isnan(got[:, 0, 0])
    assert (got[rows] == 0).all() and (got_lse[:, rows] == float("-inf")).all()


def test_a_row_marked_without_a_finite_selection_comes_out_nan():
    """-2 in a row (index_topk: the token's scores were not finite): NaN out and lse, as the reference; every
    other token equal to the reference."""
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, seed=7, **SMALL)
    topk = random_topk(CONTEXTS, QUERIES, K, seed=7, sparse=SPARSE)
    topk[8] = -2  # request 2, the whole row
    topk[2, K - 1] = -2  # request 1, its last entry (past the first key tile)
    got, got_lse = batch.sentinels(SMALL["V"])
    want, want_lse = batch.sentinels(SMALL["V"])
    sparse_attention(*args_of(batch, topk), got, got_lse)
    sparse_reference(*args_of(batch, topk), want, want_lse)
    marked = torch.zeros(got.shape[0], dtype=torch.bool)
    marked[[2, 8]] = True
    assert torch.isnan(got[marked]).all() and torch.isnan(got_lse[:, marked]).all()
    assert torch.isnan(want[marked]).all() and torch.isnan(want_lse[:, marked]).all()
    torch.testing.assert_close(got[~marked], want[~marked], atol=TOL[torch.float32], rtol=TOL[torch.float32],
                               equal_nan=True)
    assert not torch.isnan(got[~marked & ~torch.isnan(want[:, 0, 0])]).any()
