"""vLLM's per-request MLA context-chunk planner, re-expressed here as the reference for
``policy="whole_requests"`` and the baseline of the planner benchmark. Not part of the library.

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

__all__ = ["ChunkPlan", "VllmContextChunk", "ChunkedContext", "plan_mla_context_chunks", "build_chunked_context"]


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
    empty_token_ranges: list[tuple[int, int]]  # zero-context requests before the last with context


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
) -> ChunkedContext | None:
    """Plan the chunks and build every per-chunk tensor vLLM's kernels read, as vLLM does."""
    context_lens = context_lens_cpu.tolist()
    if max(context_lens, default=0) <= 0:
        return None
    alignment = block_size if align_chunk_to_block else 1
    max_context_chunk = workspace_size // alignment * alignment
    plans = plan_mla_context_chunks(context_lens, workspace_size, max_context_chunk, _same_rows)

    query_start_loc = query_start_loc_cpu.tolist()
    last_with_context = [i for i, length in enumerate(context_lens) if length > 0][-1]
    empty_token_ranges = [
        (query_start_loc[i], query_start_loc[i + 1]) for i in range(last_with_context) if context_lens[i] == 0
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
