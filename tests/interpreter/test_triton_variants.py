"""DESIGN §11's attention variants on the Triton kernels under the interpreter: sliding windows in the attention
(context and suffix), absorbed and sparse kernels against the torch references, and ``run_prefill(backend=
"triton")`` with a window and sinks on every plan form against the float64 oracle (tests/support/batches.py)."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (make test does)", allow_module_level=True)
pytest.importorskip("triton")

import mla_ops  # noqa: E402
from mla_ops.ops.absorbed import absorbed_reference  # noqa: E402
from mla_ops.ops.attention import context_attention_reference, suffix_attention_reference  # noqa: E402
from mla_ops.ops.sparse import sparse_reference  # noqa: E402
from mla_ops.triton import absorbed, attention, sparse  # noqa: E402
from tests.support.batches import context_batch, dense_reference, make_batch, random_varlen  # noqa: E402
from tests.support.sparse import masked_reference, random_topk  # noqa: E402

NAN = float("nan")
TOL = {torch.float32: 2e-5, torch.float16: 1e-2}
LSE_TOL = {torch.float32: 1e-4, torch.float16: 2e-3}  # fp16: the up-projected keys are rounded to fp16


def assert_same(got, want, tol):
    """Equal where finite, NaN sentinels and infinities in the same places."""
    assert torch.equal(got.isnan(), want.isnan()), "NaN sentinels differ (written or left wrongly)"
    assert torch.equal(got.isinf(), want.isinf()), "infinities differ"
    finite = want.isfinite()
    if finite.any():
        assert (got[finite].double() - want[finite].double()).abs().max().item() <= tol


@pytest.mark.parametrize("window", [1, 3, 20])
def test_suffix_kernel_in_a_window(window):
    lens = [1, 35, 18]  # 35 queries: three query tiles, windows across tile boundaries
    cu, k_nope, k_pe, v, make = random_varlen(lens, dtype=torch.float32)
    q = make(sum(lens), 2, 12)
    got = (torch.full((sum(lens), 2, 8), NAN), torch.full((2, sum(lens)), NAN))
    want = (torch.full((sum(lens), 2, 8), NAN), torch.full((2, sum(lens)), NAN))
    attention.suffix_attention(q, k_nope, k_pe, v, cu, 0.3, *got, window)
    suffix_attention_reference(q, k_nope, k_pe, v, cu, 0.3, *want, window)
    assert_same(got[0], want[0], 2e-5)
    assert_same(got[1], want[1], 2e-5)


@pytest.mark.parametrize("window", [4, 9, 40])
def test_context_kernel_in_a_window(window):
    """Rows are context positions ``starts + k``: request 0 continues (merges into NaN-free earlier values),
    request 1 begins its window here, request 2 has no rows (its NaN stays)."""
    contexts, q_lens = [60, 30, 5], [20, 17, 3]
    first = [max(0, c - window + 1) for c in contexts]
    k_lens = [min(18, contexts[0] - first[0] - 1), contexts[1] - first[1], 0]
    starts = torch.tensor([first[0] + 1, first[1], 0], dtype=torch.int32)
    cu_q, _, _, _, make = random_varlen(q_lens, dtype=torch.float32)
    cu_k, k_nope, k_pe, v, _ = random_varlen(k_lens, dtype=torch.float32, seed=1)
    q = make(sum(q_lens), 2, 12)
    t = sum(q_lens)
    prev_out = torch.full((t, 2, 8), NAN)
    prev_lse = torch.full((2, t), NAN)
    prev_out[:20], prev_lse[:, :20] = torch.randn(20, 2, 8), torch.randn(2, 20)
    prev_lse[:, 5] = float("-inf")  # an earlier chunk the query saw nothing of
    prev_out[5] = 0.0
    got = (prev_out.clone(), prev_lse.clone())
    want = (prev_out.clone(), prev_lse.clone())
    ctx = torch.tensor(contexts, dtype=torch.int32)
    attention.context_attention(q, k_nope, k_pe, v, cu_q, cu_k, starts, 0.3, *got, ctx, window)
    context_attention_reference(q, k_nope, k_pe, v, cu_q, cu_k, starts, 0.3, *want, ctx, window)
    assert_same(got[0], want[0], 2e-5)
    assert_same(got[1], want[1], 2e-5)


@pytest.mark.parametrize("window", [1, 6, 25])
def test_absorbed_kernel_in_a_window(window):
    batch = context_batch([40, 0, 13, 3], [20, 2, 7, 1], block_size=4, dtype=torch.float32, N=3)
    got, want = batch.sentinels(8), batch.sentinels(8)
    absorbed.absorbed_context_attention(*batch.absorbed_args(), *got, -1, None, window)
    absorbed_reference(*batch.absorbed_args(), *want, -1, None, window)
    assert_same(got[0], want[0], 2e-5)
    assert_same(got[1], want[1], 2e-5)


@pytest.mark.parametrize("window", [1, 5])
def test_sparse_kernel_in_a_window(window):
    contexts, queries, selected = [5, 0, 40, 19], [1, 6, 4, 3], [True, True, True, False]
    batch = context_batch(contexts, queries, block_size=4, dtype=torch.float32, N=3, L=32, R=8, P=8, V=8)
    topk = random_topk(contexts, queries, 12, seed=1, sparse=selected, future=True)
    args = (batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.block_table, batch.query_start_loc,
            batch.context_lens, torch.tensor(selected), topk, batch.kv_b_proj_weight, batch.softmax_scale,
            batch.absorbed_args()[-1])
    got, want = batch.sentinels(8), batch.sentinels(8)
    sparse.sparse_attention(*args, *got, window)
    sparse_reference(*args, *want, window)
    assert_same(got[0], want[0], 2e-5)
    assert_same(got[1], want[1], 2e-5)


# ---- run_prefill(backend="triton") ------------------------------------------------------------

CTX, QLENS, BLOCK = [0, 23, 5, 40, 16, 9], [2, 3, 1, 20, 2, 1], 4
FORMS = {
    "host": dict(workspace_size=5, absorb_max_query_len=0),
    "host, absorbed": dict(workspace_size=5, absorb_max_query_len=3),
    "device": dict(workspace_size=7, absorb_max_query_len=0, max_chunks=14),
    "device, absorbed": dict(workspace_size=7, absorb_max_query_len=3, max_chunks=14, max_absorbed_tokens=8),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [2, 17])
@pytest.mark.parametrize("form", list(FORMS))
def test_prefill_with_window_and_sinks(form, window, dtype):
    batch = make_batch(CTX, QLENS, seed=3, block_size=BLOCK, dtype=dtype)
    sinks = torch.randn(2, generator=torch.Generator().manual_seed(1)) * 2
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK,
                                sliding_window=window, **FORMS[form])
    out, lse = mla_ops.run_prefill(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight,
                                   batch.softmax_scale, plan, backend="triton", return_lse=True, sinks=sinks)
    want, want_lse = dense_reference(*batch.args(), return_lse=True, sliding_window=window, sinks=sinks)
    scale = max(1.0, want.abs().max().item())
    assert out.dtype == dtype and (out.double() - want).abs().max().item() <= TOL[dtype] * scale
    assert (lse.double() - want_lse).abs().max().item() <= LSE_TOL[dtype]


@pytest.mark.parametrize("max_chunks", [None, 24])
def test_sparse_prefill_with_window_and_sinks(max_chunks):
    ctx, qlens = [0, 13, 5, 9, 30, 2], [3, 4, 2, 1, 5, 2]
    batch = make_batch(ctx, qlens, seed=4, block_size=BLOCK, dtype=torch.float32)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK, 8,
                                absorb_max_query_len=2, max_chunks=max_chunks, index_topk=8, index_scores_budget=32,
                                sliding_window=6)
    topk = random_topk(ctx, qlens, 8, seed=5, sparse=plan.sparse.tolist(), empty=0.0)
    sinks = torch.tensor([0.5, -1.0])
    out, lse = mla_ops.run_prefill(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight,
                                   batch.softmax_scale, plan, backend="triton", topk_indices=topk, return_lse=True,
                                   sinks=sinks)
    sparse_out, sparse_lse, rows = masked_reference(batch, topk, plan.sparse, sliding_window=6, sinks=sinks)
    dense_out, dense_lse = dense_reference(*batch.args(), return_lse=True, sliding_window=6, sinks=sinks)
    assert rows.any() and not rows.all()
    want = torch.where(rows[:, None, None], sparse_out, dense_out)
    assert (out.double() - want).abs().max().item() <= 2e-5 * max(1.0, want.abs().max().item())
    assert (lse.double() - torch.where(rows, sparse_lse, dense_lse)).abs().max().item() <= 1e-4
