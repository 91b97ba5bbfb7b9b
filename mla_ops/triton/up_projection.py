"""Triton kernel: up-projection of a chunk's gathered latent rows to per-head keys and values.

latent           [W, L]        workspace rows (may be a strided view of the [W, L+R] workspace)
kv_b_proj_weight [N*(P+V), L]
cu_seq_lens      [n+1] int32   rows [0, cu_seq_lens[-1]) are live; the count stays on the device
out              [W, N*(P+V)]  rows [0, cu_seq_lens[-1]) written, fp32 accumulation (out=)

``out[:M] = latent[:M] @ kv_b_proj_weight.T`` with ``M = cu_seq_lens[-1]`` (oracle:
``up_project_reference`` in ``mla_ops/up_projection.py``). The grid covers the capacity W; a
program whose row tile starts at or past M exits at once, so empty chunks of a fixed-capacity
loop cost only a launch. Programs are ordered in groups of GROUP_M row tiles so that live tiles
come first and neighbouring programs share weight tiles in L2.

16-bit operands go to ``tl.dot`` as they are (tensor cores, fp32 accumulation). fp32 operands
use ``input_precision="ieee"``, as ``torch.mm`` does without TF32. bf16 under Triton's
interpreter, which has no bf16 arithmetic, is upcast to fp32 first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import device_guard


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
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(capacity, BLOCK_M)
    tiles_n = tl.cdiv(num_out, BLOCK_N)
    tiles_per_group = GROUP_M * tiles_n
    first_m = (pid // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_per_group) % group_rows
    pid_n = (pid % tiles_per_group) // group_rows

    num_rows = tl.load(cu_seq_lens_ptr + last_cu_index * stride_cu)
    if pid_m * BLOCK_M >= num_rows:
        return
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


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) on a GPU; L = 512, Nout = N*(P+V) = 4K..32K
GPU_CONFIG_16BIT = (128, 128, 64, 8, 3)
GPU_CONFIG_FP32 = (64, 64, 32, 4, 3)
GROUP_M = 8
MIN_DOT_BLOCK = 16  # tl.dot needs every block dim >= 16
INTERPRETER_MAX_BLOCK = 64  # few, fat programs: the interpreter pays per program, not per element


def _interpreter_config(capacity: int, num_out: int, latent_rank: int):
    size = lambda n: max(MIN_DOT_BLOCK, min(INTERPRETER_MAX_BLOCK, triton.next_power_of_2(n)))  # noqa: E731
    return size(capacity), size(num_out), size(latent_rank), 4, 1


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
        grid = (triton.cdiv(capacity, block_m) * triton.cdiv(num_out, block_n),)
        _up_project_kernel[grid](
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
