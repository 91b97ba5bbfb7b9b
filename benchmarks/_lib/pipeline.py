"""The chunked context pipeline that ``kernel_bench`` and ``absorbed_bench`` time, on the library's ops.

Every schedule runs in its full-batch form: ``[K, B]`` starts and ``[K, B+1]`` workspace offsets,
so requests without rows in a chunk cost an early exit and only the schedule differs.

    full_batch_chunks(context_lens, query_lens, W, schedule)  ->  starts [K, B], cu [K, B+1]  (int64 numpy)
    context_pipeline(x, dims, starts, cu, W)  ->  out [T, N, V], lse [N, T]   (x: ``batches.paged_batch``)
"""

from __future__ import annotations

import numpy as np
import torch

import mla_ops
from benchmarks.batch_column import batch_column_schedule

from .batches import Dims

SCHEDULES = ("packed", "whole_requests", "batch_column")


def full_batch_chunks(context_lens, query_lens, workspace_size: int, schedule: str):
    """[K, B] starts and [K, B+1] workspace offsets of a schedule (``SCHEDULES``), over the whole batch."""
    b = len(context_lens)
    if schedule == "batch_column":
        starts, seq_lens = batch_column_schedule(context_lens, workspace_size)
        starts = np.where(seq_lens > 0, starts, 0)
    else:
        plan = mla_ops.plan_context_chunks(context_lens, query_lens, workspace_size, policy=schedule)
        starts, seq_lens = plan.dense(b)
    cu = np.zeros((starts.shape[0], b + 1), np.int64)
    np.cumsum(seq_lens, axis=1, out=cu[:, 1:])
    return starts, cu


def chunk_tensors(context_lens, query_lens, workspace_size: int, schedule: str, device):
    """``full_batch_chunks`` as int32 tensors on ``device``."""
    return tuple(torch.as_tensor(a, dtype=torch.int32, device=device)
                 for a in full_batch_chunks(context_lens, query_lens, workspace_size, schedule))


def context_pipeline(x: dict, dims: Dims, starts: torch.Tensor, cu: torch.Tensor, workspace_size: int):
    """The context partial of every token: K chunks of gather, up-project, attend-and-fold."""
    ops = torch.ops.mla_ops
    N, L, P, R, V = dims
    q = x["q"]
    tokens = q.shape[0]
    out = q.new_zeros(tokens, N, V)
    lse = q.new_full((N, tokens), float("-inf"), dtype=torch.float32)
    workspace = q.new_empty(workspace_size, L + R)
    kv = q.new_empty(workspace_size, N * (P + V))
    k_nope, v = kv.view(-1, N, P + V).split([P, V], dim=-1)
    for k in range(starts.shape[0]):
        ops.gather_context(x["kv_cache"], x["block_table"], cu[k], starts[k], None, workspace)
        ops.up_project(workspace[:, :L], x["kv_b_proj_weight"], cu[k], kv)
        ops.context_attention(q, k_nope, workspace[:, L:], v, x["query_start_loc"], cu[k], starts[k], P ** -0.5,
                              out, lse)
    return out, lse
