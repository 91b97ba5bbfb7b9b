"""A DeepSeek Sparse Attention step on the Triton kernels (indexer, suffix over the dense-routed tokens only,
chunk loop, sparse attention) against the masked float64 oracle, in both plan forms, under Triton's CPU
interpreter (TRITON_INTERPRET=1, set by this folder's conftest)."""

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
