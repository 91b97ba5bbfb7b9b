"""The device planner equals the host planner's packed schedule; the max_chunks path of mla_prefill."""

import math

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


# ---- mla_prefill(max_chunks=K) ---------------------------------------------------------------


def small_batch(context_lens, query_lens, block_size=4, dtype=torch.float64, seed=0, heads=2, **options):
    g = torch.Generator().manual_seed(seed)
    latent, nope, rope, value = 12, 6, 4, 5
    randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    blocks = [-(-c // block_size) for c in context_lens]
    order = torch.randperm(sum(blocks) + 3, generator=g).to(torch.int32)
    table = torch.zeros(len(context_lens), max(blocks + [1]), dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks):
        table[r, :n] = order[used : used + n]
        used += n
    tokens = sum(query_lens)
    return dict(
        q=randn(tokens, heads, nope + rope), kv_c=randn(tokens, latent), k_pe=randn(tokens, rope),
        kv_cache=randn(sum(blocks) + 3, block_size, latent + rope), block_table=table,
        query_start_loc=torch.tensor([0, *np.cumsum(query_lens).tolist()], dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        kv_b_proj_weight=randn(heads * (nope + value), latent) / 3, softmax_scale=0.3, **options,
    )


@pytest.mark.parametrize("workspace_size", [1, 5, 16, 64])
def test_max_chunks_path_equals_host_path(workspace_size):
    context_lens, query_lens = [0, 9, 0, 23, 4, 0], [2, 3, 1, 4, 2, 3]
    batch = small_batch(context_lens, query_lens, absorb_max_query_len=0)  # every context chunked
    expect = mla_ops.mla_prefill(**batch, workspace_size=workspace_size)
    needed = math.ceil(sum(context_lens) / workspace_size)
    for capacity in (needed, needed + 3):
        out = mla_ops.mla_prefill(**batch, workspace_size=workspace_size, max_chunks=capacity)
        torch.testing.assert_close(out, expect, rtol=0, atol=1e-12)


def test_max_chunks_overflow_is_never_silently_wrong():
    context_lens, query_lens = [6, 0, 10, 7, 0], [2, 3, 1, 4, 2]
    batch = small_batch(context_lens, query_lens, absorb_max_query_len=0)
    expect = mla_ops.mla_prefill(**batch, workspace_size=4)
    out = mla_ops.mla_prefill(**batch, workspace_size=4, max_chunks=3)  # 12 of 23 context rows
    poisoned = out.isnan().flatten(1).all(1)
    partial = out.isnan().flatten(1).any(1)
    assert torch.equal(poisoned, partial), "a token is either fully computed or fully NaN"
    # Requests 2 and 3 have context past row 12; requests 0, 1 and 4 are complete and correct.
    expect_poisoned = [r in (2, 3) for r, n in enumerate(query_lens) for _ in range(n)]
    assert poisoned.tolist() == expect_poisoned
    keep = ~poisoned
    torch.testing.assert_close(out[keep], expect[keep], rtol=0, atol=1e-12)


def test_max_chunks_rejects_host_only_options():
    batch = small_batch([3, 5], [2, 2])
    with pytest.raises(ValueError, match="max_chunks"):
        mla_ops.mla_prefill(**batch, workspace_size=4, max_chunks=0)
    with pytest.raises(ValueError, match="max_chunks"):
        mla_ops.mla_prefill(**batch, workspace_size=4, max_chunks=2, policy="whole_requests")
    plan = mla_ops.plan_prefill(batch["query_start_loc"], batch["context_lens"], batch["block_table"],
                                batch["kv_cache"].shape[1], 4)
    with pytest.raises(ValueError, match="max_chunks"):
        mla_ops.mla_prefill(**batch, max_chunks=2, plan=plan)
