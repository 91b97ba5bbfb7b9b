"""The indexer's chunks (DSA, planning/index_schedule.py): every (query, causal key) pair of a sparse request is
scored by exactly one chunk, within the rows and scores budgets, in both plan forms; the per-request routing
and the options' checks. (The index_topk op over these chunks: tests/ops/test_indexer.py.)"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mla_ops

lengths = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), min_size=1, max_size=6)


def plan_of(pairs, topk, workspace, budget, max_chunks=None):
    ctx = torch.tensor([c for c, _ in pairs], dtype=torch.int32)
    qsl = torch.tensor([0, *np.cumsum([q for _, q in pairs])], dtype=torch.int32)
    table = torch.zeros(len(pairs), 8, dtype=torch.int32)
    return mla_ops.plan_prefill(qsl, ctx, table, block_size=8, workspace_size=workspace, max_chunks=max_chunks,
                                index_topk=topk, index_scores_budget=budget)


def coverage(plan):
    """[T, S] counts: how many chunks score token t against position s of its own request (S: longest sequence);
    -1 marks the pairs the request does not have (non-causal, or past its sequence)."""
    qsl, ctx = plan.query_start_loc.tolist(), plan.context_lens.tolist()
    longest = max([c + b - a for c, a, b in zip(ctx, qsl, qsl[1:])], default=0)
    counts = np.full((qsl[-1], longest), -1)
    request = np.searchsorted(qsl, np.arange(qsl[-1]), side="right") - 1
    for t, r in enumerate(request):
        counts[t, : ctx[r] + t - qsl[r] + 1] = 0
    sched = plan.index_schedule
    for i in range(sched.max_chunks):
        for t in range(int(sched.token_start[i]), int(sched.token_end[i])):
            r = request[t]
            start, rows = int(sched.starts[i, r]), int(sched.seq_lens[i, r])
            seen = counts[t, start : start + rows]
            seen[seen >= 0] += 1  # a non-causal pair in a chunk is masked by the op: not counted
    return counts, request


def check_budgets(sched, workspace, budget):
    assert sched.rows <= workspace and sched.rows * sched.tokens <= budget
    assert (sched.cu_seq_lens[:, -1] <= sched.rows).all()
    assert ((sched.token_end - sched.token_start) <= sched.tokens).all()


@given(pairs=lengths, topk=st.integers(1, 20), workspace=st.integers(1, 24), tokens=st.integers(1, 5))
def test_host_chunks_score_every_causal_pair_once(pairs, topk, workspace, tokens):
    plan = plan_of(pairs, topk, workspace, workspace * tokens)
    sched = plan.index_schedule
    counts, request = coverage(plan)
    sparse = plan.sparse.numpy()
    live = counts >= 0
    if counts.size:
        assert (counts[live] == sparse[request][:, None].repeat(counts.shape[1], 1)[live]).all()
    check_budgets(sched, workspace, workspace * tokens)
    assert (sched.token_end > sched.token_start).all()  # the host form has no empty chunk
    assert (sched.seq_lens[:, ~plan.sparse] == 0).all()  # dense requests are never scored
    assert not sched.truncated.any()


@given(pairs=lengths, topk=st.integers(1, 20), workspace=st.integers(1, 24), tokens=st.integers(1, 5),
       capacity=st.integers(1, 12))
def test_device_chunks_score_each_pair_at_most_once_and_mark_what_does_not_fit(pairs, topk, workspace, tokens,
                                                                               capacity):
    plan = plan_of(pairs, topk, workspace, workspace * tokens, max_chunks=capacity)
    sched = plan.index_schedule
    assert sched.max_chunks == capacity and sched.rows == workspace
    check_budgets(sched, workspace, workspace * tokens)
    used = int((sched.token_end > sched.token_start).sum())
    for name in ("starts", "seq_lens", "cu_seq_lens", "token_start", "token_end"):
        assert not getattr(sched, name)[used:].any(), name  # the pieces come first; empty slots score nothing
    counts, request = coverage(plan)
    assert counts.max(initial=0) <= 1
    sparse = plan.sparse.numpy()[request]
    missed = np.zeros(len(pairs), bool)
    np.logical_or.at(missed, request, ((counts == 0) & sparse[:, None]).any(1))
    assert sched.truncated.tolist() == missed.tolist()
    assert (plan.truncated[sched.truncated]).all()  # the attention marks them NaN


def test_a_step_with_fewer_sparse_keys_than_the_workspace_scores_more_queries_at_a_time():
    plan = plan_of([(30, 10), (0, 4)], topk=8, workspace=64, budget=640)
    assert plan.index_schedule.rows == 40 and plan.index_schedule.tokens == 14  # 640 // 40, at most T = 14
    assert plan.index_schedule.max_chunks == 1
    assert plan_of([(30, 10), (0, 4)], topk=8, workspace=64, budget=640, max_chunks=4).index_schedule.tokens == 10


def test_routing_takes_sparse_requests_off_the_dense_paths():
    #            c + q:   8 (dense)  30 (sparse)  10 (dense, no context)  13 (sparse, no context)
    plan = plan_of([(5, 3), (20, 10), (0, 10), (0, 13)], topk=10, workspace=16, budget=64)
    assert plan.sparse.tolist() == [False, True, False, True]
    assert plan.index_topk == 10
    dense = plan.schedule.num_context_tokens + int(plan.absorbed_context_lens.sum())
    assert dense == 5  # only the dense request's context is attended by the dense paths
    assert "index_topk=10" in repr(plan)
    device = plan_of([(5, 3), (20, 10), (0, 10), (0, 13)], topk=10, workspace=16, budget=64, max_chunks=8)
    assert device.sparse.tolist() == [False, True, False, True]
    assert int(device.device_schedule.seq_lens.sum()) + int(device.absorbed_context_lens.sum()) == 5


def test_a_long_prompt_skips_the_queries_before_a_chunk():
    """Causally, the queries of a prompt before a chunk's first position see none of its rows."""
    sched = plan_of([(0, 32)], topk=4, workspace=8, budget=256).index_schedule
    assert sched.starts[:, 0].tolist() == [0, 8, 16, 24]
    assert sched.token_start.tolist() == [0, 8, 16, 24] and (sched.token_end == 32).all()


def test_options_checks():
    with pytest.raises(ValueError, match="index_topk"):
        mla_ops.PlanOptions(index_topk=0)
    with pytest.raises(TypeError, match="index_topk"):
        mla_ops.PlanOptions(index_topk=2.0)
    with pytest.raises(ValueError, match="index_scores_budget"):
        mla_ops.PlanOptions(workspace_size=64, index_topk=8, index_scores_budget=32)
    assert mla_ops.PlanOptions(workspace_size=64, index_topk=8, index_scores_budget=640).index_tokens == 10
    assert mla_ops.PlanOptions().index_scores_budget == 1 << 26


def test_context_parallel_refuses_a_dsa_step():
    qsl, ctx = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([8], dtype=torch.int32)
    with pytest.raises(ValueError, match="context_parallel"):
        mla_ops.plan_prefill(qsl, ctx, torch.zeros(1, 4, dtype=torch.int32), index_topk=4,
                             context_parallel=object())
