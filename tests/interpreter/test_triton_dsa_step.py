"""A DeepSeek Sparse Attention step on the Triton kernels (suffix over the dense-routed tokens only, chunk loop,
sparse attention; and the fused indexer top-k, which ``index_topk`` runs on CUDA tensors only, so the last test
points the CPU op at it) against the masked float64 oracle and the torch step, in both plan forms, under
Triton's CPU interpreter (TRITON_INTERPRET=1, set by this folder's conftest)."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 set before import", allow_module_level=True)
pytest.importorskip("triton")

import torch  # noqa: E402

import mla_ops  # noqa: E402
from tests.prefill.test_dsa import (  # noqa: E402
    CONTEXTS, QUERIES, TOPK, index_side, oracle_selection, sparse_oracle)
from tests.support.batches import make_batch  # noqa: E402


@pytest.mark.parametrize("form", ["host", "device"])
def test_a_dsa_step_on_the_triton_kernels_equals_the_oracle(form):
    batch = make_batch(CONTEXTS, QUERIES, seed=3, block_size=4, dtype=torch.float32, N=2, L=16, P=8, R=4, V=8)
    q_index, weights, k_index, index_cache, _, keys = index_side(batch, seed=4)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=4,
                                workspace_size=16, index_topk=TOPK, index_scores_budget=16 * 5,
                                max_chunks=40 if form == "device" else None)
    topk = mla_ops.index_topk(q_index, weights, k_index, index_cache, plan)
    out, lse = mla_ops.run_prefill(*batch.args()[:4], batch.kv_b_proj_weight, batch.softmax_scale, plan,
                                   backend="triton", topk_indices=topk, return_lse=True)
    expect_out, expect_lse = sparse_oracle(batch, oracle_selection(batch, q_index, weights, keys, TOPK),
                                           plan.sparse.tolist())
    torch.testing.assert_close(out.double(), expect_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), expect_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("form", ["host", "device"])
@pytest.mark.parametrize("fp8", [False, True])
def test_a_dsa_step_with_the_fused_triton_indexer_equals_the_torch_step(form, fp8, monkeypatch):
    """The whole step on Triton, the indexer included: ``index_topk`` on CPU tensors runs the torch fold, so its
    CPU kernel is pointed at the op's CUDA path (``index_topk_fused``: the fused score + running top-k kernel)
    here; ``begin_step`` / ``select`` / ``run(backend="triton")`` then equal the same step on the torch kernels,
    selection for selection (no near-ties: tests/prefill/test_dsa.py), and the float64 oracle's selection."""
    from mla_ops.ops import indexer
    from mla_ops.triton import indexer as triton_indexer

    batch = make_batch(CONTEXTS, QUERIES, seed=5, block_size=4, dtype=torch.float32, N=2, L=16, P=8, R=4, V=8)
    q_index, weights, k_index, index_cache, k_scale_index, keys = index_side(batch, seed=6, fp8=fp8)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=4,
                                workspace_size=16, index_topk=TOPK, index_scores_budget=16 * 5,
                                max_chunks=40 if form == "device" else None)

    def step(backend):
        s = mla_ops.begin_step(plan, batch.kv_cache, backend=backend, index_cache=index_cache,
                               k_scale_index=k_scale_index)
        topk = s.select(q_index, weights, k_index, index_cache)
        out, lse = s.run(*batch.args()[:4], batch.kv_b_proj_weight, batch.softmax_scale, topk_indices=topk,
                         return_lse=True)
        return topk, out, lse

    want_topk, want_out, want_lse = step("torch")
    launches = []
    fold = triton_indexer.fold_piece_topk

    def counted(*args):
        launches.append(1)
        return fold(*args)

    monkeypatch.setattr(triton_indexer, "fold_piece_topk", counted)
    monkeypatch.setattr(indexer, "index_topk_reference", indexer.index_topk_fused)  # the CPU op's body
    got_topk, got_out, got_lse = step("triton")
    assert launches, "the fused Triton indexer did not run"
    assert got_topk.dtype == torch.int32 and torch.equal(got_topk.sort(1).values, want_topk.sort(1).values)
    chosen = oracle_selection(batch, q_index, weights, keys, TOPK)
    sparse_tokens = torch.repeat_interleave(plan.sparse, batch.query_start_loc.diff()).tolist()
    for t, row in enumerate(got_topk.tolist()):
        if sparse_tokens[t]:
            assert {p for p in row if p >= 0} == chosen[t], t
    torch.testing.assert_close(got_out, want_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got_lse, want_lse, rtol=2e-5, atol=2e-5)
