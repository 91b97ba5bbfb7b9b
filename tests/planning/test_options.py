"""PlanOptions: every planning option checked once, its default resolved once (mla_ops.planning.options)."""

import dataclasses

import numpy as np
import pytest
import torch

import mla_ops
from mla_ops.planning.routing import DEFAULT_ABSORB_MAX_QUERY_LEN, MEASURED_MASKED_MHA_RATIO


def test_defaults_resolve_in_one_place():
    host = mla_ops.PlanOptions()
    assert (host.block_size, host.workspace_size, host.policy, host.split_alignment) == (16, 65536, "packed", 1)
    assert not host.device_form and host.absorb_threshold == DEFAULT_ABSORB_MAX_QUERY_LEN
    assert host.absorbed_capacity is None  # host form: no cap
    device = dataclasses.replace(host, max_chunks=4)
    assert device.device_form and device.absorbed_capacity == 65536 // 4  # a static scratch
    assert mla_ops.PlanOptions(absorb_max_query_len=0).absorb_threshold == 0
    assert host.masked_mha_cost_ratio == MEASURED_MASKED_MHA_RATIO  # DSA's route: the measured ratio
    assert mla_ops.PlanOptions(masked_mha_ratio=np.int64(3)).masked_mha_cost_ratio == 3.0


def test_numpy_ints_become_ints():
    options = mla_ops.PlanOptions(np.int64(4), np.int32(64), max_chunks=np.int64(2))
    assert type(options.block_size) is int and type(options.workspace_size) is int and type(options.max_chunks) is int


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(block_size=0), ValueError, "block_size must be a positive int"),
    (dict(workspace_size=2.0), TypeError, "workspace_size must be an int"),
    (dict(split_alignment=True), TypeError, "split_alignment must be an int"),
    (dict(policy="even"), ValueError, "policy"),
    (dict(workspace_size=8, split_alignment=16), ValueError, "workspace_size must hold at least one split_alignment"),
    (dict(max_chunks=0), ValueError, "max_chunks must be a positive int"),
    # Say what is wrong: the policy or the alignment, not the value it requires.
    (dict(max_chunks=2, policy="whole_requests"), ValueError,
     r"max_chunks \(the device form\) plans only policy='packed', got policy='whole_requests'"),
    (dict(max_chunks=2, policy="whole_requests", split_alignment=1), ValueError,
     r"^max_chunks \(the device form\) plans only policy='packed'[^\n]*$"),  # no word of split_alignment
    (dict(max_chunks=2, split_alignment=4), ValueError,
     r"max_chunks \(the device form\) plans only split_alignment=1, got split_alignment=4"),
    (dict(absorb_max_query_len=-1), ValueError, "absorb_max_query_len must be an int >= 0"),
    (dict(max_absorbed_tokens=-1), ValueError, "max_absorbed_tokens must be an int >= 0"),
    (dict(masked_mha_ratio=-1.0), ValueError, r"masked_mha_ratio must be >= 0 \(0: never masked MHA"),
    (dict(masked_mha_ratio=float("nan")), ValueError, "masked_mha_ratio must be >= 0"),
    (dict(masked_mha_ratio="2"), TypeError, "masked_mha_ratio must be a number or None, got str"),
    (dict(masked_mha_ratio=True), TypeError, "masked_mha_ratio must be a number or None, got bool"),
    # Every size reaches an int32 tensor (compared with int32 lengths, an int32 offset): 2**31 would wrap.
    *[(dict({name: 2**31}, **extra), ValueError, rf"{name} must be at most 2\*\*31 - 1 \(it reaches int32")
      for name, extra in [("block_size", {}), ("workspace_size", {}), ("split_alignment", {}),
                          ("max_chunks", {}), ("absorb_max_query_len", {}), ("max_absorbed_tokens", {}),
                          ("index_scores_budget", {}), ("index_topk", {})]],
])
def test_each_option_is_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        mla_ops.PlanOptions(**kwargs)


def test_plan_prefill_and_mla_prefill_check_through_the_options():
    qsl, ctx = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="max_absorbed_tokens must be an int >= 0"):
        mla_ops.plan_prefill(qsl, ctx, table, 4, max_absorbed_tokens=-1)
    plan = mla_ops.plan_prefill(qsl, ctx, table, 4, workspace_size=8)
    q, kv_c, k_pe = torch.zeros(2, 1, 6), torch.zeros(2, 4), torch.zeros(2, 2)
    cache, weight = torch.zeros(2, 4, 6), torch.zeros(9, 4)
    with pytest.raises(ValueError, match="workspace_size is part of the plan"):
        mla_ops.mla_prefill(q, kv_c, k_pe, cache, table, qsl, ctx, weight, 0.5, workspace_size=8, plan=plan)
    out = mla_ops.mla_prefill(q, kv_c, k_pe, cache, table, qsl, ctx, weight, 0.5, plan=plan)
    assert out.shape == (2, 1, 5)


def test_an_index_topk_past_int32_is_refused_by_plan_prefill_before_planning():
    """2**31 wrapped around in the int32 routing compare: every request sparse, then a 292 GB top-k."""
    qsl, ctx = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"index_topk must be at most 2\*\*31 - 1"):
        mla_ops.plan_prefill(qsl, ctx, table, 4, index_topk=2**31)
    plan = mla_ops.plan_prefill(qsl, ctx, table, 4, index_topk=2**31 - 1)  # the largest: every request dense
    assert plan.sparse.tolist() == [False]


def test_plan_prefill_host_form_on_meta_tensors_points_to_the_device_form():
    meta = lambda *v: torch.tensor(v, dtype=torch.int32).to("meta")  # noqa: E731
    with pytest.raises(ValueError, match="max_chunks=K"):
        mla_ops.plan_prefill(meta(0, 2), meta(3), torch.zeros(1, 1, dtype=torch.int32, device="meta"), 4)


def test_dense_schedule_matches_the_device_form():
    """``ContextSchedule.dense`` lays the host chunks out as the device planner does ([K, B])."""
    context_lens = [5, 0, 13, 2, 0, 9]
    host = mla_ops.plan_context_chunks(context_lens, [1] * 6, 8)
    starts, seq_lens = host.dense(len(context_lens))
    device = mla_ops.plan_context_chunks_device(torch.tensor(context_lens, dtype=torch.int32), 8, host.num_chunks)
    assert starts.shape == (host.num_chunks, 6)
    assert torch.equal(torch.from_numpy(seq_lens).int(), device.seq_lens)
    live = seq_lens > 0
    assert torch.equal(torch.from_numpy(starts[live]).int(), device.starts[torch.from_numpy(live)])


@pytest.mark.parametrize("max_chunks", [None, 4])
def test_the_plan_carries_the_absorbed_tokens_packed_offsets(max_chunks):
    from mla_ops._mla import absorbed_token_loc

    qsl = torch.tensor([0, 2, 9, 10, 13], dtype=torch.int32)  # query lens 2, 7, 1, 3
    ctx = torch.tensor([5, 8, 0, 4], dtype=torch.int32)
    table = torch.arange(16, dtype=torch.int32).view(4, 4)
    plan = mla_ops.plan_prefill(qsl, ctx, table, 4, workspace_size=8, max_chunks=max_chunks, absorb_max_query_len=3,
                                max_absorbed_tokens=8)
    assert plan.absorbed_context_lens.tolist() == [5, 0, 0, 4]
    assert plan.absorbed_token_loc.tolist() == absorbed_token_loc(qsl, plan.absorbed_context_lens).tolist() == \
        [0, 2, 2, 2, 5]
    off = mla_ops.plan_prefill(qsl, ctx, table, 4, workspace_size=8, max_chunks=max_chunks, absorb_max_query_len=0)
    assert off.absorbed_token_loc is None


def test_plan_prefill_checks_its_options_once_per_distinct_arguments():
    from mla_ops.planning.options import plan_options

    once = plan_options(block_size=16, workspace_size=64)
    assert plan_options(block_size=16, workspace_size=64) is once  # a server's steps share one checked object
    assert plan_options(block_size=np.int64(16), workspace_size=64).block_size == 16
    with pytest.raises(TypeError, match="block_size must be an int"):
        plan_options(block_size=16.0, workspace_size=64)  # equal to 16, and still refused
    with pytest.raises(TypeError, match="split_alignment must be an int"):
        plan_options(block_size=16, workspace_size=64, policy="packed", split_alignment=True)  # True == 1
    with pytest.raises(TypeError, match="workspace_size must be an int"):
        plan_options(block_size=16, workspace_size=[64])  # unhashable: checked all the same
