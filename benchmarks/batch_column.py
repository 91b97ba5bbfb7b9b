"""The old vLLM "batch column" context-chunk schedule, kept only as a baseline for benchmarks.

Before vLLM PR #50613, MLA prefill split the cached context of a batch into chunks that each take
the *same window* of every request: with ``num_prefills_with_context`` requests that have context,

    max_context_chunk = round_down(workspace_size // num_prefills_with_context, split_alignment)
    num_chunks        = ceil(max(context_lens) / max_context_chunk)

and chunk ``k`` takes rows ``[k * max_context_chunk, (k + 1) * max_context_chunk)`` of every
request, clamped to its length. One long request in a batch of short ones therefore needs many
nearly empty chunks (32 requests, contexts ``[60000] + [16] * 31``, ``workspace_size=65536``:
2048 rows per request per chunk, 30 chunks where 1 would do).

This is not part of the library: ``mla_ops.plan_context_chunks`` is the planner. Shapes:

    context_lens [B]  ->  starts [num_chunks, B], seq_lens [num_chunks, B]   (int64 numpy)
"""

from __future__ import annotations

import numpy as np

__all__ = ["batch_column_max_chunk", "batch_column_chunks", "batch_column_schedule"]


def _context_lens_array(context_lens) -> np.ndarray:
    lens = np.asarray(context_lens)
    if lens.ndim != 1:
        raise ValueError(f"context_lens: expected a 1-D sequence, got shape {lens.shape}")
    if lens.size and not np.issubdtype(lens.dtype, np.integer):
        raise TypeError(f"context_lens: expected integers, got dtype {lens.dtype}")
    lens = lens.astype(np.int64, copy=False)
    if lens.size and lens.min() < 0:
        raise ValueError(f"context_lens: expected non-negative lengths, got min {lens.min()}")
    return lens


def batch_column_max_chunk(context_lens, workspace_size: int, split_alignment: int = 1) -> int:
    """Rows per request per chunk (``max_context_chunk``); 0 when no request has context."""
    if workspace_size <= 0:
        raise ValueError(f"workspace_size: expected a positive int, got {workspace_size}")
    if split_alignment <= 0:
        raise ValueError(f"split_alignment: expected a positive int, got {split_alignment}")
    lens = _context_lens_array(context_lens)
    with_context = int(np.count_nonzero(lens))
    if with_context == 0:
        return 0
    max_chunk = workspace_size // with_context
    max_chunk -= max_chunk % split_alignment
    if max_chunk == 0:
        raise ValueError(
            f"workspace_size: {workspace_size} rows shared by {with_context} requests with "
            f"context leave less than one split_alignment ({split_alignment}) row step per "
            "request; use a larger workspace or a smaller alignment"
        )
    return max_chunk


def batch_column_chunks(context_lens, workspace_size: int, split_alignment: int = 1) -> int:
    """Number of chunks of the batch-column schedule (0 when no request has context)."""
    max_chunk = batch_column_max_chunk(context_lens, workspace_size, split_alignment)
    if max_chunk == 0:
        return 0
    max_len = int(_context_lens_array(context_lens).max())
    return -(-max_len // max_chunk)


def batch_column_schedule(
    context_lens, workspace_size: int, split_alignment: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Per-chunk windows of every request: ``(starts, seq_lens)``, each ``[num_chunks, B]``.

    ``starts[k, b] = min(k * max_context_chunk, context_lens[b])`` and ``seq_lens[k, b]`` is the
    number of rows request ``b`` has in chunk ``k`` (0 once its context is used up).
    """
    lens = _context_lens_array(context_lens)
    max_chunk = batch_column_max_chunk(lens, workspace_size, split_alignment)
    num_chunks = 0 if max_chunk == 0 else -(-int(lens.max()) // max_chunk)
    window_starts = np.arange(num_chunks, dtype=np.int64)[:, None] * max_chunk  # [num_chunks, 1]
    starts = np.minimum(window_starts, lens[None, :])  # [num_chunks, B]
    ends = np.minimum(window_starts + max_chunk, lens[None, :])  # [num_chunks, B]
    return starts, ends - starts
