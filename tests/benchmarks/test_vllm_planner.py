"""`policy="whole_requests"` equals vLLM's planner field by field (DESIGN §3).

vLLM's side is `benchmarks/vllm_planner.py`, our re-expression of `plan_mla_context_chunks` and
the per-chunk metadata `build_mla_chunked_context_metadata` builds (vllm-project/vllm@27ff206f,
PR #50613). Compared on vLLM's own test cases, on random batches and on every step of the
Mooncake trace replay.
"""

from itertools import accumulate

import numpy as np
import pytest
import torch
from hypothesis import given

import mla_ops
from benchmarks._lib.trace import DEFAULT_TRACE, load_trace, simulate
from benchmarks.vllm_planner import build_chunked_context
from tests.support.schedules import batches

pytestmark = pytest.mark.bench

SCALAR_FIELDS = (
    "index", "request_start", "request_end", "num_requests", "token_start", "token_end",
    "continuation_token_end", "is_continuation", "num_context_tokens", "max_query_len", "max_seq_len",
)
TENSOR_FIELDS = ("query_start_loc", "cu_seq_lens", "starts", "seq_lens")


def plan_both(context_lens, query_lens, workspace_size, block_size):
    ours = mla_ops.plan_context_chunks(
        context_lens, query_lens, workspace_size, policy="whole_requests", split_alignment=block_size
    )
    theirs = build_chunked_context(
        torch.tensor(context_lens, dtype=torch.int32),
        torch.tensor([0, *accumulate(query_lens)], dtype=torch.int32),
        workspace_size,
        block_size,
    )
    return ours, theirs


def assert_same_as_vllm(context_lens, query_lens, workspace_size, block_size):
    """Every field both planners have is equal; vLLM's `token_to_seq` follows from our chunks."""
    ours, theirs = plan_both(context_lens, query_lens, workspace_size, block_size)
    where = f"context_lens={context_lens}, query_lens={query_lens}, W={workspace_size}, block={block_size}"
    if theirs is None:  # vLLM builds nothing for a batch without context
        assert ours.num_chunks == 0 and ours.prefill_tokens_with_context == 0, where
        return ours
    assert ours.num_chunks == len(theirs.chunks), where
    for a, b in zip(ours.chunks, theirs.chunks):
        for name in SCALAR_FIELDS:
            assert getattr(a, name) == getattr(b, name), f"chunk {a.index} {name}: {where}"
        for name in TENSOR_FIELDS:
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype == torch.int32, f"chunk {a.index} {name} dtype: {where}"
            assert x.tolist() == y.tolist(), f"chunk {a.index} {name}: {where}"
        rows = np.diff(a.cu_seq_lens.numpy())
        assert b.token_to_seq.tolist() == np.repeat(np.arange(a.num_requests), rows).tolist(), where
    assert ours.prefill_tokens_with_context == theirs.prefill_tokens_with_context, where
    # vLLM lists the zero-context requests before its last request with context; we list all.
    ranges = list(ours.empty_token_ranges)
    assert ranges[: len(theirs.empty_token_ranges)] == theirs.empty_token_ranges, where
    assert all(start >= ours.prefill_tokens_with_context for start, _ in ranges[len(theirs.empty_token_ranges):]), where
    return ours


# ---- vLLM's own cases (tests/v1/attention/test_mla_context_chunks.py at 27ff206f) --------------


@pytest.mark.parametrize(
    "context_lens",
    [[960, 16, 16, 16, 16, 16, 16, 16], [2048, 320], [1024, 1024, 1024], [37, 1000, 5], [1]],
)
def test_vllm_tiling_cases(context_lens):
    assert_same_as_vllm(context_lens, [4] * len(context_lens), 1024, 16)


def test_vllm_continuation_case():
    s = assert_same_as_vllm([2048, 32, 32], [3, 5, 7], 1024, 16)
    assert [c.is_continuation for c in s.chunks] == [False, True, False]


def test_vllm_zero_context_case():
    s = assert_same_as_vllm([64, 0, 64, 0], [4] * 4, 1024, 16)
    assert {r for c in s.chunks for r in range(c.request_start, c.request_end)} == {0, 2}
    assert s.prefill_tokens_with_context == 12
    _, theirs = plan_both([64, 0, 64, 0], [4] * 4, 1024, 16)
    assert theirs.empty_token_ranges == [(4, 8)] and s.empty_token_ranges == ((4, 8), (12, 16))


def test_vllm_no_context_case():
    assert_same_as_vllm([0, 0], [4, 4], 1024, 16)


def test_issue_examples():
    # The batches where the old whole_requests let a request join a split remainder.
    assert assert_same_as_vllm([24188, 2160], [1, 1], 14848, 64).num_chunks == 3
    s = assert_same_as_vllm([196], [1], 100, 16)
    assert [c.seq_lens.tolist() for c in s.chunks] == [[96], [96], [4]]


# ---- random batches and the trace ------------------------------------------------------------


@given(batches())  # examples: the hypothesis profile (tests/conftest.py)
def test_random_batches_equal_vllm(batch):
    context_lens, query_lens, workspace_size, alignment = batch
    assert_same_as_vllm(context_lens, query_lens, workspace_size, alignment)


@pytest.mark.parametrize("workspace_size", [65536, 16384, 4096])
def test_every_trace_step_equals_vllm(workspace_size):
    steps = list(simulate(load_trace(DEFAULT_TRACE)))
    assert len(steps) > 10_000
    for step in steps:
        assert_same_as_vllm(step.context_lens, step.query_lens, workspace_size, 16)
