"""``run_prefill(..., topk_indices=)`` with a DeepSeek Sparse Attention plan (DESIGN §12).

Batches mix dense-routed requests (c_r + q_r <= index_topk: the chunk loop or the absorbed path) and
sparse ones (their tokens attend only their selected keys), with zero-context requests and contexts
larger than the workspace. Sparse tokens must equal the masked float64 oracle
(tests/support/sparse.py), dense tokens the dense float64 reference (tests/support/batches.py), on both routes
of a sparse request (absorbed sparse attention, top-k-masked MHA: ``masked_mha_ratio`` forces each).
"""

import math

import pytest
import torch

import mla_ops
from mla_ops.ops import masked_mha
from mla_ops.planning.routing import masked_mha_requests
from tests.support.batches import dense_reference, make_batch
from tests.support.sparse import masked_reference, random_topk

# Index top-k 8, workspace 8: requests 1, 3 (no context), 4 and 5 (context 30 > W) are sparse.
CTX, QLENS = [0, 13, 5, 0, 9, 30, 2], [3, 4, 2, 9, 1, 5, 2]
TOPK, BLOCK, WORKSPACE = 8, 4, 8
PLANS = {
    "host": dict(absorb_max_query_len=0),
    "host, absorbed": dict(absorb_max_query_len=2),
    "device": dict(absorb_max_query_len=0, max_chunks=24),
    "device, absorbed": dict(absorb_max_query_len=2, max_chunks=24),
}

# A sparse request's route: 0 forces absorbed sparse attention, inf top-k-masked MHA; None the cost model's pick.
ROUTES = {"sparse": 0.0, "masked MHA": math.inf, "cost model": None}


def plan_for(batch, **kwargs):
    kwargs = {"index_topk": TOPK, "index_scores_budget": 32, **kwargs}
    return mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK, WORKSPACE,
                                **kwargs)


def run(batch, plan, topk, **kwargs):
    return mla_ops.run_prefill(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight,
                               batch.softmax_scale, plan, k_scale=batch.k_scale, topk_indices=topk, **kwargs)


def expected(batch, plan, topk):
    """float64 (out, lse): the masked oracle on the sparse requests' tokens, dense attention elsewhere."""
    sparse_out, sparse_lse, rows = masked_reference(batch, topk, plan.sparse)
    out, lse = dense_reference(*batch.args(), k_scale=batch.k_scale, return_lse=True)
    return torch.where(rows[:, None, None], sparse_out, out), torch.where(rows, sparse_lse, lse), rows


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("form", list(PLANS))
def test_sparse_tokens_attend_their_selection_and_dense_tokens_everything(form, route):
    batch = make_batch(CTX, QLENS, seed=3, block_size=BLOCK, nan_fill=True)
    plan = plan_for(batch, masked_mha_ratio=ROUTES[route], **PLANS[form])
    assert plan.sparse.tolist() == [False, True, False, True, True, True, False]
    topk = random_topk(CTX, QLENS, TOPK, seed=4, sparse=plan.sparse.tolist(), shuffle=False)
    out, lse = run(batch, plan, topk, backend="torch", return_lse=True)
    want, want_lse, rows = expected(batch, plan, topk)
    assert lse.dtype == torch.float64 and rows.any() and not rows.all()
    torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-10)
    alone = run(batch, plan, topk, backend="auto", out=torch.empty_like(out))  # the ops; out= written in place
    torch.testing.assert_close(alone, out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("route", ["sparse", "masked MHA"])
def test_fp8_cache_float32(route):
    batch = make_batch(CTX, QLENS, seed=5, block_size=BLOCK, dtype=torch.float32, fp8_scale=0.5)
    plan = plan_for(batch, max_chunks=24, masked_mha_ratio=ROUTES[route])
    topk = random_topk(CTX, QLENS, TOPK, seed=5, sparse=plan.sparse.tolist())
    out, lse = run(batch, plan, topk, return_lse=True)
    want, want_lse, _ = expected(batch, plan, topk)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-5)


@pytest.mark.parametrize("route", ["sparse", "masked MHA"])
def test_truncated_requests_come_out_nan(route):
    """A device plan whose indexer chunks run past max_chunks: those requests' tokens are NaN, never
    silently wrong; the others are exact."""
    batch = make_batch(CTX, QLENS, seed=6, block_size=BLOCK)
    plan = plan_for(batch, max_chunks=6, masked_mha_ratio=ROUTES[route])
    truncated = plan.truncated
    assert truncated.any() and not truncated.all()
    topk = random_topk(CTX, QLENS, TOPK, seed=6, sparse=plan.sparse.tolist())
    out, lse = run(batch, plan, topk, return_lse=True)
    bad = torch.repeat_interleave(truncated, torch.tensor(QLENS))
    assert out[bad].isnan().all() and lse[:, bad].isnan().all()
    want, want_lse, _ = expected(batch, plan, topk)
    torch.testing.assert_close(out[~bad], want[~bad], rtol=0, atol=1e-10)
    torch.testing.assert_close(lse[:, ~bad], want_lse[:, ~bad], rtol=0, atol=1e-10)


@pytest.mark.parametrize("ratio,routed", [(None, "cost model"), (0.0, []), (math.inf, [1, 3, 4, 5]),
                                          (2.0, "cost model")])
def test_each_sparse_request_takes_the_route_the_cost_model_picks(monkeypatch, ratio, routed):
    """Per request, at the layer's dims: masked MHA where its FLOPs are under ratio x the sparse path's (the
    measured default for None), the sparse kernel for the rest; at these dims the default splits the batch."""
    batch = make_batch(CTX, QLENS, seed=11, block_size=BLOCK)
    plan = plan_for(batch, masked_mha_ratio=ratio)
    served = []
    real = masked_mha.masked_mha
    monkeypatch.setattr(masked_mha, "masked_mha", lambda *args: served.append(list(args[7])) or real(*args))
    topk = random_topk(CTX, QLENS, TOPK, seed=11, sparse=plan.sparse.tolist())
    out, lse = run(batch, plan, topk, return_lse=True)
    if routed == "cost model":
        routed = masked_mha_requests(CTX, QLENS, plan.sparse.tolist(), TOPK, (16, 8, 4, 8),
                                     plan.options.masked_mha_cost_ratio)
        assert routed and routed != [1, 3, 4, 5]  # both routes serve this batch
    assert served == ([routed] if routed else [])
    want, want_lse, _ = expected(batch, plan, topk)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-10)


def test_compiled_device_form_serves_two_batch_mixes_without_recompiling():
    """A device plan (made eagerly, passed in as a pytree) and the step, fullgraph, dynamic: the second
    batch mix (other T, B and sparse/dense split) reuses the first graph."""
    torch._dynamo.reset()
    weight = make_batch([1], [1], seed=0, dtype=torch.float32).kv_b_proj_weight
    torch._dynamo.mark_static(weight)

    def step(q, kv_c, k_pe, kv_cache, plan, topk):
        return mla_ops.run_prefill(q, kv_c, k_pe, kv_cache, weight, 0.3, plan, topk_indices=topk)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for i, (ctx, qlens) in enumerate([(CTX, QLENS), ([7, 0, 22, 3], [2, 10, 4, 3])]):
        b = make_batch(ctx, qlens, seed=10 + i, block_size=BLOCK, dtype=torch.float32,
                       garbage_blocks=30 - sum(-(-c // BLOCK) for c in ctx))
        b.kv_b_proj_weight, b.softmax_scale = weight, 0.3
        plan = plan_for(b, max_chunks=10, index_scores_budget=256)  # 10 static chunk steps fit both mixes
        assert not plan.truncated.any()
        topk = random_topk(ctx, qlens, TOPK, seed=i, sparse=plan.sparse.tolist())
        for t, dims in ((b.q, (1, 2)), (b.kv_c, (1,)), (b.k_pe, (1,)), (b.kv_cache, (0, 1, 2)), (topk, (1,))):
            for d in dims:
                torch._dynamo.mark_static(t, d)  # model widths and the cache buffer; T and B vary
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out = compiled(b.q, b.kv_c, b.k_pe, b.kv_cache, plan, topk)
        want, _, _ = expected(b, plan, topk)
        torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5)


# ---- validation: before anything runs ------------------------------------------------------------


def test_topk_indices_required_with_a_dsa_plan_and_refused_without():
    batch = make_batch(CTX, QLENS, seed=8, block_size=BLOCK)
    plan = plan_for(batch)
    with pytest.raises(ValueError, match=r"index_topk=8\): pass topk_indices"):
        run(batch, plan, None)
    dense_plan = plan_for(batch, index_topk=None)
    with pytest.raises(ValueError, match="topk_indices is for a DeepSeek Sparse Attention step.*plan was made"):
        run(batch, dense_plan, torch.zeros(batch.q.shape[0], TOPK, dtype=torch.int32))


BAD = [
    (lambda t: t.long(), TypeError, "topk_indices must be int32"),
    (lambda t: t[:, :-1], ValueError, r"topk_indices must be \[T, index_topk\] = \[26, 8\]"),
    (lambda t: t[:-1], ValueError, r"topk_indices must be \[T, index_topk\]"),
    (lambda t: t.to("meta"), ValueError, "topk_indices must be on cpu"),
    (lambda t: torch.where(t == 16, 17, t), ValueError, r"topk_indices\[\d+, \d+\] is 17: token \d+ of request 1 "
                                                      r"selects positions in -1 \.\. 16"),
    (lambda t: torch.where(t == -1, -3, t), ValueError, r"is -3"),
    # A repeated position: the softmax would count the key twice.
    (lambda t: torch.where(t == 16, 9, t), ValueError, r"topk_indices row \d+ \(request \d+\) holds position \d+ 2 times"),
]


@pytest.mark.parametrize("edit,error,match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_topk_indices_are_refused_before_the_cache_is_written(edit, error, match):
    batch = make_batch(CTX, QLENS, seed=8, block_size=BLOCK, garbage_blocks=8)
    plan = plan_for(batch)
    topk = random_topk(CTX, QLENS, TOPK, seed=8, sparse=plan.sparse.tolist(), shuffle=False)
    topk[torch.repeat_interleave(plan.sparse, torch.tensor(QLENS)).nonzero()[3]] = torch.arange(9, 17, dtype=torch.int32)  # request 1
    cache = batch.kv_cache.clone()
    step = mla_ops.begin_step(plan, cache, torch.arange(batch.q.shape[0]))  # the layer would write its rows
    with pytest.raises(error, match=match):
        step.run(batch.q, batch.kv_c, batch.k_pe, cache, batch.kv_b_proj_weight, batch.softmax_scale,
                 topk_indices=edit(topk))
    torch.testing.assert_close(cache, batch.kv_cache, rtol=0, atol=0, equal_nan=True)


def test_dense_requests_rows_are_ignored():
    batch = make_batch(CTX, QLENS, seed=9, block_size=BLOCK)
    plan = plan_for(batch)
    topk = random_topk(CTX, QLENS, TOPK, seed=9, sparse=plan.sparse.tolist())
    garbage = topk.clone()
    garbage[torch.repeat_interleave(~plan.sparse, torch.tensor(QLENS))] = 1000
    torch.testing.assert_close(run(batch, plan, garbage), run(batch, plan, topk), rtol=0, atol=0)
    assert math.isfinite(run(batch, plan, garbage).abs().max())
