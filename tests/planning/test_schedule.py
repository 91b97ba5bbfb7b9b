"""Tests for the host chunk planner, `mla_ops.plan_context_chunks` (DESIGN.md §3).

The oracle is `reference_plan` below: a sequential, pure-Python planner written from the contract
alone. Every schedule the library returns is checked twice, once against the §3 invariants (which
hold for any correct schedule) and once for equality with the oracle (which pins the policy).

Vocabulary used throughout:
  C     [B+1]  context stream offsets, [0, cumsum(context_lens)]; a chunk is an interval [b, e)
  qsl   [B+1]  query_start_loc, [0, cumsum(query_lens)]
  W, A         workspace_size, split_alignment
  a plan is a list of (request_start, request_end, starts, seq_lens), one tuple per chunk
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mla_ops
from mla_ops.planning import schedule as schedule_module
from tests.support.schedules import batches

POLICIES = ("packed", "whole_requests")
BUILDERS = ("lists", "arrays")  # the planner's two paths: small batches, large batches
INPUT_KINDS = ("list", "np_int32", "np_int64", "torch_int32", "torch_int64")
TENSOR_FIELDS = ("starts", "seq_lens", "cu_seq_lens", "query_start_loc")
SCHEDULE_INT_FIELDS = (
    "workspace_size", "num_context_tokens", "prefill_tokens_with_context", "num_chunks"
)


# ----------------------------------------------------------------------------------------------
# Reference planner
# ----------------------------------------------------------------------------------------------


def _offsets(lens):
    """[0, cumsum(lens)] as Python ints."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _covered(context_lens, pieces):
    """Turn (request, start, rows) pieces with rows > 0 into one plan entry.

    The chunk covers every request from the first piece's to the last piece's; a request in
    between without a piece is covered with start 0 and seq_len 0.
    """
    rows = {r: (start, n) for r, start, n in pieces}
    first, last = pieces[0][0], pieces[-1][0]
    starts = [rows.get(r, (0, 0))[0] for r in range(first, last + 1)]
    seq_lens = [rows.get(r, (0, 0))[1] for r in range(first, last + 1)]
    return (first, last + 1, starts, seq_lens)


def reference_packed(context_lens, W, A):
    """Cut the context stream greedily at the largest valid cut <= b + W.

    Valid cuts: every request boundary C[r], and C[r] + m*A strictly inside request r.
    """
    C = _offsets(context_lens)
    total = C[-1]
    plan = []
    b = 0
    while b < total:
        limit = b + W
        if limit >= total:
            e = total
        else:
            # The request whose rows contain position `limit` (zero-context requests contain none).
            r = next(r for r in range(len(context_lens)) if C[r] <= limit < C[r + 1])
            e = C[r] + (limit - C[r]) // A * A
        assert b < e <= b + W, "reference bug: no progress"
        pieces = []
        for r, c in enumerate(context_lens):
            lo, hi = max(b, C[r]), min(e, C[r + 1])
            if hi > lo:
                pieces.append((r, lo - C[r], hi - lo))
        plan.append(_covered(context_lens, pieces))
        b = e
    return plan


def reference_whole_requests(context_lens, W, A):
    """vLLM PR #50613: pack whole requests in order; a request larger than W goes alone, in
    pieces of step = round_down(W, A) rows, the last one shorter (no request joins any piece)."""
    step = (W // A) * A
    plan = []
    pack = []  # (request, start, rows) pieces of the open pack
    used = 0

    def close():
        nonlocal pack, used
        if pack:
            plan.append(_covered(context_lens, pack))
        pack, used = [], 0

    for r, c in enumerate(context_lens):
        if c == 0:
            close()
        elif c <= W:
            if used + c > W:
                close()
            pack.append((r, 0, c))
            used += c
        else:
            close()
            for start in range(0, c, step):
                plan.append(_covered(context_lens, [(r, start, min(step, c - start))]))
    close()
    return plan


def reference_plan(context_lens, W, policy, A=1):
    context_lens = [int(c) for c in context_lens]
    if policy == "packed":
        return reference_packed(context_lens, W, A)
    return reference_whole_requests(context_lens, W, A)


# ----------------------------------------------------------------------------------------------
# Checkers
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def builder(name):
    """Plan every batch on one path, whatever its size (the path is picked by batch size)."""
    saved = schedule_module.SMALL_BATCH
    schedule_module.SMALL_BATCH = 1 << 30 if name == "lists" else 0
    try:
        yield
    finally:
        schedule_module.SMALL_BATCH = saved


def plan_of(schedule):
    """A library schedule in the reference's form."""
    return [
        (ch.request_start, ch.request_end, ch.starts.tolist(), ch.seq_lens.tolist())
        for ch in schedule.chunks
    ]


def check_invariants(plan, context_lens, W, A, policy):
    """The DESIGN §3 invariants, for any plan (library or reference)."""
    B = len(context_lens)
    C = _offsets(context_lens)
    cursor = 0  # position in the context stream: chunks tile it in order
    for request_start, request_end, starts, seq_lens in plan:
        assert 0 <= request_start < request_end <= B
        assert len(starts) == len(seq_lens) == request_end - request_start
        assert 0 < sum(seq_lens) <= W, "a chunk is empty or overflows the workspace"
        assert seq_lens[0] > 0 and seq_lens[-1] > 0, "first and last covered requests need rows"
        assert all(s == 0 for s in starts[1:]), "only the first request may continue"
        for r, start, n in zip(range(request_start, request_end), starts, seq_lens):
            c = context_lens[r]
            if n == 0:
                assert policy == "packed", "whole_requests covered a request without rows"
                assert c == 0 and start == 0, "a request with context was covered without rows"
                continue
            assert C[r] + start == cursor, "gap, overlap or out-of-order rows"
            assert start + n <= c
            cursor += n
            # Split points inside a request are aligned.
            assert start % A == 0
            assert start + n == c or (start + n) % A == 0
    assert cursor == C[-1], "context rows left ungathered"

    if policy == "whole_requests":
        step = (W // A) * A
        for request_start, request_end, starts, seq_lens in plan:
            for r, start, n in zip(range(request_start, request_end), starts, seq_lens):
                c = context_lens[r]
                if c <= W:
                    assert (start, n) == (0, c), "a request that fits was split"
                else:
                    # Every piece of a request larger than W, the remainder too: alone, one full
                    # step but the last.
                    assert request_end - request_start == 1, "a request joined a split request's piece"
                    assert n == min(step, c - start)


def check_fields(schedule, context_lens, query_lens, W):
    """Every ContextSchedule / ContextChunk field against its definition."""
    B = len(context_lens)
    qsl = _offsets(query_lens)

    assert isinstance(schedule.chunks, tuple)
    assert schedule.num_chunks == len(schedule.chunks)
    assert schedule.workspace_size == W
    assert schedule.num_context_tokens == sum(context_lens)
    with_context = [r for r in range(B) if context_lens[r] > 0]
    expected_prefill = qsl[with_context[-1] + 1] if with_context else 0
    assert schedule.prefill_tokens_with_context == expected_prefill
    expected_empty = tuple((qsl[r], qsl[r + 1]) for r in range(B) if context_lens[r] == 0)
    assert schedule.empty_token_ranges == expected_empty
    assert isinstance(schedule.empty_token_ranges, tuple)
    for rng in schedule.empty_token_ranges:
        assert isinstance(rng, tuple) and all(type(x) is int for x in rng)
    for name in SCHEDULE_INT_FIELDS:
        assert type(getattr(schedule, name)) is int, name

    for i, ch in enumerate(schedule.chunks):
        for name in TENSOR_FIELDS:
            t = getattr(ch, name)
            assert isinstance(t, torch.Tensor) and t.dtype == torch.int32, name
            assert t.device.type == "cpu" and t.dim() == 1, name
        rs, re_ = ch.request_start, ch.request_end
        starts, seq_lens = ch.starts.tolist(), ch.seq_lens.tolist()
        assert ch.index == i
        assert ch.num_requests == re_ - rs == len(starts) == len(seq_lens)
        assert ch.cu_seq_lens.tolist() == _offsets(seq_lens)
        assert ch.num_context_tokens == sum(seq_lens)
        assert ch.max_seq_len == max(seq_lens)
        assert ch.token_start == qsl[rs]
        assert ch.token_end == qsl[re_]
        assert ch.query_start_loc.tolist() == [q - qsl[rs] for q in qsl[rs : re_ + 1]]
        assert ch.max_query_len == max(query_lens[rs:re_])
        assert ch.is_continuation is (starts[0] > 0)
        assert ch.continuation_token_end == qsl[rs + 1]
        for name in (
            "index", "request_start", "request_end", "num_requests", "num_context_tokens",
            "max_seq_len", "token_start", "token_end", "max_query_len", "continuation_token_end",
        ):
            assert type(getattr(ch, name)) is int, name


CHUNK_FIELDS = (
    "index", "request_start", "request_end", "starts", "seq_lens", "cu_seq_lens",
    "num_context_tokens", "max_seq_len", "token_start", "token_end", "query_start_loc",
    "max_query_len", "is_continuation", "continuation_token_end", "num_requests",
)


def summarize(schedule):
    """Every chunk field as plain Python values."""
    return [
        {
            name: (v.tolist() if isinstance(v, torch.Tensor) else v)
            for name, v in ((name, getattr(ch, name)) for name in CHUNK_FIELDS)
        }
        for ch in schedule.chunks
    ]


def as_input(values, kind):
    if kind == "list":
        return [int(v) for v in values]
    if kind == "np_int32":
        return np.asarray(values, dtype=np.int32)
    if kind == "np_int64":
        return np.asarray(values, dtype=np.int64)
    if kind == "torch_int32":
        return torch.tensor(values, dtype=torch.int32)
    return torch.tensor(values, dtype=torch.int64)


def plan_and_check(context_lens, query_lens, W, policy, A=1, kinds=("list", "list")):
    schedule = mla_ops.plan_context_chunks(
        as_input(context_lens, kinds[0]), as_input(query_lens, kinds[1]), W,
        policy=policy, split_alignment=A,
    )
    check_fields(schedule, context_lens, query_lens, W)
    plan = plan_of(schedule)
    check_invariants(plan, context_lens, W, A, policy)
    assert plan == reference_plan(context_lens, W, policy, A), (
        f"{policy} schedule differs from the reference for context_lens={context_lens}, "
        f"workspace_size={W}, split_alignment={A}"
    )
    return schedule


# ----------------------------------------------------------------------------------------------
# The reference itself (no library involved)
# ----------------------------------------------------------------------------------------------


@given(batches())  # examples: the hypothesis profile (tests/conftest.py)
def test_reference_satisfies_invariants(batch):
    context_lens, _, W, A = batch
    counts = {}
    for policy in POLICIES:
        plan = reference_plan(context_lens, W, policy, A)
        check_invariants(plan, context_lens, W, A, policy)
        counts[policy] = len(plan)
    total = sum(context_lens)
    if A == 1:
        assert counts["packed"] == math.ceil(total / W)
    assert counts["packed"] <= counts["whole_requests"]


# ----------------------------------------------------------------------------------------------
# Property tests of the library
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", BUILDERS)
@given(batch=batches(), context_kind=st.sampled_from(INPUT_KINDS), query_kind=st.sampled_from(INPUT_KINDS))
def test_schedule_matches_contract_and_reference(path, batch, context_kind, query_kind):
    context_lens, query_lens, W, A = batch
    with builder(path):
        schedules = {
            policy: plan_and_check(context_lens, query_lens, W, policy, A, (context_kind, query_kind))
            for policy in POLICIES
        }
    total = sum(context_lens)
    if A == 1:
        assert schedules["packed"].num_chunks == math.ceil(total / W)
    # Greedy cutting at the largest valid cut never needs more chunks than any other schedule
    # whose cuts are valid, and every whole_requests cut is one.
    assert schedules["packed"].num_chunks <= schedules["whole_requests"].num_chunks


@given(batches(max_requests=6), st.sampled_from(POLICIES))
def test_input_kinds_and_paths_give_identical_schedules(batch, policy):
    context_lens, query_lens, W, A = batch
    results = []
    for kind in INPUT_KINDS:
        for path in BUILDERS:
            with builder(path):
                s = mla_ops.plan_context_chunks(
                    as_input(context_lens, kind), as_input(query_lens, kind), W,
                    policy=policy, split_alignment=A,
                )
            results.append((s.empty_token_ranges, s.prefill_tokens_with_context, summarize(s)))
            assert s._buffer.numel() == sum(4 * c.num_requests + 2 for c in s.chunks), "one buffer, no spare rows"
    assert all(r == results[0] for r in results[1:])


@pytest.mark.parametrize("policy", POLICIES)
def test_large_batches_take_the_array_path_and_match_the_reference(policy):
    # Past SMALL_BATCH requests the planner switches to numpy; both paths agree with the oracle.
    rng = np.random.default_rng(0)
    # (requests, W, A, largest context): sizes the O(B * chunks) reference still plans quickly.
    for size, W, A, longest in ((schedule_module.SMALL_BATCH + 1, 4096, 16, 12288), (3000, 65536, 1, 8192),
                                (600, 1000, 7, 3000)):
        context_lens = np.where(rng.random(size) < 0.2, 0, rng.integers(1, longest, size)).tolist()
        query_lens = rng.integers(0, 600, size).tolist()
        for kind in ("list", "torch_int32"):
            s = plan_and_check(context_lens, query_lens, W, policy, A, (kind, kind))
            with builder("lists"):
                assert summarize(plan_and_check(context_lens, query_lens, W, policy, A)) == summarize(s)


# ----------------------------------------------------------------------------------------------
# Pinned examples
# ----------------------------------------------------------------------------------------------


def test_heterogeneous_batch_packs_short_requests_together():
    # 960 + 4 * 16 = 1024 fills the workspace exactly; the last three 16s need a second chunk.
    context_lens = [960] + [16] * 7
    s = plan_and_check(context_lens, [4] * 8, 1024, "whole_requests", 16)
    assert plan_of(s) == [(0, 5, [0] * 5, [960, 16, 16, 16, 16]), (5, 8, [0] * 3, [16] * 3)]
    s = plan_and_check(context_lens, [4] * 8, 1024, "packed", 16)
    assert plan_of(s) == [(0, 5, [0] * 5, [960, 16, 16, 16, 16]), (5, 8, [0] * 3, [16] * 3)]
    assert plan_of(plan_and_check(context_lens, [4] * 8, 1072, "whole_requests", 16)) == [
        (0, 8, [0] * 8, context_lens)
    ]


def test_continuation_is_the_first_request_only():
    context_lens, query_lens = [2048, 32, 32], [3, 5, 7]
    for policy in POLICIES:
        s = plan_and_check(context_lens, query_lens, 1024, policy, 16)
        assert plan_of(s) == [
            (0, 1, [0], [1024]),
            (0, 1, [1024], [1024]),  # the remainder's pack is full: request 1 starts a new one
            (1, 3, [0, 0], [32, 32]),
        ]
        assert [ch.is_continuation for ch in s.chunks] == [False, True, False]
        assert [ch.continuation_token_end for ch in s.chunks] == [3, 3, 8]
        assert [(ch.token_start, ch.token_end) for ch in s.chunks] == [(0, 3), (0, 3), (3, 15)]
        assert s.chunks[2].query_start_loc.tolist() == [0, 5, 12]
        assert s.chunks[2].max_query_len == 7


def test_remainder_of_a_split_request_is_alone():
    # 2500 = 1024 + 1024 + 452; as in vLLM, no request joins the remainder: the next three share
    # a chunk of their own. Packed fills the remainder's chunk instead.
    s = plan_and_check([2500, 300, 272, 1], [1, 2, 3, 4], 1024, "whole_requests", 16)
    assert plan_of(s) == [
        (0, 1, [0], [1024]),
        (0, 1, [1024], [1024]),
        (0, 1, [2048], [452]),
        (1, 4, [0, 0, 0], [300, 272, 1]),
    ]
    assert [ch.is_continuation for ch in s.chunks] == [False, True, True, False]
    s = plan_and_check([2500, 300, 272, 1], [1, 2, 3, 4], 1024, "packed", 16)
    assert plan_of(s) == [
        (0, 1, [0], [1024]),
        (0, 1, [1024], [1024]),
        (0, 3, [2048, 0, 0], [452, 300, 272]),
        (3, 4, [0], [1]),
    ]


def test_split_pieces_are_alone_as_in_vllm():
    # Issue 9's examples: vLLM needs 3 chunks where packing the remainder needs 2.
    s = plan_and_check([24188, 2160], [1, 1], 14848, "whole_requests", 64)
    assert plan_of(s) == [(0, 1, [0], [14848]), (0, 1, [14848], [9340]), (1, 2, [0], [2160])]
    assert plan_and_check([24188, 2160], [1, 1], 14848, "packed", 64).num_chunks == 2
    s = plan_and_check([196], [1], 100, "whole_requests", 16)
    assert plan_of(s) == [(0, 1, [0], [96]), (0, 1, [96], [96]), (0, 1, [192], [4])]
    s = plan_and_check([196], [1], 100, "packed", 16)
    assert plan_of(s) == [(0, 1, [0], [96]), (0, 1, [96], [100])]


def test_zero_context_requests():
    context_lens, query_lens = [64, 0, 64, 0], [4] * 4
    s = plan_and_check(context_lens, query_lens, 1024, "whole_requests", 16)
    assert plan_of(s) == [(0, 1, [0], [64]), (2, 3, [0], [64])]
    covered = {r for ch in s.chunks for r in range(ch.request_start, ch.request_end)}
    assert covered == {0, 2}
    assert s.prefill_tokens_with_context == 12
    assert s.empty_token_ranges == ((4, 8), (12, 16))

    s = plan_and_check(context_lens, query_lens, 1024, "packed", 16)
    assert plan_of(s) == [(0, 3, [0, 0, 0], [64, 0, 64])]
    (ch,) = s.chunks
    assert (ch.token_start, ch.token_end, ch.max_seq_len, ch.num_context_tokens) == (0, 12, 64, 128)
    assert ch.query_start_loc.tolist() == [0, 4, 8, 12]
    assert ch.cu_seq_lens.tolist() == [0, 64, 64, 128]
    assert s.prefill_tokens_with_context == 12
    assert s.empty_token_ranges == ((4, 8), (12, 16))


def test_leading_and_trailing_zero_context_requests_are_not_covered():
    s = plan_and_check([0, 0, 5, 0, 7, 0], [1, 2, 3, 4, 5, 6], 100, "packed")
    assert plan_of(s) == [(2, 5, [0, 0, 0], [5, 0, 7])]
    assert s.prefill_tokens_with_context == 15
    assert s.empty_token_ranges == ((0, 1), (1, 3), (6, 10), (15, 21))
    s = plan_and_check([0, 0, 5, 0, 7, 0], [1, 2, 3, 4, 5, 6], 100, "whole_requests")
    assert plan_of(s) == [(2, 3, [0], [5]), (4, 5, [0], [7])]


def test_pr_headline_batch_is_one_chunk():
    # 32 requests, 60,496 context rows, a 64k workspace (vLLM PR #50613's benchmark batch).
    context_lens = [60000] + [16] * 31
    for policy in POLICIES:
        s = plan_and_check(context_lens, [513] * 32, 65536, policy, 16)
        assert s.num_chunks == 1
        assert plan_of(s) == [(0, 32, [0] * 32, context_lens)]
        assert s.chunks[0].num_context_tokens == 60496
        assert s.chunks[0].token_end == 513 * 32


def test_packed_splits_at_aligned_points():
    # Alignment 16: the cut at 1024 would land 987 rows into request 1; it moves back to 976.
    s = plan_and_check([37, 1000, 5], [1, 1, 1], 1024, "packed", 16)
    assert plan_of(s) == [(0, 2, [0, 0], [37, 976]), (1, 3, [976, 0], [24, 5])]
    s = plan_and_check([37, 1000, 5], [1, 1, 1], 1024, "packed", 1)
    assert plan_of(s) == [(0, 2, [0, 0], [37, 987]), (1, 3, [987, 0], [13, 5])]
    s = plan_and_check([37, 1000, 5], [1, 1, 1], 1024, "whole_requests", 16)
    assert plan_of(s) == [(0, 1, [0], [37]), (1, 3, [0, 0], [1000, 5])]


def test_workspace_not_a_multiple_of_alignment():
    # W = 40, A = 16: whole_requests splits a request larger than W in steps of 32 rows; packed
    # cuts at the last aligned point that fits, so its last piece may take up to 40.
    s = plan_and_check([100, 5], [2, 3], 40, "whole_requests", 16)
    assert plan_of(s) == [
        (0, 1, [0], [32]),
        (0, 1, [32], [32]),
        (0, 1, [64], [32]),
        (0, 1, [96], [4]),
        (1, 2, [0], [5]),
    ]
    s = plan_and_check([100, 5], [2, 3], 40, "packed", 16)
    assert plan_of(s) == [
        (0, 1, [0], [32]),
        (0, 1, [32], [32]),
        (0, 1, [64], [36]),
        (1, 2, [0], [5]),
    ]


def test_every_request_needs_its_own_chunk():
    for policy in POLICIES:
        s = plan_and_check([1024, 1024, 1024], [4] * 3, 1024, policy, 16)
        assert plan_of(s) == [(r, r + 1, [0], [1024]) for r in range(3)]


def test_no_context_needs_no_chunks():
    for policy in POLICIES:
        s = plan_and_check([0, 0], [4, 4], 1024, policy)
        assert s.num_chunks == 0 and s.chunks == ()
        assert s.num_context_tokens == 0 and s.prefill_tokens_with_context == 0
        assert s.empty_token_ranges == ((0, 4), (4, 8))


@pytest.mark.parametrize("path", BUILDERS)
def test_context_totals_past_int32(path):
    # Offsets into the context stream pass 2**31; every per-chunk value still fits int32.
    context_lens = [2**31 - 1, 0, 2**31 - 1, 5]
    with builder(path):
        for policy in POLICIES:
            s = plan_and_check(context_lens, [1, 2, 3, 4], 2**30, policy, 16, ("np_int32", "np_int32"))
            assert s.num_context_tokens == 2**32 + 3
        # A context past int32 would need a start past int32: refused by name, never wrapped.
        with pytest.raises(ValueError, match="int32"):
            mla_ops.plan_context_chunks([2**31 + 40], [1], 2**30)


@pytest.mark.parametrize("path", BUILDERS)
@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_empty_batch(kind, path):
    with builder(path):
        s = mla_ops.plan_context_chunks(as_input([], kind), as_input([], kind), 64)
    assert s.chunks == () and s.num_chunks == 0 and s.empty_token_ranges == ()
    assert s.prefill_tokens_with_context == 0 and s.num_context_tokens == 0


def test_schedule_is_frozen():
    s = mla_ops.plan_context_chunks([5], [1], 64)
    with pytest.raises(AttributeError):
        s.num_chunks = 2
    with pytest.raises(AttributeError):
        s.chunks[0].request_start = 1


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "context_lens, query_lens, kwargs, error, match",
    [
        ([3, -1], [1, 1], {}, ValueError, "context_lens"),
        (torch.tensor([3, -1]), [1, 1], {}, ValueError, "context_lens"),
        ([3, 1], [1, -1], {}, ValueError, "query_lens"),
        ([1, 2, 3], [1, 2], {}, ValueError, "query_lens|context_lens"),
        (torch.ones(2, 2, dtype=torch.int32), [1, 1], {}, ValueError, "context_lens"),
        ([1, 1], np.ones((2, 1), dtype=np.int64), {}, ValueError, "query_lens"),
        (torch.tensor([1.0, 2.0]), [1, 1], {}, TypeError, "context_lens"),
        (np.array([1.0, 2.0]), [1, 1], {}, TypeError, "context_lens"),
        ([1, 2], torch.tensor([1.0, 2.0]), {}, TypeError, "query_lens"),
        ([1, 2], [1, 1], {"workspace_size": 0}, ValueError, "workspace_size"),
        ([1, 2], [1, 1], {"workspace_size": -8}, ValueError, "workspace_size"),
        ([1, 2], [1, 1], {"split_alignment": 0}, ValueError, "split_alignment"),
        ([1, 2], [1, 1], {"workspace_size": 8, "split_alignment": 16}, ValueError,
         "workspace_size|split_alignment"),
        ([1, 2], [1, 1], {"policy": "batch_column"}, ValueError, "policy"),
    ],
)
@pytest.mark.parametrize("path", BUILDERS)
def test_bad_input_is_rejected_by_name(context_lens, query_lens, kwargs, error, match, path):
    kwargs = {"workspace_size": 64, **kwargs}
    workspace_size = kwargs.pop("workspace_size")
    with builder(path), pytest.raises(error, match=match):
        mla_ops.plan_context_chunks(context_lens, query_lens, workspace_size, **kwargs)


# ----------------------------------------------------------------------------------------------
# Moving a schedule
# ----------------------------------------------------------------------------------------------


def _same_schedule(a, b):
    assert summarize(a) == summarize(b)
    for name in (*SCHEDULE_INT_FIELDS, "empty_token_ranges"):
        assert getattr(a, name) == getattr(b, name), name


@pytest.mark.parametrize("path", BUILDERS)
def test_to_cpu_keeps_values(path):
    with builder(path):
        s = mla_ops.plan_context_chunks(
            [2500, 0, 300, 272, 1], [1, 2, 3, 4, 5], 1024, split_alignment=16
        )
    for device in ("cpu", torch.device("cpu")):
        moved = s.to(device)
        _same_schedule(moved, s)
        for ch in moved.chunks:
            for name in TENSOR_FIELDS:
                t = getattr(ch, name)
                assert t.device.type == "cpu" and t.dtype == torch.int32


@pytest.mark.parametrize("path", BUILDERS)
def test_to_another_device_cuts_one_moved_buffer(path):
    # "meta" stands in for a GPU: the buffer moves once and every chunk tensor is a view of it,
    # at the same offset as on the host.
    with builder(path):
        s = mla_ops.plan_context_chunks([2500, 0, 300, 272, 1], [1, 2, 3, 4, 5], 1024, split_alignment=16)
    moved = s.to("meta", non_blocking=True)
    assert moved._buffer.device.type == "meta" and moved._buffer.shape == s._buffer.shape
    assert moved.num_chunks == s.num_chunks == 4
    for a, b in zip(s.chunks, moved.chunks):
        for name in TENSOR_FIELDS:
            x, y = getattr(a, name), getattr(b, name)
            assert y.device.type == "meta" and y.dtype == torch.int32 and y.shape == x.shape, name
            assert y.storage_offset() - moved._buffer.storage_offset() == x.storage_offset(), name
        assert {k: v for k, v in vars(b).items() if k not in TENSOR_FIELDS} == {
            k: v for k, v in vars(a).items() if k not in TENSOR_FIELDS
        }
    with pytest.raises(AttributeError):
        moved.chunks[0].index = 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_cuda_moves_every_chunk_tensor():
    s = mla_ops.plan_context_chunks(
        [2500, 0, 300, 272, 1], [1, 2, 3, 4, 5], 1024, split_alignment=16
    )
    moved = s.to("cuda")
    _same_schedule(moved, s)
    for ch in moved.chunks:
        for name in TENSOR_FIELDS:
            t = getattr(ch, name)
            assert t.device.type == "cuda" and t.dtype == torch.int32
