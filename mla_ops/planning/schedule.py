"""The chunk schedule: which context rows of which requests each workspace-sized chunk gathers.

Concatenate the requests' contexts into one stream; request r owns rows ``[C[r], C[r+1])`` with
``C = [0, cumsum(context_lens)]``. Every chunk is a contiguous interval ``[b, e)`` of that stream and
the chunks tile it in request order, so a policy is nothing but a choice of boundaries:

* ``"packed"`` (default): each boundary is the last valid cut at most ``workspace_size`` rows after
  the previous one (valid cuts: request boundaries, and multiples of ``split_alignment`` inside a
  request). With ``split_alignment=1`` that is ``ceil(total / workspace_size)`` chunks, the minimum.
* ``"whole_requests"``: vLLM PR #50613 (``plan_mla_context_chunks`` at vllm-project/vllm@27ff206f).
  Whole requests are packed while they fit; a zero-context request closes the pack; a request
  longer than the workspace is emitted alone, in pieces of ``round_down(workspace_size,
  split_alignment)`` rows, the last one shorter, and no other request joins any of its pieces.

From the boundaries every per-chunk field follows. A step's batch is usually small (the Mooncake
replay's median step has one request), where each numpy call costs more than the arithmetic it
replaces, so up to ``SMALL_BATCH`` requests the planner works on Python lists (``itertools``,
``bisect`` and list builtins); larger batches take vectorized numpy. All per-chunk tensors are
views into one int32 buffer, cut by one ``split_with_sizes``, so ``ContextSchedule.to(device)``
costs one host-to-device copy.
"""

from __future__ import annotations

import dataclasses
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import numpy as np
import torch

from .._checks import check_positive_int

POLICIES = ("packed", "whole_requests")
SMALL_BATCH = 384  # requests: about where the numpy path starts to win, measured on a 2-core x86 host

_INT32_MAX = 2**31 - 1
_INT32_MESSAGE = "context_lens, query_lens and workspace_size must keep every chunk's offsets within int32"
_INTEGER_DTYPES = frozenset({torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32,
                             torch.int64, torch.uint64})
_NO_ROWS = torch.empty(0, dtype=torch.int32)  # the buffer of every schedule without chunks; never written


@dataclass(frozen=True)
class ContextChunk:
    """One workspace load: rows of the contiguous run of requests ``[request_start, request_end)``.

    Tensors are int32; ``starts``/``seq_lens`` are ``[num_requests]``, ``cu_seq_lens`` and
    ``query_start_loc`` are ``[num_requests + 1]``. Token indices (``token_start``,
    ``token_end``, ``continuation_token_end``) are absolute positions in the batch's query tokens.
    """

    index: int
    request_start: int
    request_end: int
    starts: torch.Tensor  # offset into each request's context
    seq_lens: torch.Tensor  # rows taken from each request (0 for a covered zero-context request)
    cu_seq_lens: torch.Tensor  # workspace row offsets, [0, cumsum(seq_lens)]
    num_context_tokens: int
    max_seq_len: int
    token_start: int
    token_end: int
    query_start_loc: torch.Tensor  # query offsets of the covered requests, rebased to 0
    max_query_len: int
    is_continuation: bool  # the first request already had rows in an earlier chunk
    continuation_token_end: int  # end of the first request's query tokens

    @property
    def num_requests(self) -> int:
        return self.request_end - self.request_start


@dataclass(frozen=True)
class ContextSchedule:
    """The plan for one batch's context attention; ``num_chunks == 0`` when no request has context."""

    chunks: tuple[ContextChunk, ...]
    workspace_size: int
    num_context_tokens: int
    prefill_tokens_with_context: int  # query tokens up to and including the last request with context
    empty_token_ranges: tuple[tuple[int, int], ...]  # (start, end) of every zero-context request
    _buffer: torch.Tensor = dataclasses.field(repr=False, compare=False)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def dense(self, num_requests: int) -> tuple[np.ndarray, np.ndarray]:
        """The chunks over the whole batch, as the device form lays them out: ``(starts, seq_lens)``,
        each ``[num_chunks, num_requests]`` int64, zero where a chunk does not cover a request."""
        starts = np.zeros((self.num_chunks, num_requests), np.int64)
        seq_lens = np.zeros_like(starts)
        for k, chunk in enumerate(self.chunks):
            starts[k, chunk.request_start : chunk.request_end] = chunk.starts.cpu().numpy()
            seq_lens[k, chunk.request_start : chunk.request_end] = chunk.seq_lens.cpu().numpy()
        return starts, seq_lens

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "ContextSchedule":
        """The same schedule with its chunk tensors on ``device``, moved in a single copy."""
        buffer = self._buffer
        if non_blocking and buffer.is_cpu and torch.device(device).type != "cpu" and torch.cuda.is_available():
            buffer = buffer.pin_memory()  # an asynchronous copy needs page-locked host memory
        moved = buffer.to(device, non_blocking=non_blocking)
        if moved is self._buffer:
            return self
        return self._on(moved)

    def offset_starts(self, first: Sequence[int] | np.ndarray) -> "ContextSchedule":
        """The same chunks with each request's rows read from context position ``first[r]`` on (a sliding
        window's first position, DESIGN §11): ``starts`` grow by ``first[r]`` where a chunk takes rows of
        request r; the chunks, their sizes and ``is_continuation`` are unchanged. A host (CPU) schedule."""
        if not self.chunks:
            return self
        counts = [c.num_requests for c in self.chunks]
        covered = sum(counts)
        buffer = self._buffer.clone()
        request = torch.cat([torch.arange(c.request_start, c.request_end) for c in self.chunks])
        shift = torch.as_tensor(np.asarray(first, dtype=np.int64))[request].to(torch.int32)
        buffer[:covered] += torch.where(buffer[covered : 2 * covered] > 0, shift, 0).to(torch.int32)
        return self._on(buffer)

    def _on(self, buffer: torch.Tensor) -> "ContextSchedule":
        """This schedule over ``buffer`` (laid out as its own: ``_views``)."""
        k = len(self.chunks)
        views = _views(buffer, [c.num_requests for c in self.chunks])
        chunks = tuple(
            frozen_instance(ContextChunk, {
                **c.__dict__,
                "starts": views[i], "seq_lens": views[k + i],
                "cu_seq_lens": views[2 * k + i], "query_start_loc": views[3 * k + i],
            })
            for i, c in enumerate(self.chunks)
        )
        return dataclasses.replace(self, chunks=chunks, _buffer=buffer)


def frozen_instance(cls, fields: dict):
    """An instance of the frozen dataclass ``cls`` holding ``fields``, built without the generated
    ``__init__``: its one ``object.__setattr__`` per field is most of a chunk's planning cost."""
    instance = object.__new__(cls)
    instance.__dict__.update(fields)
    return instance


def _views(buffer: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, ...]:
    """Cut the buffer into every chunk's tensors. It holds the fields one after the other, each
    over all chunks: starts, seq_lens (``counts[k]`` entries), cu_seq_lens, query_start_loc (one
    more); chunk k of K has views ``k``, ``K + k``, ``2K + k`` and ``3K + k``."""
    if not counts:
        return ()
    bounds = [n + 1 for n in counts]
    return buffer.split_with_sizes(counts + counts + bounds + bounds)


def _as_lengths(values, name: str) -> list[int] | np.ndarray:
    """Non-negative ints from a sequence, numpy array or CPU integer tensor: a list for a batch of
    up to ``SMALL_BATCH`` requests, an int64 array for a larger one."""
    if isinstance(values, torch.Tensor):
        if not values.is_cpu:
            raise ValueError(
                f"{name} must be on the CPU for the host planner (it runs from values the "
                f"scheduler already has), got a tensor on {values.device}"
            )
        if values.dtype not in _INTEGER_DTYPES:
            raise TypeError(f"{name} must hold integers, got dtype {values.dtype}")
        if values.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        lengths = values.tolist() if values.shape[0] <= SMALL_BATCH else values.numpy().astype(np.int64)
    elif isinstance(values, list) and len(values) <= SMALL_BATCH and all(type(v) is int for v in values):
        lengths = values  # read only, never kept
    else:
        array_ = np.asarray(values)
        if array_.size == 0:
            array_ = array_.astype(np.int64)
        if not np.issubdtype(array_.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, got {array_.dtype}")
        if array_.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(array_.shape)}")
        lengths = array_.tolist() if array_.size <= SMALL_BATCH else array_.astype(np.int64)
    if len(lengths) and (min(lengths) if isinstance(lengths, list) else lengths.min()) < 0:
        bad = int(np.argmin(lengths))
        raise ValueError(f"{name} must be non-negative, got {lengths[bad]} at index {bad}")
    return lengths


def _packed_boundaries(cu_context: list[int], workspace_size: int, alignment: int) -> list[int]:
    total = cu_context[-1]
    if alignment == 1:
        return [*range(workspace_size, total, workspace_size), total] if total else []
    ends = []
    cut = 0
    while cut < total:
        reach = cut + workspace_size
        if reach >= total:
            cut = total
        else:
            # The request holding row `reach` may only be cut at aligned offsets from its start.
            owner_start = cu_context[bisect_right(cu_context, reach) - 1]
            cut = owner_start + (reach - owner_start) // alignment * alignment
        ends.append(cut)
    return ends


def _whole_request_boundaries(
    context_lens: list[int], cu_context: list[int], workspace_size: int, alignment: int
) -> list[int]:
    step = workspace_size // alignment * alignment
    ends = []
    request, num_requests = 0, len(context_lens)
    next_zero = -1  # the first zero-context request at or after `request`, once looked up
    while request < num_requests:
        length = context_lens[request]
        if length == 0:
            request += 1
        elif length > workspace_size:
            # Alone, in pieces of `step` rows; its remainder is a piece of its own too.
            ends += range(cu_context[request] + step, cu_context[request + 1], step)
            ends.append(cu_context[request + 1])
            request += 1
        else:
            if next_zero < request:
                try:
                    next_zero = context_lens.index(0, request)
                except ValueError:
                    next_zero = num_requests
            # Whole requests while they fit, up to the next zero-context request, which closes the pack.
            limit = cu_context[request] + workspace_size
            request = bisect_right(cu_context, limit, request + 1, next_zero + 1) - 1
            ends.append(cu_context[request])
    return ends


def plan_context_chunks(
    context_lens: Sequence[int] | np.ndarray | torch.Tensor,
    query_lens: Sequence[int] | np.ndarray | torch.Tensor,
    workspace_size: int,
    *,
    policy: str = "packed",
    split_alignment: int = 1,
) -> ContextSchedule:
    """Cut the batch's context into chunks of at most ``workspace_size`` rows (see module doc).

    context_lens  [B]  cached context tokens per request (host values)
    query_lens    [B]  new tokens per request (host values)
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    workspace_size = check_positive_int(workspace_size, "workspace_size")
    split_alignment = check_positive_int(split_alignment, "split_alignment")
    if workspace_size < split_alignment:
        raise ValueError(
            f"workspace_size ({workspace_size}) must hold at least one split_alignment step "
            f"({split_alignment} rows)"
        )
    context_lens = _as_lengths(context_lens, "context_lens")
    query_lens = _as_lengths(query_lens, "query_lens")
    if len(context_lens) != len(query_lens):
        raise ValueError(
            f"context_lens and query_lens must have one entry per request, got {len(context_lens)} "
            f"and {len(query_lens)}"
        )
    return schedule_checked(context_lens, query_lens, workspace_size, policy, split_alignment)


def schedule_checked(context_lens: list[int] | np.ndarray, query_lens: list[int] | np.ndarray, workspace_size: int,
                     policy: str, split_alignment: int) -> ContextSchedule:
    """``plan_context_chunks`` of arguments already checked (``plan_prefill``'s): non-negative
    lengths as lists (up to ``SMALL_BATCH`` requests) or int64 arrays, one per request."""
    small = isinstance(context_lens, list)
    if small:
        cu_context = list(accumulate(context_lens, initial=0))
        context_list, cu_list = context_lens, cu_context
    else:
        cu_context = np.zeros(len(context_lens) + 1, dtype=np.int64)
        np.cumsum(context_lens, out=cu_context[1:])
        cu_list = cu_context.tolist()  # the policies walk lists
        context_list = context_lens.tolist() if policy == "whole_requests" else None
    if policy == "packed":
        ends = _packed_boundaries(cu_list, workspace_size, split_alignment)
    else:
        ends = _whole_request_boundaries(context_list, cu_list, workspace_size, split_alignment)
    build = _schedule_from_lists if small else _schedule_from_arrays
    return build(ends, context_lens, query_lens, cu_context, workspace_size)


def _schedule_from_lists(
    ends: list[int], context_lens: list[int], query_lens: list[int], cu_context: list[int], workspace_size: int
) -> ContextSchedule:
    cu_query = list(accumulate(query_lens, initial=0))
    starts, seq_lens, cu_seq_lens, query_start_loc = [], [], [], []  # each over all chunks
    counts, rows = [], []
    begin = first = 0
    for end in ends:
        first = bisect_right(cu_context, begin, first) - 1  # the request holding row `begin`
        stop = bisect_left(cu_context, end, first)  # one past the request holding row `end - 1`
        start = begin - cu_context[first]
        if stop - first == 1:
            seq = [end - begin]
        else:
            seq = context_lens[first:stop]
            seq[0] -= start
            seq[-1] = end - cu_context[stop - 1]
        queries = query_lens[first:stop]
        starts.append(start)
        starts += [0] * (stop - first - 1)
        seq_lens += seq
        # Offsets that start at 0 are the batch's own prefix sums: slices, nothing to add up.
        if begin == 0:
            cu_seq_lens += cu_context[first:stop]
            cu_seq_lens.append(end)
        else:
            cu_seq_lens += accumulate(seq, initial=0)
        if cu_query[first] == 0:
            query_start_loc += cu_query[first : stop + 1]
        else:
            query_start_loc += accumulate(queries, initial=0)
        counts.append(stop - first)
        rows.append((first, stop, end - begin, max(seq), cu_query[first], cu_query[stop], max(queries),
                     start > 0, cu_query[first + 1]))
        begin = end

    if counts:
        try:
            buffer = torch.frombuffer(array("i", starts + seq_lens + cu_seq_lens + query_start_loc), dtype=torch.int32)
        except OverflowError:
            raise ValueError(_INT32_MESSAGE) from None
    else:
        buffer = _NO_ROWS
    total = cu_context[-1]
    empty = [r for r, c in enumerate(context_lens) if c == 0] if 0 in context_lens else []
    return _assemble(
        buffer, counts, rows, workspace_size, total,
        # The last request with context ends where the context stream first reaches its total.
        cu_query[bisect_left(cu_context, total)] if total else 0,
        tuple((cu_query[r], cu_query[r + 1]) for r in empty),
    )


def _schedule_from_arrays(
    ends: list[int], context_lens: np.ndarray, query_lens: np.ndarray, cu_context: np.ndarray, workspace_size: int
) -> ContextSchedule:
    cu_query = np.zeros(query_lens.size + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu_query[1:])
    total = int(cu_context[-1])
    zero = np.flatnonzero(context_lens == 0)
    prefill_tokens = int(cu_query[np.searchsorted(cu_context, total)]) if total else 0
    empty = tuple(zip(cu_query[zero].tolist(), cu_query[zero + 1].tolist()))
    if not ends:
        return _assemble(_NO_ROWS, [], [], workspace_size, total, prefill_tokens, empty)

    end = np.asarray(ends, dtype=np.int64)
    begin = np.zeros_like(end)
    begin[1:] = end[:-1]
    first = np.searchsorted(cu_context, begin, side="right") - 1  # the request holding row `begin`
    stop = np.searchsorted(cu_context, end, side="left")  # one past the request holding row `end - 1`
    counts = stop - first
    offsets = np.cumsum(counts) - counts  # of each chunk's first entry
    # One entry per (chunk, covered request), chunk after chunk: entry i of chunk k is request
    # first[k] + i; the boundary fields have one entry more per chunk.
    request = np.arange(offsets[-1] + counts[-1]) + np.repeat(first - offsets, counts)
    bound = np.arange(request.size + end.size) + np.repeat(first - offsets - np.arange(end.size), counts + 1)
    start = begin - cu_context[first]
    starts = np.zeros(request.size, dtype=np.int64)
    starts[offsets] = start
    seq_lens = context_lens[request]
    seq_lens[offsets + counts - 1] = end - cu_context[stop - 1]  # the last request ends at `end`
    seq_lens[offsets] -= start  # the first starts at `begin` (both, for a chunk of one request)
    cu_seq_lens = np.clip(cu_context[bound] - np.repeat(begin, counts + 1), 0, np.repeat(end - begin, counts + 1))
    query_start_loc = cu_query[bound] - np.repeat(cu_query[first], counts + 1)
    values = np.concatenate((starts, seq_lens, cu_seq_lens, query_start_loc))
    if values.max() > _INT32_MAX:
        raise ValueError(_INT32_MESSAGE)
    rows = zip(
        first.tolist(), stop.tolist(), (end - begin).tolist(), np.maximum.reduceat(seq_lens, offsets).tolist(),
        cu_query[first].tolist(), cu_query[stop].tolist(), np.maximum.reduceat(query_lens[request], offsets).tolist(),
        (start > 0).tolist(), cu_query[first + 1].tolist(),
    )
    buffer = torch.from_numpy(values.astype(np.int32))
    return _assemble(buffer, counts.tolist(), rows, workspace_size, total, prefill_tokens, empty)


def _assemble(
    buffer, counts, rows, workspace_size, num_context_tokens, prefill_tokens, empty_ranges
) -> ContextSchedule:
    """The schedule from its buffer, chunk sizes and per-chunk scalars (see the two builders)."""
    k = len(counts)
    views = _views(buffer, counts)
    chunks = tuple(
        frozen_instance(ContextChunk, {
            "index": i,
            "request_start": first,
            "request_end": stop,
            "starts": views[i],
            "seq_lens": views[k + i],
            "cu_seq_lens": views[2 * k + i],
            "num_context_tokens": num_rows,
            "max_seq_len": max_seq_len,
            "token_start": token_start,
            "token_end": token_end,
            "query_start_loc": views[3 * k + i],
            "max_query_len": max_query_len,
            "is_continuation": is_continuation,
            "continuation_token_end": continuation_token_end,
        })
        for i, (first, stop, num_rows, max_seq_len, token_start, token_end, max_query_len, is_continuation,
                continuation_token_end) in enumerate(rows)
    )
    return frozen_instance(ContextSchedule, {
        "chunks": chunks,
        "workspace_size": workspace_size,
        "num_context_tokens": num_context_tokens,
        "prefill_tokens_with_context": prefill_tokens,
        "empty_token_ranges": empty_ranges,
        "_buffer": buffer,
    })
