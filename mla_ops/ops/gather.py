"""Gathering a chunk's context rows from the paged latent cache into the workspace.

kv_cache     [num_blocks, block_size, L+R]  bf16/fp16/fp32, or float8_e4m3fn with k_scale, or
                                            fp8_ds_mla's [.., .., 656] uint8 rows (cache_formats)
block_table  [n, max_blocks] int32           rows of the chunk's requests, in order
cu_seq_lens  [n+1] int32                     workspace row offsets of the requests
starts       [n] int32                       first context position taken from each request
k_scale      [1] float32 or None             dequantized = stored * k_scale (fp8 caches only)
workspace    [>= cu_seq_lens[-1], L+R]       written in rows [0, cu_seq_lens[-1]) (out=)

Workspace row ``cu_seq_lens[i] + j`` receives context token ``p = starts[i] + j`` of request i:
``kv_cache[block_table[i, p // block_size], p % block_size]``.
"""

from __future__ import annotations

import torch

from .cache_formats import latent_rows


def context_row_locations(
    block_table: torch.Tensor, cu_seq_lens: torch.Tensor, starts: torch.Tensor, num_rows: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache (block, offset) of workspace rows ``[0, num_rows)``, each int64 [num_rows]; rows past
    ``cu_seq_lens[-1]`` (a count that may stay on the device) point at block 0, offset 0."""
    rows = torch.arange(num_rows, device=block_table.device)
    live = rows < cu_seq_lens[-1]
    request = (torch.searchsorted(cu_seq_lens, rows.to(cu_seq_lens.dtype), right=True) - 1).clamp(0, starts.shape[0] - 1)
    position = torch.where(live, starts.long()[request] + rows - cu_seq_lens.long()[request], 0)
    return torch.where(live, block_table.long()[request, position // block_size], 0), position % block_size


def gather_reference(kv_cache, block_table, cu_seq_lens, starts, k_scale, workspace) -> None:
    num_rows = int(cu_seq_lens[-1])  # host read: this is the CPU / oracle path
    if num_rows == 0:
        return
    block, offset = context_row_locations(block_table, cu_seq_lens, starts, num_rows, kv_cache.shape[1])
    # Dequantized in float32 (as the kernels do); float caches keep their values. No copy of the cache.
    quantized = kv_cache.dtype in (torch.float8_e4m3fn, torch.uint8)
    rows = latent_rows(kv_cache, block, offset, k_scale, torch.float32 if quantized else kv_cache.dtype)
    workspace.narrow(0, 0, num_rows).copy_(rows)


@torch.library.custom_op("mla_ops::gather_context", mutates_args=("workspace",))
def _gather_context(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    starts: torch.Tensor,
    k_scale: torch.Tensor | None,
    workspace: torch.Tensor,
) -> None:
    gather_reference(kv_cache, block_table, cu_seq_lens, starts, k_scale, workspace)


@_gather_context.register_fake
def _(kv_cache, block_table, cu_seq_lens, starts, k_scale, workspace) -> None:
    return None
