"""Triton kernel: gather a chunk's context rows from the paged latent cache into the workspace.

kv_cache     [num_blocks, block_size, L+R]  fp32/fp16/bf16, or float8_e4m3fn with k_scale, or
                                            fp8_ds_mla's [.., .., 656] uint8 rows (dequantized here)
block_table  [n, max_blocks] int32           rows of the chunk's requests, in order
cu_seq_lens  [n+1] int32 (device)            workspace row offsets of the requests
starts       [n] int32                       first context position taken from each request
k_scale      [1] float32 or None             dequantized = stored * k_scale (fp8 caches only)
workspace    [W, L+R]                        rows [0, cu_seq_lens[-1]) written (out=)

Workspace row ``cu_seq_lens[i] + j`` receives context token ``p = starts[i] + j`` of request i:
``kv_cache[block_table[i, p // block_size], p % block_size]`` (oracle: ``gather_reference`` in
``mla_ops/ops/gather.py``). The row count ``cu_seq_lens[-1]`` stays on the device: the launch is
persistent (``grid``: at most a few programs per SM, at most the capacity's tiles), and each
program strides over the live (row tile, column tile) pairs counted from the device row count,
so a fixed-capacity chunk loop pays only a launch for empty chunks. Each row finds its
request by a binary search over ``cu_seq_lens``; no per-row host metadata exists.

fp8 rows are decoded from their bits (the cache is read as uint8; ``e4m3fn_to_float32`` of
``mla_ops/triton/_common.py``): exact on every GPU and in Triton's interpreter, whose own
float8e4nv cast turns the NaN codes 0x7f / 0xff into +-480.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import device_guard, ds_mla_row, e4m3fn_to_float32, find_request, persistent_grid, persistent_programs


@triton.jit
def _gather_tile(
    cache_ptr, block_table_ptr, cu_seq_lens_ptr, starts_ptr, k_scale_ptr, workspace_ptr,
    row_tile, col_tile, num_rows, num_requests, block_size, width,
    stride_cache_block, stride_cache_token, stride_cache_col, stride_table_row, stride_table_col,
    stride_cu, stride_starts, stride_ws_row, stride_ws_col,
    IS_FP8: tl.constexpr, IS_DS_MLA: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    """Copy the (row tile, column tile) block of the chunk into the workspace."""
    rows = row_tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < num_rows
    request = find_request(cu_seq_lens_ptr, stride_cu, num_requests, rows, 1, 0)
    first_row = tl.load(cu_seq_lens_ptr + request * stride_cu)
    position = tl.load(starts_ptr + request * stride_starts) + rows - first_row
    table_offset = request.to(tl.int64) * stride_table_row + (position // block_size).to(tl.int64) * stride_table_col
    block = tl.load(block_table_ptr + table_offset, mask=row_mask, other=0)
    src_row = block.to(tl.int64) * stride_cache_block + (position % block_size).to(tl.int64) * stride_cache_token

    cols = col_tile * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = row_mask[:, None] & (cols < width)[None, :]
    src = cache_ptr + src_row[:, None] + cols.to(tl.int64)[None, :] * stride_cache_col
    if IS_DS_MLA:  # packed rows (byte columns): dequantized here
        values = ds_mla_row(cache_ptr + src_row[:, None], cols[None, :], mask)
    elif IS_FP8:
        values = e4m3fn_to_float32(tl.load(src, mask=mask, other=0).to(tl.int32))
        values = values * tl.load(k_scale_ptr).to(tl.float32)
    else:
        values = tl.load(src, mask=mask, other=0.0)
    dst_row = rows.to(tl.int64) * stride_ws_row
    dst = workspace_ptr + dst_row[:, None] + cols.to(tl.int64)[None, :] * stride_ws_col
    tl.store(dst, values.to(workspace_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_requests"])
def _gather_context_kernel(
    cache_ptr,  # [num_blocks, block_size, width]  (uint8 bits for fp8 caches)
    block_table_ptr,  # [n, max_blocks] int32
    cu_seq_lens_ptr,  # [n+1] int32
    starts_ptr,  # [n] int32
    k_scale_ptr,  # [1] float32 (read only when IS_FP8)
    workspace_ptr,  # [W, width]
    num_requests,
    block_size,
    width,
    stride_cache_block,
    stride_cache_token,
    stride_cache_col,
    stride_table_row,
    stride_table_col,
    stride_cu,
    stride_starts,
    stride_ws_row,
    stride_ws_col,
    IS_FP8: tl.constexpr,
    IS_DS_MLA: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # Persistent: stride over the live tiles only, counted from the device row count.
    num_rows = tl.load(cu_seq_lens_ptr + num_requests * stride_cu)
    col_tiles = tl.cdiv(width, BLOCK_COLS)
    num_tiles = tl.cdiv(num_rows, BLOCK_ROWS) * col_tiles
    tile = tl.program_id(0)
    while tile < num_tiles:
        _gather_tile(
            cache_ptr, block_table_ptr, cu_seq_lens_ptr, starts_ptr, k_scale_ptr, workspace_ptr,
            tile // col_tiles, tile % col_tiles, num_rows, num_requests, block_size, width,
            stride_cache_block, stride_cache_token, stride_cache_col, stride_table_row, stride_table_col,
            stride_cu, stride_starts, stride_ws_row, stride_ws_col,
            IS_FP8, IS_DS_MLA, BLOCK_ROWS, BLOCK_COLS,
        )
        tile += tl.num_programs(0)


BLOCK_ROWS = 32
MAX_BLOCK_COLS = 64  # L+R = 576 = 9 * 64: no masked lanes at DeepSeek sizes
NUM_WARPS = 4
PROGRAMS_PER_SM = 8  # a light copy kernel: many resident programs keep loads in flight


def block_columns(width: int) -> int:
    return min(MAX_BLOCK_COLS, triton.next_power_of_2(width))


def tiles(num_rows: int, width: int) -> int:
    """Tiles the kernel copies for ``num_rows`` rows (the in-kernel ``num_tiles``)."""
    return triton.cdiv(num_rows, BLOCK_ROWS) * triton.cdiv(width, block_columns(width))


def grid(capacity: int, width: int, programs: int) -> tuple[int]:
    """The launch grid for a [capacity, width] workspace: at most ``programs``, at most its tiles."""
    return persistent_grid(tiles(capacity, width), programs)


def gather_context(kv_cache, block_table, cu_seq_lens, starts, k_scale, workspace) -> None:
    """Write workspace rows [0, cu_seq_lens[-1]) (a device count, never read here); see module doc."""
    num_requests = block_table.shape[0]
    capacity, width = workspace.shape
    with device_guard(workspace) as interpreted:
        if capacity == 0 or width == 0 or num_requests == 0:
            return
        is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
        cache = kv_cache.view(torch.uint8) if is_fp8 else kv_cache
        block_cols = block_columns(width)
        grid_ = grid(capacity, width, persistent_programs(workspace, interpreted, PROGRAMS_PER_SM))
        _gather_context_kernel[grid_](
            cache,
            block_table,
            cu_seq_lens,
            starts,
            k_scale if is_fp8 else workspace,  # a never-read placeholder pointer otherwise
            workspace,
            num_requests,
            kv_cache.shape[1],
            width,
            *cache.stride(),
            *block_table.stride(),
            cu_seq_lens.stride(0),
            starts.stride(0),
            *workspace.stride(),
            IS_FP8=is_fp8,
            IS_DS_MLA=kv_cache.dtype == torch.uint8,
            BLOCK_ROWS=BLOCK_ROWS,
            BLOCK_COLS=block_cols,
            num_warps=NUM_WARPS,
        )
