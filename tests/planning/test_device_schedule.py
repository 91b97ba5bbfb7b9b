"""The device planner (plan_context_chunks_device) equals the host planner's packed schedule; its
validation; opcheck of the planner op and of up_project. (mla_prefill's max_chunks path:
tests/prefill/test_max_chunks.py.)"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mla_ops

OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


@given(  # examples: the hypothesis profile (tests/conftest.py)
    context_lens=st.lists(st.one_of(st.just(0), st.integers(0, 90)), min_size=1, max_size=10),
    workspace_size=st.integers(1, 48),
    spare=st.integers(0, 2),
)
def test_device_plan_equals_host_packed_plan(context_lens, workspace_size, spare):
    host = mla_ops.plan_context_chunks(context_lens, [1] * len(context_lens), workspace_size)
    capacity = max(host.num_chunks + spare, 1)
    plan = mla_ops.plan_context_chunks_device(torch.tensor(context_lens, dtype=torch.int32), workspace_size, capacity)
    assert int(plan.num_chunks) == host.num_chunks and not bool(plan.overflow)
    batch = len(context_lens)
    for k in range(capacity):
        seq_lens, starts = np.zeros(batch, int), np.zeros(batch, int)
        if k < host.num_chunks:
            c = host.chunks[k]
            seq_lens[c.request_start : c.request_end] = c.seq_lens.numpy()
            starts[c.request_start : c.request_end] = np.where(c.seq_lens.numpy() > 0, c.starts.numpy(), 0)
            assert plan.cu_seq_lens[k, c.request_start : c.request_end + 1].tolist() == c.cu_seq_lens.tolist()
        # Chunks past the count are empty: every kernel does nothing for them.
        assert plan.seq_lens[k].tolist() == seq_lens.tolist()
        assert plan.starts[k].tolist() == starts.tolist()
        assert plan.cu_seq_lens[k].tolist() == [0, *np.cumsum(seq_lens).tolist()]


def test_device_plan_reports_overflow():
    plan = mla_ops.plan_context_chunks_device(torch.tensor([30, 0, 50], dtype=torch.int32), 16, 3)
    assert int(plan.num_chunks) == 5 and bool(plan.overflow)
    assert plan.starts.dtype == plan.cu_seq_lens.dtype == plan.num_chunks.dtype == torch.int32


def test_device_plan_validates():
    with pytest.raises(TypeError, match="context_lens"):
        mla_ops.plan_context_chunks_device(torch.tensor([3, 4]), 8, 2)
    with pytest.raises(ValueError, match="max_chunks"):
        mla_ops.plan_context_chunks_device(torch.tensor([3, 4], dtype=torch.int32), 8, 0)
    with pytest.raises(ValueError, match="workspace_size"):
        mla_ops.plan_context_chunks_device(torch.tensor([3, 4], dtype=torch.int32), 0, 2)
    with pytest.raises(ValueError, match=r"workspace_size must be at most 2\*\*31 - 1"):  # compared in int32
        mla_ops.plan_context_chunks_device(torch.tensor([3, 4], dtype=torch.int32), 2**31, 2)


def test_device_plan_and_up_project_opcheck():
    lens = torch.tensor([7, 0, 19, 3], dtype=torch.int32)
    torch.library.opcheck(torch.ops.mla_ops.plan_context_chunks_device, (lens, 8, 4), test_utils=OPCHECK_UTILS)
    workspace, weight = torch.randn(8, 10), torch.randn(12, 6)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    torch.library.opcheck(torch.ops.mla_ops.up_project, (workspace[:, :6], weight, cu, torch.zeros(8, 12)),
                          test_utils=OPCHECK_UTILS)
    out = torch.full((8, 12), float("nan"))
    torch.ops.mla_ops.up_project(workspace[:, :6], weight, cu, out)
    torch.testing.assert_close(out[:5], workspace[:5, :6] @ weight.t())
    assert torch.isnan(out[5:]).all(), "rows past cu_seq_lens[-1] are not computed"
