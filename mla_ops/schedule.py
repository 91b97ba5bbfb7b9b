"""The chunk schedule: which context rows of which requests each workspace-sized chunk gathers.

Concatenate the requests' contexts into one stream; request r owns rows ``[C[r], C[r+1])`` with
``C = [0, cumsum(context_lens)]``. Every chunk is a contiguous interval ``[b, e)`` of that stream and
the chunks tile it in request order, so a policy is nothing but a choice of boundaries:

* ``"packed"`` (default): each boundary is the last valid cut at most ``workspace_size`` rows after
  the previous one (valid cuts: request boundaries, and multiples of ``split_alignment`` inside a
  request). With ``split_alignment=1`` that is ``ceil(total / workspace_size)`` chunks, the minimum.
* ``"whole_requests"``: vLLM PR #50613. Whole requests are packed while they fit; a zero-context
  request closes the pack; a request longer than the workspace starts a new pack, is split on its
  own in aligned steps of ``round_down(workspace_size, split_alignment)``, and its remainder opens
  the next pack.

From the boundaries every per-chunk field follows with vectorized numpy. All per-chunk tensors
are views into one int32 buffer, so ``ContextSchedule.to(device)`` costs one host-to-device copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

POLICIES = ("packed", "whole_requests")


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

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "ContextSchedule":
        """The same schedule with its chunk tensors on ``device``, moved in a single copy."""
        buffer = self._buffer
        if non_blocking and buffer.device.type == "cpu" and torch.cuda.is_available():
            buffer = buffer.pin_memory()
        moved = buffer.to(device, non_blocking=non_blocking)
        if moved is self._buffer:
            return self
        fields = ("starts", "seq_lens", "cu_seq_lens", "query_start_loc")

        def rebase(t: torch.Tensor) -> torch.Tensor:
            offset = t.storage_offset() - self._buffer.storage_offset()
            return moved.narrow(0, offset, t.numel())

        chunks = tuple(
            dataclasses.replace(c, **{f: rebase(getattr(c, f)) for f in fields}) for c in self.chunks
        )
        return dataclasses.replace(self, chunks=chunks, _buffer=moved)


def _as_lengths(values, name: str) -> np.ndarray:
    """A 1-D int64 numpy array from a sequence, numpy array or CPU integer tensor."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(
                f"{name} must be on the CPU for the host planner (it runs from values the "
                f"scheduler already has), got a tensor on {values.device}"
            )
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {values.dtype}")
        array = values.numpy()
    else:
        array = np.asarray(values)
        if array.size == 0:
            array = array.astype(np.int64)
        if not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, got {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(array.shape)}")
    array = array.astype(np.int64, copy=False)
    if array.size and array.min() < 0:
        bad = int(np.argmin(array))
        raise ValueError(f"{name} must be non-negative, got {int(array[bad])} at index {bad}")
    return array


def _check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)


def _packed_boundaries(cu_context: np.ndarray, workspace_size: int, alignment: int) -> np.ndarray:
    total = int(cu_context[-1])
    if alignment == 1:
        return np.minimum(np.arange(1, -(-total // workspace_size) + 1) * workspace_size, total)
    ends = []
    cut = 0
    while cut < total:
        reach = cut + workspace_size
        if reach >= total:
            cut = total
        else:
            # The request holding row `reach` may only be cut at aligned offsets from its start.
            owner_start = cu_context[np.searchsorted(cu_context, reach, side="right") - 1]
            cut = int(owner_start + (reach - owner_start) // alignment * alignment)
        ends.append(cut)
    return np.asarray(ends, dtype=np.int64)


def _whole_request_boundaries(
    context_lens: np.ndarray, cu_context: np.ndarray, workspace_size: int, alignment: int
) -> np.ndarray:
    step = workspace_size // alignment * alignment
    # A pack may not run past the next zero-context request: it closes the pack.
    zero = np.flatnonzero(context_lens == 0)
    ends = []
    request, cut, total = 0, 0, int(cu_context[-1])
    while cut < total:
        while context_lens[request] == 0 or cu_context[request + 1] <= cut:
            request += 1  # skip zero-context requests and the one just finished
        if cu_context[request + 1] - cut > workspace_size:
            cut += step  # an oversized request is split on its own
            ends.append(cut)
            continue
        # Pack whole requests after the (remainder of the) current one while they fit.
        stop = zero[np.searchsorted(zero, request)] if zero.size and zero[-1] > request else len(context_lens)
        last = np.searchsorted(cu_context[request + 1 : stop + 1], cut + workspace_size, side="right")
        request += int(last) - 1  # at least the current request fits
        cut = int(cu_context[request + 1])
        ends.append(cut)
    return np.asarray(ends, dtype=np.int64)


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
    workspace_size = _check_positive_int(workspace_size, "workspace_size")
    split_alignment = _check_positive_int(split_alignment, "split_alignment")
    if workspace_size < split_alignment:
        raise ValueError(
            f"workspace_size ({workspace_size}) must hold at least one split_alignment step "
            f"({split_alignment} rows)"
        )
    context_lens = _as_lengths(context_lens, "context_lens")
    query_lens = _as_lengths(query_lens, "query_lens")
    if context_lens.shape != query_lens.shape:
        raise ValueError(
            f"context_lens and query_lens must have one entry per request, got {context_lens.size} "
            f"and {query_lens.size}"
        )

    cu_context = np.zeros(context_lens.size + 1, dtype=np.int64)
    np.cumsum(context_lens, out=cu_context[1:])
    cu_query = np.zeros(query_lens.size + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu_query[1:])

    if policy == "packed":
        ends = _packed_boundaries(cu_context, workspace_size, split_alignment)
    else:
        ends = _whole_request_boundaries(context_lens, cu_context, workspace_size, split_alignment)
    return _schedule_from_boundaries(ends, context_lens, cu_context, cu_query, workspace_size)


def _schedule_from_boundaries(
    ends: np.ndarray,
    context_lens: np.ndarray,
    cu_context: np.ndarray,
    cu_query: np.ndarray,
    workspace_size: int,
) -> ContextSchedule:
    begins = np.concatenate(([0], ends[:-1])).astype(np.int64)
    num_chunks = ends.size
    # First request with a row at or after `begin`; one past the last request with a row before `end`.
    first = np.searchsorted(cu_context[1:], begins, side="right")
    stop = np.searchsorted(cu_context[:-1], ends, side="left")
    counts = stop - first
    total = int(counts.sum())

    # One entry per (chunk, covered request), chunk-major.
    chunk_of = np.repeat(np.arange(num_chunks), counts)
    offsets = np.zeros(num_chunks + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    request = first[chunk_of] + np.arange(total) - offsets[chunk_of]
    lo = np.maximum(begins[chunk_of], cu_context[request])
    hi = np.minimum(ends[chunk_of], cu_context[request + 1])
    starts = lo - cu_context[request]
    seq_lens = np.maximum(hi - lo, 0)

    # Boundary arrays have one more entry per chunk: entry i of chunk k is request first[k] + i.
    bound_chunk = np.repeat(np.arange(num_chunks), counts + 1)
    bound_pos = np.arange(total + num_chunks) - (offsets + np.arange(num_chunks + 1))[bound_chunk]
    bound_request = first[bound_chunk] + bound_pos
    cu_seq_lens = np.clip(cu_context[bound_request], begins[bound_chunk], ends[bound_chunk])
    cu_seq_lens -= begins[bound_chunk]
    query_start_loc = cu_query[bound_request] - cu_query[first[bound_chunk]]

    buffer = torch.from_numpy(
        np.concatenate((starts, seq_lens, cu_seq_lens, query_start_loc)).astype(np.int32)
    )
    query_lens = np.diff(cu_query)
    if num_chunks:
        max_seq = np.maximum.reduceat(seq_lens, offsets[:-1])
        max_query = np.maximum.reduceat(query_lens[request], offsets[:-1])
    bound_offsets = offsets + np.arange(num_chunks + 1)
    sections = np.array([0, total, 2 * total, 3 * total + num_chunks])

    chunks = []
    for k in range(num_chunks):
        o, n, bo = int(offsets[k]), int(counts[k]), int(bound_offsets[k])
        r0 = int(first[k])
        chunks.append(
            ContextChunk(
                index=k,
                request_start=r0,
                request_end=int(stop[k]),
                starts=buffer.narrow(0, int(sections[0]) + o, n),
                seq_lens=buffer.narrow(0, int(sections[1]) + o, n),
                cu_seq_lens=buffer.narrow(0, int(sections[2]) + bo, n + 1),
                num_context_tokens=int(ends[k] - begins[k]),
                max_seq_len=int(max_seq[k]),
                token_start=int(cu_query[r0]),
                token_end=int(cu_query[stop[k]]),
                query_start_loc=buffer.narrow(0, int(sections[3]) + bo, n + 1),
                max_query_len=int(max_query[k]),
                is_continuation=bool(begins[k] > cu_context[r0]),
                continuation_token_end=int(cu_query[r0 + 1]),
            )
        )

    has_context = np.flatnonzero(context_lens > 0)
    empty = np.flatnonzero(context_lens == 0)
    return ContextSchedule(
        chunks=tuple(chunks),
        workspace_size=workspace_size,
        num_context_tokens=int(cu_context[-1]),
        prefill_tokens_with_context=int(cu_query[has_context[-1] + 1]) if has_context.size else 0,
        empty_token_ranges=tuple(zip(cu_query[empty].tolist(), cu_query[empty + 1].tolist())),
        _buffer=buffer,
    )
