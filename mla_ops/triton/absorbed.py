"""Triton kernel: absorbed ("MQA") context attention straight over the paged latent cache.

q                [T, N, P+R]   rotated queries            kv_cache [num_blocks, PAGE_SIZE, L+R]
kv_b_proj_weight [N*(P+V), L]  W_UK [N, P, L], W_UV [N, V, L] (``mla_ops.absorbed.split_kv_b_proj``)
block_table      [B, max_blocks] int32   query_start_loc [B+1] int32   context_lens [B] int32
k_scale          [1] float32 or None (float8_e4m3fn caches: dequantized = stored * k_scale)
-> out           [T, N, V]   lse [N, T] float32, natural log; rows of requests without context
                             are left untouched (out=)

Oracle: ``absorbed_reference`` in ``mla_ops/absorbed.py``. Three steps, no host read of a device
value (one launch serves any batch of a capacity bucket and can be captured in a CUDA graph):

1. fold (torch): ``q_lat [N, T, L] = q_nope @ W_UK``, one batched matmul in q's dtype;
2. the kernel below: per request, non-causal attention of ``[q_lat | q_pe]`` over the request's
   latent rows ``[kv_c | k_pe]`` read in place from the paged cache (one KV head shared by all
   query heads; no gather, no workspace), giving ``o_lat [N, T, L]`` and the LSE, written only for
   requests with ``context_lens > 0``;
3. unfold (torch): ``out = o_lat @ W_UV^T``, one batched matmul, written with ``torch.where`` over
   a per-token "has context" mask computed on the device.

Kernel tiles. The rows of a tile are BLOCK_M query tokens x BLOCK_H heads (heads fastest), so each
latent key tile ``[BLOCK_N, L+R]`` is loaded once for BLOCK_M * BLOCK_H query rows. The value
width L is cut into BLOCK_DV slices along grid axis 2; each slice recomputes the scores (2(L+R)
FLOPs per row and key) to keep the fp32 accumulator at ``[BLOCK_M * BLOCK_H, BLOCK_DV]``. Slice 0
writes the LSE. The online softmax runs in fp32 on base-2 statistics; the LSE leaves natural-log.

Work distribution: as in ``mla_ops/triton/attention.py`` (same ``find_request``). Grid axis 0 has
``T // BLOCK_M + B`` slots; request r owns slots ``query_start_loc[r] // BLOCK_M + r ..
query_start_loc[r+1] // BLOCK_M + r``, a closed-form bound of its ``ceil(q_r / BLOCK_M)`` tiles.
Axis 1 is the head group, axis 2 the value slice. A program exits at once when its slot is spare,
its request has no queries or no context.

fp8 caches are decoded from their bits (``e4m3fn_to_float32`` of ``mla_ops/triton/_common.py``,
shared with the gather: exact on GPUs and in Triton's interpreter, whose float8 cast mangles NaN
codes). The raw e4m3
values are exact in fp16/bf16, so they enter ``tl.dot`` undequantized; ``k_scale`` multiplies
the fp32 scores (folded into the softmax scale) and the fp32 output accumulator instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..absorbed import absorbed_dims, fold_queries, split_kv_b_proj, token_requests, unfold_outputs
from ._common import (
    LN2, LOG2E, device_guard, dot_dtype, dot_precision, e4m3fn_to_float32, find_request, online_softmax_step,
)


@triton.jit
def _absorbed_key_tile(
    acc, l_i, m_i,  # [ROWS, BLOCK_DV] fp32, [ROWS] fp32 (base-2 running sum and max)
    q_lat, q_pe,  # [ROWS, BLOCK_L], [ROWS, BLOCK_R] in DOT_DTYPE
    cache_ptr,  # [num_blocks, PAGE_SIZE, L+R]
    table_row_ptr,  # [max_blocks] the request's block table row
    stride_table_col, stride_cache_block, stride_cache_token,
    col_l, col_r, col_dv,  # [BLOCK_L, 1], [BLOCK_R, 1], [1, BLOCK_DV] int64 column offsets
    mask_l, mask_r, mask_dv,  # [BLOCK_L, 1], [BLOCK_R, 1], [1, BLOCK_DV] column bounds
    start_n, offs_n, num_keys, qk_scale,  # offs_n: tl.arange(0, BLOCK_N), made once outside the loop
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MASK_KEYS: tl.constexpr,  # key tiles may run past num_keys
    IS_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold the latent key tile ``start_n .. start_n + BLOCK_N`` into the running softmax."""
    keys = start_n + offs_n  # [BLOCK_N] context positions in the request
    page = (keys // PAGE_SIZE).to(tl.int64) * stride_table_col
    if MASK_KEYS:
        key_ok = keys < num_keys
        block = tl.load(table_row_ptr + page, mask=key_ok, other=0)
    else:
        block = tl.load(table_row_ptr + page)
    row = block.to(tl.int64) * stride_cache_block + (keys % PAGE_SIZE).to(tl.int64) * stride_cache_token
    if MASK_KEYS:
        k_lat = tl.load(cache_ptr + row[None, :] + col_l, mask=mask_l & key_ok[None, :], other=0)
        k_pe = tl.load(cache_ptr + row[None, :] + col_r, mask=mask_r & key_ok[None, :], other=0)
        v = tl.load(cache_ptr + row[:, None] + col_dv, mask=key_ok[:, None] & mask_dv, other=0)
    else:
        k_lat = tl.load(cache_ptr + row[None, :] + col_l, mask=mask_l, other=0)  # [BLOCK_L, BLOCK_N]
        k_pe = tl.load(cache_ptr + row[None, :] + col_r, mask=mask_r, other=0)  # [BLOCK_R, BLOCK_N]
        v = tl.load(cache_ptr + row[:, None] + col_dv, mask=mask_dv, other=0)  # [BLOCK_N, BLOCK_DV]
    if IS_FP8:  # raw e4m3 values; k_scale is applied to the fp32 scores and accumulator
        k_lat = e4m3fn_to_float32(k_lat.to(tl.int32))
        k_pe = e4m3fn_to_float32(k_pe.to(tl.int32))
        v = e4m3fn_to_float32(v.to(tl.int32))
    qk = tl.dot(q_lat, k_lat.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    qk = tl.dot(q_pe, k_pe.to(DOT_DTYPE), qk, input_precision=DOT_PRECISION)
    qk = qk * qk_scale  # base-2 logits; scaled before the max so any sign of the scale works
    if MASK_KEYS:
        qk = tl.where(key_ok[None, :], qk, float("-inf"))
    # Every row sees key 0 in the first tile it processes, so the running max is finite from then on.
    p, acc, l_i, m_i = online_softmax_step(qk, acc, l_i, m_i)
    acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _absorbed_inner(
    acc, l_i, m_i,  # [ROWS, BLOCK_DV] fp32, [ROWS] fp32 (base-2 running sum and max)
    q_lat, q_pe,  # [ROWS, BLOCK_L], [ROWS, BLOCK_R] in DOT_DTYPE
    cache_ptr,  # [num_blocks, PAGE_SIZE, L+R]
    table_row_ptr,  # [max_blocks] the request's block table row
    stride_table_col, stride_cache_block, stride_cache_token, stride_cache_col,
    offs_l, offs_r, offs_dv,  # [BLOCK_L], [BLOCK_R], [BLOCK_DV] column indices (offs_r from 0)
    lo, hi, num_keys, qk_scale,
    HEAD_L: tl.constexpr, HEAD_R: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MASK_KEYS: tl.constexpr,  # key tiles may run past num_keys
    IS_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Key tiles ``lo, lo + BLOCK_N, ...`` below ``hi``, folded into the running softmax."""
    mask_l = offs_l[:, None] < HEAD_L  # [BLOCK_L, 1]
    mask_r = offs_r[:, None] < HEAD_R  # [BLOCK_R, 1]
    mask_dv = offs_dv[None, :] < HEAD_L  # [1, BLOCK_DV]
    col_l = offs_l[:, None].to(tl.int64) * stride_cache_col
    col_r = (HEAD_L + offs_r)[:, None].to(tl.int64) * stride_cache_col
    col_dv = offs_dv[None, :].to(tl.int64) * stride_cache_col
    offs_n = tl.arange(0, BLOCK_N)  # made once: inside the tile it cost the fp8 variant ~650 B of spills (3.9)
    if INTERPRETED:  # bounds read from tensors: no range() under the interpreter (mla_ops/triton/_common.py)
        start_n = lo
        while start_n < hi:
            acc, l_i, m_i = _absorbed_key_tile(
                acc, l_i, m_i, q_lat, q_pe, cache_ptr, table_row_ptr, stride_table_col, stride_cache_block,
                stride_cache_token, col_l, col_r, col_dv, mask_l, mask_r, mask_dv, start_n, offs_n, num_keys, qk_scale,
                BLOCK_N, PAGE_SIZE, MASK_KEYS, IS_FP8, DOT_DTYPE, DOT_PRECISION,
            )
            start_n += BLOCK_N
    else:
        for start_n in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _absorbed_key_tile(
                acc, l_i, m_i, q_lat, q_pe, cache_ptr, table_row_ptr, stride_table_col, stride_cache_block,
                stride_cache_token, col_l, col_r, col_dv, mask_l, mask_r, mask_dv, start_n, offs_n, num_keys, qk_scale,
                BLOCK_N, PAGE_SIZE, MASK_KEYS, IS_FP8, DOT_DTYPE, DOT_PRECISION,
            )
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_requests"])  # the batch size changes every step
def _absorbed_fwd(
    q_lat_ptr,  # [T, N, L] (strided view of the launcher's [N, T, L] buffer)
    q_pe_ptr,  # [T, N, R] (column view of q)
    cache_ptr,  # [num_blocks, PAGE_SIZE, L+R] (uint8 bits for fp8 caches)
    block_table_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B+1] int32
    context_lens_ptr,  # [B] int32
    k_scale_ptr,  # [1] float32 (read only when IS_FP8)
    o_lat_ptr,  # [T, N, L]
    lse_ptr,  # [N, T] float32, natural log
    num_requests, num_heads,
    qk_scale,  # softmax_scale * LOG2E
    stride_qlt, stride_qlh, stride_qld,
    stride_qpt, stride_qph, stride_qpd,
    stride_cache_block, stride_cache_token, stride_cache_col,
    stride_table_row, stride_table_col,
    stride_qsl, stride_ctx,
    stride_olt, stride_olh, stride_old,
    stride_lh, stride_lt,
    HEAD_L: tl.constexpr, HEAD_R: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    slot = tl.program_id(0)
    head_group = tl.program_id(1)
    dv_slice = tl.program_id(2)

    request = find_request(query_start_loc_ptr, stride_qsl, num_requests, slot, BLOCK_M, 1)
    q_begin = tl.load(query_start_loc_ptr + request * stride_qsl)
    q_len = tl.load(query_start_loc_ptr + (request + 1) * stride_qsl) - q_begin
    num_keys = tl.load(context_lens_ptr + request * stride_ctx)
    m_start = (slot - (q_begin // BLOCK_M + request)) * BLOCK_M
    if (m_start < 0) | (m_start >= q_len) | (num_keys <= 0):
        return  # a spare slot, a request without queries, or without context: untouched

    offs_row = tl.arange(0, BLOCK_M * BLOCK_H)  # tile row = (token, head), heads fastest
    query_pos = m_start + offs_row // BLOCK_H  # [ROWS] positions in the request
    head = head_group * BLOCK_H + offs_row % BLOCK_H
    row_ok = (query_pos < q_len) & (head < num_heads)
    q_rows = q_begin.to(tl.int64) + query_pos  # [ROWS] token rows of q / o_lat / lse
    head = head.to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    offs_dv = dv_slice * BLOCK_DV + tl.arange(0, BLOCK_DV)

    q_lat = tl.load(
        q_lat_ptr + q_rows[:, None] * stride_qlt + head[:, None] * stride_qlh + offs_l[None, :] * stride_qld,
        mask=row_ok[:, None] & (offs_l[None, :] < HEAD_L), other=0.0,
    ).to(DOT_DTYPE)
    q_pe = tl.load(
        q_pe_ptr + q_rows[:, None] * stride_qpt + head[:, None] * stride_qph + offs_r[None, :] * stride_qpd,
        mask=row_ok[:, None] & (offs_r[None, :] < HEAD_R), other=0.0,
    ).to(DOT_DTYPE)

    if IS_FP8:
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        qk_scale = qk_scale * k_scale
    table_row_ptr = block_table_ptr + request.to(tl.int64) * stride_table_row
    m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_DV], dtype=tl.float32)
    full = (num_keys // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _absorbed_inner(
        acc, l_i, m_i, q_lat, q_pe, cache_ptr, table_row_ptr,
        stride_table_col, stride_cache_block, stride_cache_token, stride_cache_col,
        offs_l, offs_r, offs_dv, 0, full, num_keys, qk_scale,
        HEAD_L, HEAD_R, BLOCK_N, PAGE_SIZE, False, IS_FP8, DOT_DTYPE, DOT_PRECISION, INTERPRETED,
    )
    acc, l_i, m_i = _absorbed_inner(
        acc, l_i, m_i, q_lat, q_pe, cache_ptr, table_row_ptr,
        stride_table_col, stride_cache_block, stride_cache_token, stride_cache_col,
        offs_l, offs_r, offs_dv, full, num_keys, num_keys, qk_scale,
        HEAD_L, HEAD_R, BLOCK_N, PAGE_SIZE, True, IS_FP8, DOT_DTYPE, DOT_PRECISION, INTERPRETED,
    )

    acc = acc / l_i[:, None]
    if IS_FP8:
        acc = acc * k_scale
    o_ptrs = o_lat_ptr + q_rows[:, None] * stride_olt + head[:, None] * stride_olh + offs_dv[None, :] * stride_old
    tl.store(o_ptrs, acc.to(o_lat_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_L))
    if dv_slice == 0:
        lse = (m_i + tl.math.log2(l_i)) * LN2
        tl.store(lse_ptr + head * stride_lh + q_rows * stride_lt, lse.to(lse_ptr.dtype.element_ty), mask=row_ok)


# (rows per tile = BLOCK_M * BLOCK_H, BLOCK_N, BLOCK_DV, num_warps, num_stages); not measured yet.
# At DeepSeek dims (L=512, R=64) a 16-bit program holds acc [64, 256] fp32 and q [64, 576]; one
# stage of key tiles is [576, 32] + [32, 256] (52 KB). Two value slices: scores are computed
# twice, in exchange for half the accumulator. Token and request counts are no compile-time keys.
CUDA_CONFIG_16BIT = (64, 32, 256, 8, 2)
CUDA_CONFIG_FP32 = (16, 16, 128, 4, 1)
# The interpreter: small tiles, so tiny test shapes still cover multi-tile loops and value slices.
INTERPRETER_CONFIG = (16, 16, 16, 1, 1)


def latent_attention(q_lat, q_pe, kv_cache, block_table, query_start_loc, context_lens, softmax_scale, k_scale,
                     o_lat, lse) -> None:
    """The kernel over queries already in the latent space: q_lat [T, H, L], q_pe [T, H, R] (views
    welcome) -> o_lat [T, H, L], lse [H, T]. Rows of requests without context stay untouched."""
    num_tokens, num_heads, latent = q_lat.shape
    rope, num_requests = q_pe.shape[2], context_lens.shape[0]
    with device_guard(q_lat) as interpreted:
        dtype = dot_dtype(q_lat.dtype, interpreted, "absorbed")
        if num_tokens == 0 or num_heads == 0 or num_requests == 0 or kv_cache.numel() == 0:
            return  # nothing to attend: every row stays untouched
        rows, block_n, block_dv, num_warps, num_stages = (
            INTERPRETER_CONFIG if interpreted else CUDA_CONFIG_FP32 if q_lat.dtype == torch.float32 else CUDA_CONFIG_16BIT
        )
        block_l = max(16, triton.next_power_of_2(latent))
        block_dv = min(block_dv, block_l)
        block_h = min(triton.next_power_of_2(num_heads), rows)
        block_m = rows // block_h
        is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
        cache = kv_cache.view(torch.uint8) if is_fp8 else kv_cache

        grid = (num_tokens // block_m + num_requests, triton.cdiv(num_heads, block_h), triton.cdiv(latent, block_dv))
        _absorbed_fwd[grid](
            q_lat, q_pe, cache, block_table, query_start_loc, context_lens,
            k_scale if is_fp8 else lse,  # a never-read placeholder pointer otherwise
            o_lat, lse,
            num_requests, num_heads, softmax_scale * LOG2E.value,
            *q_lat.stride(), *q_pe.stride(), *cache.stride(), *block_table.stride(),
            query_start_loc.stride(0), context_lens.stride(0), *o_lat.stride(), *lse.stride(),
            HEAD_L=latent, HEAD_R=rope,
            BLOCK_L=block_l, BLOCK_R=max(16, triton.next_power_of_2(rope)), BLOCK_DV=block_dv,
            BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_N=block_n,
            PAGE_SIZE=kv_cache.shape[1], IS_FP8=is_fp8,
            DOT_DTYPE=dtype, DOT_PRECISION=dot_precision(dtype), INTERPRETED=interpreted,
            num_warps=num_warps, num_stages=num_stages,
        )


def absorbed_context_attention(
    q, kv_cache, block_table, query_start_loc, context_lens, kv_b_proj_weight, softmax_scale, k_scale, out, lse
) -> None:
    """Same contract as ``torch.ops.mla_ops.absorbed_context_attention`` (module docstring)."""
    num_tokens = q.shape[0]
    num_requests = context_lens.shape[0]
    num_heads, latent, nope, rope, _ = absorbed_dims(q, kv_cache, kv_b_proj_weight)
    with device_guard(q) as interpreted:
        dot_dtype(q.dtype, interpreted, "absorbed")  # a TypeError before any work
        if num_tokens == 0 or num_heads == 0 or num_requests == 0 or kv_cache.numel() == 0:
            return  # nothing to attend: every row stays untouched
        w_uk, w_uv = split_kv_b_proj(kv_b_proj_weight, num_heads, nope)
        q_lat = fold_queries(q, w_uk, q.dtype)  # [N, T, L]
        o_lat = torch.empty_like(q_lat)  # rows of requests without context stay garbage, never read
        latent_attention(q_lat.transpose(0, 1), q[..., nope:], kv_cache, block_table, query_start_loc, context_lens,
                         softmax_scale, k_scale, o_lat.transpose(0, 1), lse)  # [T, N, L] views

        # Unfold every token, then keep the rows of requests with context (device-side mask).
        request, _, valid = token_requests(query_start_loc, num_tokens)
        has_context = valid & (context_lens[request] > 0)  # [T]
        new_out = unfold_outputs(o_lat, w_uv).transpose(0, 1)  # [T, N, V]
        out.copy_(torch.where(has_context[:, None, None], new_out.to(out.dtype), out))
