"""Per-request routing between the absorbed and the chunked MHA path (mla_ops/planning/routing.py):
the cost model's threshold, route_context on every input form, the capacity cap, and the split a
plan holds (checked against the dense reference). mla_prefill on every split: tests/prefill/test_routing.py.
"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mla_ops
from mla_ops.planning.routing import cost_model_threshold, route_context
from tests.support.batches import ROUTING_MIX, assert_close_to_reference, make_batch

CONTEXT_LENS, QUERY_LENS = ROUTING_MIX


def test_cost_model_break_even_is_about_170_for_deepseek():
    assert cost_model_threshold(512, 128, 64, 128) == 170


def test_route_context_on_host_and_device_agree():
    mha, absorbed = route_context(np.array(CONTEXT_LENS), np.array(QUERY_LENS), 8)
    mha_t, absorbed_t = route_context(torch.tensor(CONTEXT_LENS, dtype=torch.int32),
                                      torch.tensor(QUERY_LENS, dtype=torch.int32), 8)
    assert mha.tolist() == mha_t.tolist() and absorbed.tolist() == absorbed_t.tolist()
    assert route_context(CONTEXT_LENS, QUERY_LENS, 8) == (mha.tolist(), absorbed.tolist())  # lists: lists
    assert (mha + absorbed).tolist() == CONTEXT_LENS and not np.any((mha > 0) & (absorbed > 0))
    assert absorbed.tolist() == [0, 37, 0, 0, 90, 0, 64, 0]


def absorbed_lens_batch(requests: int):
    """``(query_start_loc, context_lens, block_table)`` of ``requests`` requests: no context, long and short
    queries."""
    context_lens = ([0, 20, 5] * requests)[:requests]
    query_lens = ([4, 2, 30] * requests)[:requests]
    qsl = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    return qsl, torch.tensor(context_lens, dtype=torch.int32), torch.zeros(requests, 2, dtype=torch.int32)


@pytest.mark.parametrize("requests", [3, 40])  # Python lists / numpy on the host
@pytest.mark.parametrize("absorb", [0, 1, 8])  # off / none fits / some routed
@pytest.mark.parametrize("max_chunks", [None, 8])
def test_absorbed_context_lens_is_always_a_b_int32_tensor(requests, absorb, max_chunks):
    """One type for every batch and form: a [B] int32 tensor on the plan's device, zeros where no request is
    absorbed; whether a layer launches the absorbed path is ``has_absorbed_path``."""
    qsl, ctx, table = absorbed_lens_batch(requests)
    plan = mla_ops.plan_prefill(qsl, ctx, table, 16, 64, absorb_max_query_len=absorb, max_chunks=max_chunks)
    lens = plan.absorbed_context_lens
    assert isinstance(lens, torch.Tensor) and lens.dtype == torch.int32 and lens.shape == (requests,)
    expect = route_context(ctx.tolist(), (qsl[1:] - qsl[:-1]).tolist(), absorb, plan.options.absorbed_capacity)[1]
    assert lens.tolist() == expect
    assert plan.has_absorbed_path == (max_chunks is not None and absorb > 0 or any(expect))


def test_a_plan_holds_the_routing_split():
    batch = make_batch(CONTEXT_LENS, QUERY_LENS, seed=3)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table,
                                batch.kv_cache.shape[1], 16, absorb_max_query_len=8)
    mha_lens, absorbed_lens = route_context(CONTEXT_LENS, QUERY_LENS, 8)
    assert plan.absorbed_context_lens.tolist() == list(absorbed_lens)
    assert plan.schedule.num_context_tokens == sum(mha_lens)  # the chunks cover the MHA share only
    assert_close_to_reference(batch.run(plan=plan), batch.reference(), torch.float64)


# Threshold 8 routes requests 1 (1 query), 4 (8) and 6 (5): 1, 9 and 14 tokens cumulated.
CAPACITY_SPLITS = {
    0: [0, 0, 0, 0, 0, 0, 0, 0],
    1: [0, 37, 0, 0, 0, 0, 0, 0],
    9: [0, 37, 0, 0, 90, 0, 0, 0],
    13: [0, 37, 0, 0, 90, 0, 0, 0],  # request 6 does not fit: it and every later routed request stay MHA
    14: [0, 37, 0, 0, 90, 0, 64, 0],
}


@pytest.mark.parametrize("capacity", CAPACITY_SPLITS)
def test_capacity_takes_the_first_routed_requests_that_fit(capacity):
    expect = CAPACITY_SPLITS[capacity]
    as_tensors = [torch.tensor(x, dtype=torch.int32) for x in (CONTEXT_LENS, QUERY_LENS)]
    for ctx, q in ((CONTEXT_LENS, QUERY_LENS), (np.array(CONTEXT_LENS), np.array(QUERY_LENS)), as_tensors):
        mha, absorbed = route_context(ctx, q, 8, capacity)
        assert list(absorbed) == expect and [m + a for m, a in zip(mha, absorbed)] == CONTEXT_LENS
    batch = make_batch(CONTEXT_LENS, QUERY_LENS, seed=7)
    args = (batch.query_start_loc, batch.context_lens, batch.block_table, batch.kv_cache.shape[1], 16)
    host = mla_ops.plan_prefill(*args, absorb_max_query_len=8, max_absorbed_tokens=capacity)
    device = mla_ops.plan_prefill(*args, max_chunks=16, absorb_max_query_len=8, max_absorbed_tokens=capacity)
    routed_tokens = sum(q for q, a in zip(QUERY_LENS, expect) if a)
    assert host.absorbed_rows == routed_tokens  # the host form's scratch: exactly the routed tokens
    assert host.absorbed_context_lens.tolist() == expect and host.has_absorbed_path == (routed_tokens > 0)
    assert device.absorbed_rows == capacity and device.absorbed_context_lens.tolist() == expect
    assert host.schedule.num_context_tokens == sum(CONTEXT_LENS) - sum(expect)
    ref = batch.reference()
    for plan in (host, device):
        assert_close_to_reference(batch.run(plan=plan), ref, torch.float64, f"capacity {capacity}")


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 12)), max_size=12), st.integers(0, 12),
       st.one_of(st.none(), st.integers(0, 40)))
def test_capacity_routing_is_a_prefix_of_the_candidates_on_every_input_form(requests, threshold, capacity):
    ctx, q = [c for c, _ in requests], [n for _, n in requests]
    mha, absorbed = route_context(ctx, q, threshold, capacity)
    for form in (np.array, lambda x: torch.tensor(x, dtype=torch.int32)):
        other_mha, other_absorbed = route_context(form(ctx), form(q), threshold, capacity)
        assert list(other_mha) == mha and list(other_absorbed) == absorbed
    candidates = [i for i, (c, n) in enumerate(requests) if c > 0 and n <= threshold]
    taken = [i for i in candidates if absorbed[i]]
    assert taken == candidates[: len(taken)]  # the first candidates, in request order
    assert [m + a for m, a in zip(mha, absorbed)] == ctx and all(a in (0, c) for a, c in zip(absorbed, ctx))
    if capacity is not None:
        assert sum(q[i] for i in taken) <= capacity
        if len(taken) < len(candidates):  # the next candidate did not fit
            assert sum(q[i] for i in candidates[: len(taken) + 1]) > capacity


def test_device_capacity_defaults_to_a_quarter_of_the_workspace():
    batch = make_batch(CONTEXT_LENS, QUERY_LENS, seed=8)
    args = (batch.query_start_loc, batch.context_lens, batch.block_table, batch.kv_cache.shape[1])
    assert mla_ops.plan_prefill(*args, 40, max_chunks=4, absorb_max_query_len=8).absorbed_rows == 10
    host = mla_ops.plan_prefill(*args, 40, absorb_max_query_len=8)
    assert host.absorbed_rows == 14 and host.absorbed_context_lens.tolist() == CAPACITY_SPLITS[14]
    assert mla_ops.plan_prefill(*args, 40, max_chunks=4, absorb_max_query_len=0).absorbed_rows == 0


def test_default_routes_by_the_cost_model_at_deepseek_dims():
    assert cost_model_threshold(512, 128, 64, 128) == mla_ops.routing.DEFAULT_ABSORB_MAX_QUERY_LEN == 170
    batch = make_batch(CONTEXT_LENS, QUERY_LENS, seed=5)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table,
                                batch.kv_cache.shape[1], 7)
    expect = [c if q <= 170 else 0 for c, q in zip(CONTEXT_LENS, QUERY_LENS)]
    assert plan.absorbed_context_lens.tolist() == expect
    out = mla_ops.mla_prefill(*batch.args(), workspace_size=7)
    assert_close_to_reference(out, batch.reference(), torch.float64)
