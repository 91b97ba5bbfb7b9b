"""Triton kernel: a GEMM over a number of rows that only the device knows, optionally per head.

    c[row(i), b, :] = a[row(i), b, :K] @ w[b].T      for i < M = loc[n], b < num_batch

a [rows, B, K] (strided; B = 1 for a plain matrix), w [B, num_out, K] (strided), c [rows, B, num_out].
``loc [n+1]`` int32 holds the live row count in its last entry, so a fixed-capacity buffer costs
only its live rows: with ``loc[-1] == 0`` a launch reads one integer and exits.

Two users:

* the up-projection of a chunk's workspace rows (``up_project`` below): one weight, ``loc`` the
  chunk's ``cu_seq_lens``, no row map;
* the absorbed path's fold (``q_lat = q_nope @ W_UK``) and unfold (``out = o_lat @ W_UV^T``), one
  weight per head, over the routed requests' tokens packed in request order (``loc`` their packed
  offsets). A *row map* sends packed row i of request r to token row ``tokens[r] + i - loc[r]``
  (``tokens`` = ``query_start_loc``): for the fold's input (MAP_A) or the unfold's output (MAP_C).
  Unrouted tokens are neither read nor written, and need no buffer rows.

The launch is persistent (``grid``: at most a few programs per SM, at most the capacity's
tiles); each program strides over the live output tiles, heads slowest, row tiles grouped by
GROUP_M so that neighbouring programs share weight tiles in L2. 16-bit operands go to ``tl.dot``
as they are (fp32 accumulation); fp32 uses ``input_precision="ieee"``, as ``torch.mm`` without
TF32; bf16 under the interpreter, which has no bf16 arithmetic, is upcast to fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import device_guard, find_request, persistent_grid, persistent_programs


@triton.jit
def _rows_gemm_tile(
    a_ptr, w_ptr, c_ptr, a_rows, c_rows, row_ok, pid_n, num_out,
    stride_a_row, stride_a_k, stride_w_out, stride_w_k, stride_c_row, stride_c_col,
    K: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile of one head (pointers already at the head)."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < num_out
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_a_row + ks[None, :] * stride_a_k
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_w_out + ks[:, None] * stride_w_k

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + ks) < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if FP32_DOT:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
        a_ptrs += BLOCK_K * stride_a_k
        w_ptrs += BLOCK_K * stride_w_k

    c_ptrs = c_ptr + c_rows.to(tl.int64)[:, None] * stride_c_row + cols.to(tl.int64)[None, :] * stride_c_col
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_requests", "capacity"])  # batch and buffer sizes change every step
def _rows_gemm_kernel(
    a_ptr,  # [rows, B, K]
    w_ptr,  # [B, num_out, K]
    c_ptr,  # [rows, B, num_out]
    loc_ptr,  # [n+1] int32: M = loc[n]; with a row map, request i owns packed rows loc[i] .. loc[i+1]
    tokens_ptr,  # [n+1] int32: request i's token rows start at tokens[i] (read only with a row map)
    num_requests, num_batch, num_out,
    capacity,  # rows of the packed buffer: live rows past it (a caller's error) are never touched
    stride_loc, stride_tokens,
    stride_a_row, stride_a_batch, stride_a_k,
    stride_w_batch, stride_w_out, stride_w_k,
    stride_c_row, stride_c_batch, stride_c_col,
    K: tl.constexpr,  # the reduction dim: fixed per model, so a constexpr trip count
    MAP_A: tl.constexpr,  # a's rows are token rows
    MAP_C: tl.constexpr,  # c's rows are token rows
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    num_rows = tl.minimum(tl.load(loc_ptr + num_requests * stride_loc), capacity)
    tiles_m = tl.cdiv(num_rows, BLOCK_M)
    tiles_n = tl.cdiv(num_out, BLOCK_N)
    tiles_per_batch = tiles_m * tiles_n
    tiles_per_group = GROUP_M * tiles_n
    tile = tl.program_id(0)
    while tile < tiles_per_batch * num_batch:  # persistent: live tiles only
        batch = (tile // tiles_per_batch).to(tl.int64)
        in_batch = tile % tiles_per_batch
        first_m = (in_batch // tiles_per_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (in_batch % tiles_per_group) % group_rows
        pid_n = (in_batch % tiles_per_group) // group_rows

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < num_rows
        a_rows = rows
        c_rows = rows
        if MAP_A or MAP_C:
            request = find_request(loc_ptr, stride_loc, num_requests, rows, 1, 0)
            token = tl.load(tokens_ptr + request * stride_tokens) + rows - tl.load(loc_ptr + request * stride_loc)
            if MAP_A:
                a_rows = token
            if MAP_C:
                c_rows = token
        _rows_gemm_tile(
            a_ptr + batch * stride_a_batch, w_ptr + batch * stride_w_batch, c_ptr + batch * stride_c_batch,
            a_rows, c_rows, row_ok, pid_n, num_out,
            stride_a_row, stride_a_k, stride_w_out, stride_w_k, stride_c_row, stride_c_col,
            K, FP32_DOT, BLOCK_M, BLOCK_N, BLOCK_K,
        )
        tile += tl.num_programs(0)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) on a GPU; K = L = 512 (up-projection, unfold) or P = 128 (fold)
GPU_CONFIG_16BIT = (128, 128, 64, 8, 3)
GPU_CONFIG_FP32 = (64, 64, 32, 4, 3)
GROUP_M = 8
PROGRAMS_PER_SM = 2  # 16-bit 128 x 128 x 64 tiles, 3 stages: 96 KB of shared memory, two fit an H200 SM
MIN_DOT_BLOCK = 16  # tl.dot needs every block dim >= 16
INTERPRETER_MAX_BLOCK = 64  # few, fat programs: the interpreter pays per program, not per element


def config(dtype: torch.dtype, interpreted: bool, capacity: int, num_out: int, k: int):
    """``(fp32_dot, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages))`` for operands of ``dtype``."""
    fp32_dot = dtype not in (torch.float16, torch.bfloat16) or (interpreted and dtype == torch.bfloat16)
    if interpreted:
        size = lambda n: max(MIN_DOT_BLOCK, min(INTERPRETER_MAX_BLOCK, triton.next_power_of_2(n)))  # noqa: E731
        return fp32_dot, (size(capacity), size(num_out), size(k), 4, 1)
    return fp32_dot, GPU_CONFIG_FP32 if fp32_dot else GPU_CONFIG_16BIT


def tiles(num_rows: int, num_out: int, block_m: int, block_n: int, num_batch: int = 1) -> int:
    """Output tiles the kernel computes for ``num_rows`` live rows (the in-kernel tile count)."""
    return triton.cdiv(num_rows, block_m) * triton.cdiv(num_out, block_n) * num_batch


def grid(capacity: int, num_out: int, block_m: int, block_n: int, programs: int, num_batch: int = 1) -> tuple[int]:
    """The launch grid for a ``capacity``-row buffer: at most ``programs``, at most its tiles."""
    return persistent_grid(tiles(capacity, num_out, block_m, block_n, num_batch), programs)


def rows_gemm(a, w, c, loc, tokens=None, *, map_a: bool = False, map_c: bool = False) -> None:
    """``c[row(i), b] = a[row(i), b, :K] @ w[b].T`` for live rows ``i < loc[-1]`` (module doc).

    a [rows_a, B, >= K], w [B, num_out, K], c [rows_c, B, num_out] (views welcome); the buffer
    whose rows are packed holds at least ``loc[-1]`` rows. ``tokens`` (with ``map_a`` / ``map_c``):
    the token offsets of the requests packed by ``loc``.
    """
    num_batch, num_out, k = w.shape
    capacity = (c if map_a else a).shape[0]  # the packed side's rows bound the live rows
    with device_guard(a) as interpreted:
        if capacity == 0 or num_out == 0 or num_batch == 0:
            return
        fp32_dot, blocks = config(a.dtype, interpreted, capacity, num_out, k)
        block_m, block_n, block_k, num_warps, num_stages = blocks
        if tokens is None:
            tokens = loc  # never read without a row map
        programs = persistent_programs(a, interpreted, PROGRAMS_PER_SM)
        _rows_gemm_kernel[grid(capacity, num_out, block_m, block_n, programs, num_batch)](
            a, w, c, loc, tokens,
            loc.shape[0] - 1, num_batch, num_out, capacity,
            loc.stride(0), tokens.stride(0),
            *a.stride(), *w.stride(), *c.stride(),
            K=k, MAP_A=map_a, MAP_C=map_c, FP32_DOT=fp32_dot,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M,
            num_warps=num_warps, num_stages=num_stages,
        )


def up_project(latent, kv_b_proj_weight, cu_seq_lens, out) -> None:
    """The up-projection op: ``out[:M] = latent[:M] @ kv_b_proj_weight.T``, M = cu_seq_lens[-1] read on
    the device (one weight; empty chunks of a fixed-capacity loop cost only a launch)."""
    rows_gemm(latent.unsqueeze(1), kv_b_proj_weight.unsqueeze(0), out.unsqueeze(1), cu_seq_lens)
