"""vLLM's per-request MLA context-chunk planners, re-expressed here as the reference for
``policy="whole_requests"`` and the baselines of the planner benchmark. Not part of the library.
Two versions: vLLM PR #50613's (``plan_mla_context_chunks``, ``planner="pr50613"``) and vLLM's
newer upstream one that splits a request's tail at ``split_alignment`` multiples
(``plan_mla_context_chunks_upstream``, ``planner="upstream"``; see its docstring for the source).

Source: vLLM PR #50613 (vllm-project/vllm@27ff206f), ``plan_mla_context_chunks`` and
``build_mla_chunked_context_metadata`` in ``vllm/model_executor/layers/attention/mla_attention.py``.
Written by us from that algorithm, for decode-context parallelism off (DCP world size 1: the row
budget is the workspace size and ``padded_rows``, vLLM's per-rank row count, is the identity;
vLLM still calls it per request, and so do we):

* Requests are visited in order. A request without context is skipped, and it closes the pack.
* A request whose context exceeds the workspace is emitted alone, in pieces of
  ``max_context_chunk = round_down(workspace_size, block_size)`` rows, the last piece shorter;
  no other request joins any of its pieces, the remainder included.
* Otherwise whole requests are packed while their contexts fit the workspace.

Per chunk, vLLM then builds the metadata its kernels read (what ``build_chunked_context``
below builds too): flat int32 tensors ``starts``, ``seq_lens``, ``cu_seq_lens`` (workspace row
offsets), ``cu_seqlens_q`` (query offsets rebased per chunk) and ``token_to_seq`` (for every
gathered context row, the index of its request in the chunk), each one host-to-device copy, and
per chunk a ``ContextChunk`` whose tensor fields are slices of those. On a CPU-only machine the
pinned staging buffers are plain CPU tensors and the copies to ``device="cpu"`` are no-ops.

    context_lens [B], query_start_loc [B+1]  ->  ChunkedContext (or None without context)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

__all__ = [
    "ChunkPlan", "VllmContextChunk", "ChunkedContext", "VLLM_PLANNERS", "plan_mla_context_chunks",
    "plan_mla_context_chunks_upstream", "build_chunked_context",
]

VLLM_PLANNERS = ("pr50613", "upstream")


@dataclass
class ChunkPlan:
    """One chunk in request space: requests ``[request_start, request_end)`` and their rows."""

    request_start: int
    request_end: int
    starts: list[int]  # offset into each covered request's context
    seq_lens: list[int]  # rows taken from each covered request
    is_continuation: bool


def plan_mla_context_chunks(
    context_lens: list[int], row_budget: int, max_context_chunk: int, padded_rows: Callable[[int], int]
) -> list[ChunkPlan]:
    """vLLM's packing: whole requests while they fit; an oversized request alone, in pieces."""
    if max_context_chunk <= 0:
        raise ValueError(f"max_context_chunk must be positive, got {max_context_chunk}")
    plans: list[ChunkPlan] = []
    request, num_requests = 0, len(context_lens)
    while request < num_requests:
        length = context_lens[request]
        if length == 0:
            request += 1
            continue
        if padded_rows(length) > row_budget:
            # Every piece is its own chunk; a following request never shares the remainder's.
            for start in range(0, length, max_context_chunk):
                piece = min(max_context_chunk, length - start)
                plans.append(ChunkPlan(request, request + 1, [start], [piece], start > 0))
            request += 1
            continue
        first, rows, seq_lens = request, 0, []
        # A zero-context request ends the pack, as does one that would overflow it.
        while request < num_requests and context_lens[request] > 0:
            request_rows = padded_rows(context_lens[request])
            if rows + request_rows > row_budget:
                break
            rows += request_rows
            seq_lens.append(context_lens[request])
            request += 1
        plans.append(ChunkPlan(first, request, [0] * len(seq_lens), seq_lens, False))
    return plans


def plan_mla_context_chunks_upstream(
    context_lens: list[int],
    row_budget: int,
    max_context_chunk: int,
    split_alignment: int,
    padded_rows: Callable[[int], int],
) -> list[ChunkPlan]:
    """vLLM's newer planner: pack requests in order and split the one that does not fit.

    Source read: ``plan_mla_context_chunks`` in vLLM's
    ``vllm/model_executor/layers/attention/mla_attention.py``, the stored copy in this project's
    search index (file id 57350781372; the index does not name the commit, and the only
    vllm-project/vllm version of that path it names, 90b0a26e, predates PR #50613). Its tests:
    ``tests/v1/attention/test_mla_context_chunks.py`` (index file id 57629942696, which adds
    ``test_tail_splitting_minimizes_chunks`` to the 27ff206f version). Written by us from it:

    * A chunk starts at the first request with rows left (a zero-context request is skipped
      and, like in #50613, ends the chunk that reaches it).
    * Requests join the chunk whole, in order, while their rows fit ``row_budget``.
    * The first that does not fit gets the longest piece that is a multiple of
      ``split_alignment``, at most ``max_context_chunk`` rows, shorter than what it has left, and
      fits the budget still free (with DCP, ``padded_rows`` makes the cost non-linear, so the
      multiple is found by bisection); its remainder starts the next chunk, which other requests
      may join. A piece of length 0 (less than one alignment step free) just closes the chunk.
    """
    if max_context_chunk <= 0:
        raise ValueError(f"max_context_chunk must be positive, got {max_context_chunk}")
    if split_alignment <= 0:
        raise ValueError(f"split_alignment must be positive, got {split_alignment}")

    def split_len(start: int, remaining: int, free: int) -> int:
        """Longest aligned piece of ``remaining`` rows from ``start`` costing at most ``free``."""
        lo, hi = 0, min(max_context_chunk, (remaining - 1) // split_alignment * split_alignment) // split_alignment
        base = padded_rows(start)
        while lo < hi:  # the largest step count whose rows fit
            mid = (lo + hi + 1) // 2
            if padded_rows(start + mid * split_alignment) - base <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo * split_alignment

    plans: list[ChunkPlan] = []
    request, start, num_requests = 0, 0, len(context_lens)
    while request < num_requests:
        if context_lens[request] == 0:
            request += 1
            continue
        first, rows, starts, seq_lens = request, 0, [], []
        while request < num_requests and context_lens[request] > 0:
            remaining = context_lens[request] - start
            cost = padded_rows(start + remaining) - padded_rows(start)
            if rows + cost > row_budget:
                piece = split_len(start, remaining, row_budget - rows)
                if piece:
                    starts.append(start)
                    seq_lens.append(piece)
                    rows += padded_rows(start + piece) - padded_rows(start)
                    start += piece
                break
            rows += cost
            starts.append(start)
            seq_lens.append(remaining)
            request, start = request + 1, 0
        if not seq_lens:  # cannot happen with max_context_chunk <= row_budget
            raise ValueError("a request's first aligned piece does not fit the row budget")
        plans.append(ChunkPlan(first, first + len(seq_lens), starts, seq_lens, starts[0] > 0))
    return plans


@dataclass
class VllmContextChunk:
    """vLLM's ``MLACommonPrefillMetadata.ContextChunk``; the DCP fields keep their defaults."""

    index: int
    request_start: int
    request_end: int
    token_start: int
    token_end: int
    continuation_token_end: int
    is_continuation: bool
    num_context_tokens: int
    query_start_loc: torch.Tensor
    max_query_len: int
    cu_seq_lens: torch.Tensor
    starts: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor  # stays on the host in vLLM
    token_to_seq: torch.Tensor
    padded_local_seq_lens: list[int] | None = None
    local_context_lens_allranks: list[list[int]] | None = None
    padded_local_cu_seq_lens: torch.Tensor | None = None
    padded_local_token_to_seq: torch.Tensor | None = None
    num_local_context_tokens: int = 0
    local_starts: list[int] | None = None

    @property
    def num_requests(self) -> int:
        return self.request_end - self.request_start


@dataclass
class ChunkedContext:
    """vLLM's ``ChunkedContextMetadata`` without the workspace tensor."""

    context_lens: torch.Tensor
    chunks: list[VllmContextChunk]
    context_lens_list: list[int]
    prefill_tokens_with_context: int
    # Zero-context requests' query ranges: #50613 lists those before the last request with
    # context, upstream lists every one.
    empty_token_ranges: list[tuple[int, int]]


def _same_rows(rows: int) -> int:
    """``padded_rows`` without DCP: a request takes its own row count."""
    return rows


def _staging_int32(values) -> torch.Tensor:
    """One flat int32 host tensor; pinned where a GPU exists, as vLLM's staging buffers are."""
    tensor = torch.from_numpy(np.asarray(values, dtype=np.int32))
    return tensor.pin_memory() if torch.cuda.is_available() else tensor


def build_chunked_context(
    context_lens_cpu: torch.Tensor,
    query_start_loc_cpu: torch.Tensor,
    workspace_size: int,
    block_size: int,
    device: torch.device | str = "cpu",
    align_chunk_to_block: bool = True,
    planner: str = "pr50613",
) -> ChunkedContext | None:
    """Plan the chunks and build every per-chunk tensor vLLM's kernels read, as vLLM does.

    ``planner``: ``"pr50613"`` (``plan_mla_context_chunks``) or ``"upstream"``
    (``plan_mla_context_chunks_upstream``); the per-chunk metadata is built the same way.
    """
    if planner not in VLLM_PLANNERS:
        raise ValueError(f"planner must be one of {VLLM_PLANNERS}, got {planner!r}")
    context_lens = context_lens_cpu.tolist()
    if max(context_lens, default=0) <= 0:
        return None
    alignment = block_size if align_chunk_to_block else 1
    max_context_chunk = workspace_size // alignment * alignment
    if planner == "upstream":
        plans = plan_mla_context_chunks_upstream(context_lens, workspace_size, max_context_chunk, alignment, _same_rows)
    else:
        plans = plan_mla_context_chunks(context_lens, workspace_size, max_context_chunk, _same_rows)

    query_start_loc = query_start_loc_cpu.tolist()
    last_with_context = [i for i, length in enumerate(context_lens) if length > 0][-1]
    listed = len(context_lens) if planner == "upstream" else last_with_context
    empty_token_ranges = [
        (query_start_loc[i], query_start_loc[i + 1]) for i in range(listed) if context_lens[i] == 0
    ]

    # Each field concatenated over the chunks, so that each costs one host-to-device copy.
    starts, seq_lens, cu_seq_lens, cu_seqlens_q, token_to_seq = [], [], [], [], []
    layouts = []  # per chunk: request, boundary, row and per-rank row slices into the flat fields
    requests = boundaries = rows = local_rows = 0
    for plan in plans:
        n, num_rows = len(plan.seq_lens), sum(plan.seq_lens)
        num_local_rows = num_rows  # without DCP a rank gathers every row
        assert num_local_rows <= workspace_size, "a chunk overflows the workspace"
        starts.extend(plan.starts)
        seq_lens.extend(plan.seq_lens)
        cu_seq_lens.extend(itertools.accumulate(plan.seq_lens, initial=0))
        base = query_start_loc[plan.request_start]
        cu_seqlens_q.extend(query_start_loc[r] - base for r in range(plan.request_start, plan.request_end + 1))
        token_to_seq.append(np.repeat(np.arange(n, dtype=np.int32), plan.seq_lens))
        layouts.append((slice(requests, requests + n), slice(boundaries, boundaries + n + 1),
                        slice(rows, rows + num_rows), slice(local_rows, local_rows + num_local_rows)))
        requests, boundaries = requests + n, boundaries + n + 1
        rows, local_rows = rows + num_rows, local_rows + num_local_rows

    seq_lens_t = _staging_int32(seq_lens)
    starts_t = _staging_int32(starts).to(device, non_blocking=True)
    cu_seq_lens_t = _staging_int32(cu_seq_lens).to(device, non_blocking=True)
    cu_seqlens_q_t = _staging_int32(cu_seqlens_q).to(device, non_blocking=True)
    token_to_seq_t = _staging_int32(np.concatenate(token_to_seq)).to(device, non_blocking=True)

    chunks = []
    for index, (plan, (request_slice, boundary_slice, row_slice, local_slice)) in enumerate(zip(plans, layouts)):
        query_lens = [query_start_loc[r + 1] - query_start_loc[r] for r in range(plan.request_start, plan.request_end)]
        chunks.append(
            VllmContextChunk(
                index=index,
                request_start=plan.request_start,
                request_end=plan.request_end,
                token_start=query_start_loc[plan.request_start],
                token_end=query_start_loc[plan.request_end],
                continuation_token_end=query_start_loc[plan.request_start + 1],
                is_continuation=plan.is_continuation,
                num_context_tokens=row_slice.stop - row_slice.start,
                query_start_loc=cu_seqlens_q_t[boundary_slice],
                max_query_len=max(query_lens),
                cu_seq_lens=cu_seq_lens_t[boundary_slice],
                starts=starts_t[request_slice],
                max_seq_len=max(plan.seq_lens),
                seq_lens=seq_lens_t[request_slice],
                token_to_seq=token_to_seq_t[row_slice],
                num_local_context_tokens=local_slice.stop - local_slice.start,
            )
        )
    return ChunkedContext(
        context_lens=context_lens_cpu.to(device, non_blocking=True),
        chunks=chunks,
        context_lens_list=context_lens,
        prefill_tokens_with_context=query_start_loc[last_with_context + 1],
        empty_token_ranges=empty_token_ranges,
    )
