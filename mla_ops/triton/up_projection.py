"""Triton kernel: up-projection of a chunk's gathered latent rows to per-head keys and values.

latent           [W, L]        workspace rows (may be a strided view of the [W, L+R] workspace)
kv_b_proj_weight [N*(P+V), L]
cu_seq_lens      [n+1] int32   rows [0, cu_seq_lens[-1]) are live; the count stays on the device
out              [W, N*(P+V)]  rows [0, cu_seq_lens[-1]) written, fp32 accumulation (out=)

``out[:M] = latent[:M] @ kv_b_proj_weight.T`` with ``M = cu_seq_lens[-1]`` (oracle:
``up_project_reference`` in ``mla_ops/up_projection.py``). The launch is persistent (``grid``:
at most a few programs per SM, at most the capacity's tiles); each program strides over the
live output tiles counted from M, so empty chunks of a fixed-capacity loop cost only a launch.
Tiles are ordered in groups of GROUP_M row tiles so that neighbouring programs share weight
tiles in L2.

16-bit operands go to ``tl.dot`` as they are (tensor cores, fp32 accumulation). fp32 operands
use ``input_precision="ieee"``, as ``torch.mm`` does without TF32. bf16 under Triton's
interpreter, which has no bf16 arithmetic, is upcast to fp32 first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import device_guard, persistent_grid, persistent_programs


@triton.jit
def _up_project_tile(
    latent_ptr, weight_ptr, out_ptr, pid_m, pid_n, num_rows, num_out,
    stride_latent_row, stride_latent_col, stride_weight_row, stride_weight_col, stride_out_row, stride_out_col,
    LATENT_RANK: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < num_rows
    col_mask = cols < num_out
    a_ptrs = latent_ptr + rows.to(tl.int64)[:, None] * stride_latent_row + ks[None, :] * stride_latent_col
    b_ptrs = weight_ptr + cols.to(tl.int64)[None, :] * stride_weight_row + ks[:, None] * stride_weight_col

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, LATENT_RANK, BLOCK_K):
        k_mask = (k + ks) < LATENT_RANK
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if FP32_DOT:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_latent_col
        b_ptrs += BLOCK_K * stride_weight_col

    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out_row + cols.to(tl.int64)[None, :] * stride_out_col
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _up_project_kernel(
    latent_ptr,  # [W, L]
    weight_ptr,  # [Nout, L]
    cu_seq_lens_ptr,  # [n+1] int32: M = cu_seq_lens[-1]
    out_ptr,  # [W, Nout]
    last_cu_index,  # n
    capacity,  # W
    num_out,  # Nout
    stride_cu,
    stride_latent_row,
    stride_latent_col,
    stride_weight_row,
    stride_weight_col,
    stride_out_row,
    stride_out_col,
    LATENT_RANK: tl.constexpr,  # L, the reduction dim: fixed per model, so a constexpr trip count
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Persistent: stride over the live output tiles only, counted from the device row count.
    num_rows = tl.load(cu_seq_lens_ptr + last_cu_index * stride_cu)
    tiles_m = tl.cdiv(num_rows, BLOCK_M)
    tiles_n = tl.cdiv(num_out, BLOCK_N)
    tiles_per_group = GROUP_M * tiles_n
    tile = tl.program_id(0)
    while tile < tiles_m * tiles_n:
        first_m = (tile // tiles_per_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % tiles_per_group) % group_rows
        pid_n = (tile % tiles_per_group) // group_rows
        _up_project_tile(
            latent_ptr, weight_ptr, out_ptr, pid_m, pid_n, num_rows, num_out,
            stride_latent_row, stride_latent_col, stride_weight_row, stride_weight_col, stride_out_row, stride_out_col,
            LATENT_RANK, FP32_DOT, BLOCK_M, BLOCK_N, BLOCK_K,
        )
        tile += tl.num_programs(0)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) on a GPU; L = 512, Nout = N*(P+V) = 4K..32K
GPU_CONFIG_16BIT = (128, 128, 64, 8, 3)
GPU_CONFIG_FP32 = (64, 64, 32, 4, 3)
GROUP_M = 8
PROGRAMS_PER_SM = 2  # 16-bit 128 x 128 x 64 tiles, 3 stages: 96 KB of shared memory, two fit an H200 SM
MIN_DOT_BLOCK = 16  # tl.dot needs every block dim >= 16
INTERPRETER_MAX_BLOCK = 64  # few, fat programs: the interpreter pays per program, not per element


def _interpreter_config(capacity: int, num_out: int, latent_rank: int):
    size = lambda n: max(MIN_DOT_BLOCK, min(INTERPRETER_MAX_BLOCK, triton.next_power_of_2(n)))  # noqa: E731
    return size(capacity), size(num_out), size(latent_rank), 4, 1


def tiles(num_rows: int, num_out: int, block_m: int, block_n: int) -> int:
    """Output tiles the kernel computes for ``num_rows`` rows (the in-kernel tile count)."""
    return triton.cdiv(num_rows, block_m) * triton.cdiv(num_out, block_n)


def grid(capacity: int, num_out: int, block_m: int, block_n: int, programs: int) -> tuple[int]:
    """The launch grid for a capacity-row workspace: at most ``programs``, at most its tiles."""
    return persistent_grid(tiles(capacity, num_out, block_m, block_n), programs)


def up_project(latent, kv_b_proj_weight, cu_seq_lens, out) -> None:
    """``out[:M] = latent[:M] @ kv_b_proj_weight.T``, M = cu_seq_lens[-1] read on the device."""
    capacity, latent_rank = latent.shape
    num_out = kv_b_proj_weight.shape[0]
    with device_guard(latent) as interpreted:
        if capacity == 0 or num_out == 0:
            return
        # bf16 under the interpreter, which has no bf16 arithmetic, runs as fp32.
        fp32_dot = latent.dtype not in (torch.float16, torch.bfloat16) or (
            interpreted and latent.dtype == torch.bfloat16
        )
        if interpreted:
            block_m, block_n, block_k, num_warps, num_stages = _interpreter_config(capacity, num_out, latent_rank)
        else:
            block_m, block_n, block_k, num_warps, num_stages = GPU_CONFIG_FP32 if fp32_dot else GPU_CONFIG_16BIT
        programs = persistent_programs(latent, interpreted, PROGRAMS_PER_SM)
        _up_project_kernel[grid(capacity, num_out, block_m, block_n, programs)](
            latent,
            kv_b_proj_weight,
            cu_seq_lens,
            out,
            cu_seq_lens.shape[0] - 1,
            capacity,
            num_out,
            cu_seq_lens.stride(0),
            *latent.stride(),
            *kv_b_proj_weight.stride(),
            *out.stride(),
            LATENT_RANK=latent_rank,
            FP32_DOT=fp32_dot,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            GROUP_M=GROUP_M,
            num_warps=num_warps,
            num_stages=num_stages,
        )
