"""mla_prefill's device path (max_chunks=K, planned on the device): equal to the host path, NaN and
never silently wrong past the capacity, host-only options rejected.
"""

import math

import pytest
import torch

import mla_ops
from tests.support.batches import make_batch


def small_batch(context_lens, query_lens, block_size=4, dtype=torch.float64, seed=0, heads=2, **options):
    """mla_prefill's keyword arguments for a random paged batch (tests/support/batches.py), plus ``options``."""
    b = make_batch(context_lens, query_lens, seed=seed, block_size=block_size, N=heads, L=12, P=6, R=4, V=5,
                   dtype=dtype, pad_cols=0)
    return dict(**b.tensors(), softmax_scale=0.3, **options)


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
