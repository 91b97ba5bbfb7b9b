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


# ---- vLLM's newer upstream planner (tail split at split_alignment multiples) ------------------
# `plan_mla_context_chunks_upstream`: see its docstring for the source read. Its cases are those of
# vLLM's tests/v1/attention/test_mla_context_chunks.py after the tail-splitting change (the
# search index's stored copy, file id 57629942696), W = 1024, block size 16.


def plan_upstream(context_lens, query_lens, workspace_size, block_size=16):
    return build_chunked_context(
        torch.tensor(context_lens, dtype=torch.int32),
        torch.tensor([0, *accumulate(query_lens)], dtype=torch.int32),
        workspace_size,
        block_size,
        planner="upstream",
    )


def check_upstream_invariants(context_lens, query_lens, workspace_size, alignment):
    """vLLM's upstream contract: tiling, workspace bound, aligned splits, only the first request
    continues, no chunk covers a zero-context request; and the chunk metadata is consistent."""
    meta = plan_upstream(context_lens, query_lens, workspace_size, alignment)
    where = f"context_lens={context_lens}, W={workspace_size}, alignment={alignment}"
    if meta is None:
        assert not any(context_lens), where
        return meta
    qsl = [0, *accumulate(query_lens)]
    cursor = {}
    previous_start = -1
    for index, c in enumerate(meta.chunks):
        starts, seq_lens = c.starts.tolist(), c.seq_lens.tolist()
        assert c.index == index and len(starts) == len(seq_lens) == c.num_requests >= 1, where
        assert c.request_start >= previous_start, where  # request order
        previous_start = c.request_start
        assert 0 < c.num_context_tokens == sum(seq_lens) <= workspace_size, where
        assert c.cu_seq_lens.tolist() == [0, *accumulate(seq_lens)], where
        assert c.token_to_seq.tolist() == np.repeat(np.arange(c.num_requests), seq_lens).tolist(), where
        assert c.is_continuation == (starts[0] > 0) and all(s == 0 for s in starts[1:]), where
        assert (c.token_start, c.token_end) == (qsl[c.request_start], qsl[c.request_end]), where
        assert c.query_start_loc.tolist() == [q - c.token_start for q in qsl[c.request_start:c.request_end + 1]], where
        assert c.max_seq_len == max(seq_lens), where
        for offset, (start, length) in enumerate(zip(starts, seq_lens)):
            r = c.request_start + offset
            assert length > 0 and context_lens[r] > 0, where
            assert start == cursor.get(r, 0), where  # no gap, no overlap
            cursor[r] = start + length
            if cursor[r] < context_lens[r]:  # a split point: at a multiple of the alignment
                assert cursor[r] % alignment == 0, where
                assert offset == c.num_requests - 1, where  # only the last request is cut
    assert cursor == {r: n for r, n in enumerate(context_lens) if n > 0}, where
    assert meta.empty_token_ranges == [(qsl[r], qsl[r + 1]) for r, n in enumerate(context_lens) if n == 0], where
    return meta


@pytest.mark.parametrize(
    "context_lens",
    [[960, 16, 16, 16, 16, 16, 16, 16], [2048, 320], [1024, 1024, 1024], [37, 1000, 5], [1]],
)
def test_upstream_tiling_cases(context_lens):
    check_upstream_invariants(context_lens, [4] * len(context_lens), 1024, 16)


def test_upstream_continuation_case():
    meta = check_upstream_invariants([2048, 32, 32], [3, 5, 7], 1024, 16)
    assert [c.is_continuation for c in meta.chunks] == [False, True, False]
    assert [c.continuation_token_end for c in meta.chunks] == [3, 3, 8]


def test_upstream_tail_splitting_case():
    meta = check_upstream_invariants([768, 512, 512], [3, 5, 7], 1024, 16)
    assert [(c.starts.tolist(), c.seq_lens.tolist(), c.is_continuation) for c in meta.chunks] == [
        ([0, 0], [768, 256], False),
        ([256, 0], [256, 512], True),
    ]


def test_upstream_zero_context_case():
    meta = check_upstream_invariants([64, 0, 64, 0], [4] * 4, 1024, 16)
    assert {r for c in meta.chunks for r in range(c.request_start, c.request_end)} == {0, 2}
    assert meta.empty_token_ranges == [(4, 8), (12, 16)]  # upstream lists the trailing one too


def test_upstream_no_context_case():
    assert plan_upstream([0, 0], [4, 4], 1024) is None


def test_upstream_issue_examples():
    # Where #50613 gives the remainder a chunk of its own, upstream fills it with what follows.
    assert plan_upstream([24188, 2160], [1, 1], 14848, 64) is not None
    assert len(plan_upstream([24188, 2160], [1, 1], 14848, 64).chunks) == 2
    # The remainder is split only where it does not fit: 96 + 100 (#50613: 96, 96, 4).
    meta = plan_upstream([196], [1], 100, 16)
    assert [c.seq_lens.tolist() for c in meta.chunks] == [[96], [100]]
    # Less than one alignment step free closes the chunk: [90] + 10 free rows < 16.
    meta = plan_upstream([90, 50], [1, 1], 100, 16)
    assert [(c.starts.tolist(), c.seq_lens.tolist()) for c in meta.chunks] == [([0], [90]), ([0], [50])]


def test_upstream_planner_with_padded_rows():
    # DCP-style cost (2 ranks, interleave 4: virtual block 8 -> 4 local rows): splits at multiples
    # of 8 and each chunk's padded cost within the budget.
    from benchmarks.vllm_planner import plan_mla_context_chunks_upstream

    def padded(rows):
        return -(-rows // 8) * 4

    plans = plan_mla_context_chunks_upstream([100, 30, 7], 24, 48, 8, padded)
    cursor = {}
    for p in plans:
        assert sum(padded(s + n) - padded(s) for s, n in zip(p.starts, p.seq_lens)) <= 24
        for offset, (s, n) in enumerate(zip(p.starts, p.seq_lens)):
            r = p.request_start + offset
            assert s == cursor.get(r, 0) and s % 8 == 0
            cursor[r] = s + n
    assert cursor == {0: 100, 1: 30, 2: 7}


@given(batches())  # examples: the hypothesis profile (tests/conftest.py)
def test_upstream_invariants_on_random_batches(batch):
    context_lens, query_lens, workspace_size, alignment = batch
    if workspace_size < alignment:  # vLLM requires a workspace of at least one alignment step
        return
    meta = check_upstream_invariants(context_lens, query_lens, workspace_size, alignment)
    packed = mla_ops.plan_context_chunks(
        context_lens, query_lens, workspace_size, policy="packed", split_alignment=alignment
    )
    whole = mla_ops.plan_context_chunks(
        context_lens, query_lens, workspace_size, policy="whole_requests", split_alignment=alignment
    )
    count = 0 if meta is None else len(meta.chunks)
    # Never fewer chunks than packed; never more than #50613's.
    assert packed.num_chunks <= count <= whole.num_chunks
    if meta is not None and 0 not in context_lens:
        # Without zero-context requests (which close upstream's chunks) it is packed, chunk by chunk.
        assert [(c.request_start, c.request_end, c.starts.tolist(), c.seq_lens.tolist()) for c in meta.chunks] == [
            (c.request_start, c.request_end, c.starts.tolist(), c.seq_lens.tolist()) for c in packed.chunks
        ]


def test_upstream_rejects_bad_arguments():
    with pytest.raises(ValueError, match="planner"):
        build_chunked_context(torch.tensor([1]), torch.tensor([0, 1]), 16, 16, planner="newest")
