"""Triton kernel: absorbed ("MQA") context attention straight over the paged latent cache.

q                [T, N, P+R]   rotated queries            kv_cache [num_blocks, PAGE_SIZE, L+R]
kv_b_proj_weight [N*(P+V), L]  W_UK [N, P, L], W_UV [N, V, L] (``mla_ops._mla.split_kv_b_proj``)
block_table      [B, max_blocks] int32   query_start_loc [B+1] int32   context_lens [B] int32
k_scale          [1] float32 or None (float8_e4m3fn caches: dequantized = stored * k_scale); fp8_ds_mla
                 caches ([.., .., 656] uint8, their own scales) are dequantized as each key tile is read
-> out           [T, N, V]   lse [N, T] float32, natural log; rows of requests without context
                             are left untouched (out=)

absorbed_rows    int: rows of the packed scratch (q_lat, o_lat), at least the routed tokens (-1: T)
sliding_window   int w (0: none): query j of request r (position c_r + j) reads only positions ``c_r + j - w + 1
                 ..``: a query tile's key loop starts at its first query's lowest, every tile masked; a row that
                 sees no key gets 0 / -inf

Oracle: ``absorbed_reference`` in ``mla_ops/ops/absorbed.py``. Only the tokens of requests with
context ("routed" here) are touched. They are packed in request order at the device-computed
offsets ``loc = absorbed_token_loc(query_start_loc, context_lens)`` ([B+1]), and every launch is
persistent and reads its live count ``loc[-1]`` on the device, so no host read is needed (one
launch sequence serves any batch and can be captured in a CUDA graph), and a batch that routes
nothing costs three launches that each read one integer:

1. fold (``rows_gemm``, per head): ``q_lat[i] = q_nope[token(i)] @ W_UK`` for packed rows i;
2. the kernel below: per request, non-causal attention of ``[q_lat | q_pe]`` over the request's
   latent rows ``[kv_c | k_pe]`` read in place from the paged cache (one KV head shared by all
   query heads; no gather), giving ``o_lat`` (packed rows) and the LSE (token rows);
3. unfold (``rows_gemm``, per head): ``out[token(i)] = o_lat[i] @ W_UV^T``.

Kernel tiles. The rows of a tile are BLOCK_M query tokens x BLOCK_H heads (heads fastest), so each
latent key tile ``[BLOCK_N, L+R]`` is loaded once for BLOCK_M * BLOCK_H query rows. The value
width L is cut into BLOCK_DV slices; each slice recomputes the scores (2(L+R) FLOPs per row and
key) to keep the fp32 accumulator at ``[BLOCK_M * BLOCK_H, BLOCK_DV]``. Slice 0 writes the LSE.
The online softmax runs in fp32 on base-2 statistics; the LSE leaves natural-log.

Work distribution: as in ``mla_ops/triton/attention.py`` (same ``find_request``), over the packed
rows: request r owns query-tile slots ``loc[r] // BLOCK_M + r .. loc[r+1] // BLOCK_M + r``, a
closed-form bound of its ``ceil(q_r / BLOCK_M)`` tiles, so there are ``loc[-1] // BLOCK_M + B``
slots. The programs (at most a few per SM) stride over (slot, head group, value slice) items;
an item does nothing when its slot is spare or its request is not routed.

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

from .. import _mla
from .._mla import MLADims, split_kv_b_proj
from ._common import (
    LN2, LOG2E, device_guard, dot_dtype, dot_precision, ds_mla_latent, ds_mla_rope, e4m3fn_to_float32, find_request,
    neg_inf_to_nan, online_softmax_step, online_softmax_step_masked, persistent_grid, persistent_programs,
)
from .rows_gemm import rows_gemm


@triton.jit
def _absorbed_key_tile(
    acc, l_i, m_i,  # [ROWS, BLOCK_DV] fp32, [ROWS] fp32 (base-2 running sum and max)
    q_lat, q_pe,  # [ROWS, BLOCK_L], [ROWS, BLOCK_R] in DOT_DTYPE
    cache_ptr,  # [num_blocks, PAGE_SIZE, L+R]
    table_row_ptr,  # [max_blocks] the request's block table row
    stride_table_col, stride_cache_block, stride_cache_token,
    col_l, col_r, col_dv,  # [BLOCK_L, 1], [BLOCK_R, 1], [1, BLOCK_DV] int64 column offsets
    mask_l, mask_r, mask_dv,  # [BLOCK_L, 1], [BLOCK_R, 1], [1, BLOCK_DV] column bounds
    key_floor,  # [ROWS] (WINDOW only) the lowest position each row sees
    start_n, offs_n, num_keys, qk_scale,  # offs_n: tl.arange(0, BLOCK_N), made once outside the loop
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MASK_KEYS: tl.constexpr,  # key tiles may run past num_keys
    WINDOW: tl.constexpr,  # a sliding window: position >= key_floor
    IS_FP8: tl.constexpr,
    IS_DS_MLA: tl.constexpr,  # fp8_ds_mla byte rows (column offsets are byte offsets), dequantized here
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_L: tl.constexpr,
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
    if IS_DS_MLA:
        if MASK_KEYS:
            k_lat = ds_mla_latent(cache_ptr + row[None, :], col_l, mask_l & key_ok[None, :])
            k_pe = ds_mla_rope(cache_ptr + row[None, :], col_r - HEAD_L, mask_r & key_ok[None, :])
            v = ds_mla_latent(cache_ptr + row[:, None], col_dv, key_ok[:, None] & mask_dv)
        else:
            k_lat = ds_mla_latent(cache_ptr + row[None, :], col_l, mask_l)  # [BLOCK_L, BLOCK_N]
            k_pe = ds_mla_rope(cache_ptr + row[None, :], col_r - HEAD_L, mask_r)  # [BLOCK_R, BLOCK_N]
            v = ds_mla_latent(cache_ptr + row[:, None], col_dv, mask_dv)  # [BLOCK_N, BLOCK_DV]
    elif MASK_KEYS:
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
    qk = neg_inf_to_nan(qk * qk_scale)  # base-2 logits; scaled before the max so any sign of the scale works
    if MASK_KEYS:
        qk = tl.where(key_ok[None, :], qk, float("-inf"))
    if WINDOW:  # a row may see no key of this tile, nor of the ones before
        qk = tl.where(keys[None, :] >= key_floor[:, None], qk, float("-inf"))
        p, acc, l_i, m_i = online_softmax_step_masked(qk, acc, l_i, m_i)
    else:
        # Every row sees key 0 in the first tile it processes, so the running max is finite from then on (or the
        # row has a non-finite score and comes out NaN, out and lse).
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
    key_floor,  # [ROWS] (WINDOW only) the lowest position each row sees
    lo, hi, num_keys, qk_scale,
    HEAD_L: tl.constexpr, HEAD_R: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MASK_KEYS: tl.constexpr,  # key tiles may run past num_keys
    WINDOW: tl.constexpr,  # a sliding window: position >= key_floor
    IS_FP8: tl.constexpr,
    IS_DS_MLA: tl.constexpr,
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
                stride_cache_token, col_l, col_r, col_dv, mask_l, mask_r, mask_dv, key_floor, start_n, offs_n, num_keys,
                qk_scale, BLOCK_N, PAGE_SIZE, MASK_KEYS, WINDOW, IS_FP8, IS_DS_MLA, DOT_DTYPE, DOT_PRECISION, HEAD_L,
            )
            start_n += BLOCK_N
    else:
        for start_n in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _absorbed_key_tile(
                acc, l_i, m_i, q_lat, q_pe, cache_ptr, table_row_ptr, stride_table_col, stride_cache_block,
                stride_cache_token, col_l, col_r, col_dv, mask_l, mask_r, mask_dv, key_floor, start_n, offs_n, num_keys,
                qk_scale, BLOCK_N, PAGE_SIZE, MASK_KEYS, WINDOW, IS_FP8, IS_DS_MLA, DOT_DTYPE, DOT_PRECISION, HEAD_L,
            )
    return acc, l_i, m_i


@triton.jit
def _absorbed_tile(
    slot, head_group, dv_slice,
    q_lat_ptr, q_pe_ptr, cache_ptr, block_table_ptr, query_start_loc_ptr, latent_loc_ptr, context_lens_ptr,
    k_scale_ptr, o_lat_ptr, lse_ptr,
    num_requests, num_heads, num_latent_rows, window, qk_scale,
    stride_qlt, stride_qlh, stride_qld,
    stride_qpt, stride_qph, stride_qpd,
    stride_cache_block, stride_cache_token, stride_cache_col,
    stride_table_row, stride_table_col,
    stride_qsl, stride_lat, stride_ctx,
    stride_olt, stride_olh, stride_old,
    stride_lh, stride_lt,
    HEAD_L: tl.constexpr, HEAD_R: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    WINDOW: tl.constexpr,
    IS_FP8: tl.constexpr,
    IS_DS_MLA: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One (query-tile slot, head group, value slice) item; spare slots and requests without
    routed queries or context do nothing."""
    request = find_request(latent_loc_ptr, stride_lat, num_requests, slot, BLOCK_M, 1)
    lat_begin = tl.load(latent_loc_ptr + request * stride_lat)
    q_len = tl.load(latent_loc_ptr + (request + 1) * stride_lat) - lat_begin
    num_keys = tl.load(context_lens_ptr + request * stride_ctx)
    m_start = (slot - (lat_begin // BLOCK_M + request)) * BLOCK_M
    if (m_start >= 0) & (m_start < q_len) & (num_keys > 0):
        q_begin = tl.load(query_start_loc_ptr + request * stride_qsl)
        offs_row = tl.arange(0, BLOCK_M * BLOCK_H)  # tile row = (token, head), heads fastest
        query_pos = m_start + offs_row // BLOCK_H  # [ROWS] positions in the request
        head = head_group * BLOCK_H + offs_row % BLOCK_H
        lat_rows = lat_begin.to(tl.int64) + query_pos  # [ROWS] rows of q_lat / o_lat
        row_ok = (query_pos < q_len) & (head < num_heads) & (lat_rows < num_latent_rows)
        q_rows = q_begin.to(tl.int64) + query_pos  # [ROWS] token rows of q_pe / lse
        head = head.to(tl.int64)
        offs_l = tl.arange(0, BLOCK_L)
        offs_r = tl.arange(0, BLOCK_R)
        offs_dv = dv_slice * BLOCK_DV + tl.arange(0, BLOCK_DV)

        q_lat = tl.load(
            q_lat_ptr + lat_rows[:, None] * stride_qlt + head[:, None] * stride_qlh + offs_l[None, :] * stride_qld,
            mask=row_ok[:, None] & (offs_l[None, :] < HEAD_L), other=0.0,
        ).to(DOT_DTYPE)
        q_pe = tl.load(
            q_pe_ptr + q_rows[:, None] * stride_qpt + head[:, None] * stride_qph + offs_r[None, :] * stride_qpd,
            mask=row_ok[:, None] & (offs_r[None, :] < HEAD_R), other=0.0,
        ).to(DOT_DTYPE)

        k_scale = 1.0
        if IS_FP8:
            k_scale = tl.load(k_scale_ptr).to(tl.float32)
        table_row_ptr = block_table_ptr + request.to(tl.int64) * stride_table_row
        m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_DV], dtype=tl.float32)
        if WINDOW:  # row j sees positions c + j - w + 1 ..: from the tile's first query's lowest on, all masked
            key_floor = num_keys + query_pos - window + 1
            acc, l_i, m_i = _absorbed_inner(
                acc, l_i, m_i, q_lat, q_pe, cache_ptr, table_row_ptr,
                stride_table_col, stride_cache_block, stride_cache_token, stride_cache_col,
                offs_l, offs_r, offs_dv, key_floor, tl.maximum(num_keys + m_start - window + 1, 0), num_keys,
                num_keys, qk_scale * k_scale, HEAD_L, HEAD_R, BLOCK_N, PAGE_SIZE, True, True, IS_FP8, IS_DS_MLA,
                DOT_DTYPE, DOT_PRECISION, INTERPRETED,
            )
        else:
            full = (num_keys // BLOCK_N) * BLOCK_N
            acc, l_i, m_i = _absorbed_inner(
                acc, l_i, m_i, q_lat, q_pe, cache_ptr, table_row_ptr,
                stride_table_col, stride_cache_block, stride_cache_token, stride_cache_col,
                offs_l, offs_r, offs_dv, query_pos, 0, full, num_keys, qk_scale * k_scale,
                HEAD_L, HEAD_R, BLOCK_N, PAGE_SIZE, False, False, IS_FP8, IS_DS_MLA, DOT_DTYPE, DOT_PRECISION,
                INTERPRETED,
            )
            acc, l_i, m_i = _absorbed_inner(
                acc, l_i, m_i, q_lat, q_pe, cache_ptr, table_row_ptr,
                stride_table_col, stride_cache_block, stride_cache_token, stride_cache_col,
                offs_l, offs_r, offs_dv, query_pos, full, num_keys, num_keys, qk_scale * k_scale,
                HEAD_L, HEAD_R, BLOCK_N, PAGE_SIZE, True, False, IS_FP8, IS_DS_MLA, DOT_DTYPE, DOT_PRECISION,
                INTERPRETED,
            )

        if WINDOW:  # a row that saw no key: the empty partial 0 / -inf (its max is -inf, its sum 1 here)
            l_i = tl.where(l_i > 0, l_i, 1.0)
        acc = acc / l_i[:, None]
        if IS_FP8:
            acc = acc * k_scale
        o_ptrs = o_lat_ptr + lat_rows[:, None] * stride_olt + head[:, None] * stride_olh + offs_dv[None, :] * stride_old
        tl.store(o_ptrs, acc.to(o_lat_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_L))
        if dv_slice == 0:
            lse = (m_i + tl.math.log2(l_i)) * LN2
            tl.store(lse_ptr + head * stride_lh + q_rows * stride_lt, lse.to(lse_ptr.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize=["num_requests", "num_latent_rows", "window"])  # sizes change every step
def _absorbed_fwd(
    q_lat_ptr,  # [M, N, L] rows in latent_loc order (a view of the launcher's buffer)
    q_pe_ptr,  # [T, N, R] (column view of q)
    cache_ptr,  # [num_blocks, PAGE_SIZE, L+R] (uint8 bits for fp8 caches)
    block_table_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B+1] int32: token rows (q_pe, lse)
    latent_loc_ptr,  # [B+1] int32: rows of q_lat / o_lat; query length = latent_loc[r+1] - latent_loc[r]
    context_lens_ptr,  # [B] int32
    k_scale_ptr,  # [1] float32 (read only when IS_FP8)
    o_lat_ptr,  # [M, N, L]
    lse_ptr,  # [N, T] float32, natural log
    num_requests, num_heads, num_latent_rows, num_head_groups, num_dv_slices,
    window,  # w (WINDOW only)
    qk_scale,  # softmax_scale * LOG2E
    stride_qlt, stride_qlh, stride_qld,
    stride_qpt, stride_qph, stride_qpd,
    stride_cache_block, stride_cache_token, stride_cache_col,
    stride_table_row, stride_table_col,
    stride_qsl, stride_lat, stride_ctx,
    stride_olt, stride_olh, stride_old,
    stride_lh, stride_lt,
    HEAD_L: tl.constexpr, HEAD_R: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    WINDOW: tl.constexpr,
    IS_FP8: tl.constexpr,
    IS_DS_MLA: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    # Persistent: stride over (slot, head group, value slice) items of the rows latent_loc counts;
    # with no such rows (no request routed here) the launch reads one offset.
    num_rows = tl.minimum(tl.load(latent_loc_ptr + num_requests * stride_lat), num_latent_rows)
    if num_rows > 0:
        items_per_slot = num_head_groups * num_dv_slices
        num_items = (num_rows // BLOCK_M + num_requests) * items_per_slot
        item = tl.program_id(0)
        while item < num_items:
            _absorbed_tile(
                item // items_per_slot, (item % items_per_slot) // num_dv_slices, item % num_dv_slices,
                q_lat_ptr, q_pe_ptr, cache_ptr, block_table_ptr, query_start_loc_ptr, latent_loc_ptr,
                context_lens_ptr, k_scale_ptr, o_lat_ptr, lse_ptr,
                num_requests, num_heads, num_latent_rows, window, qk_scale,
                stride_qlt, stride_qlh, stride_qld, stride_qpt, stride_qph, stride_qpd,
                stride_cache_block, stride_cache_token, stride_cache_col, stride_table_row, stride_table_col,
                stride_qsl, stride_lat, stride_ctx, stride_olt, stride_olh, stride_old, stride_lh, stride_lt,
                HEAD_L, HEAD_R, BLOCK_L, BLOCK_R, BLOCK_DV, BLOCK_M, BLOCK_H, BLOCK_N,
                PAGE_SIZE, WINDOW, IS_FP8, IS_DS_MLA, DOT_DTYPE, DOT_PRECISION, INTERPRETED,
            )
            item += tl.num_programs(0)


# (rows per tile = BLOCK_M * BLOCK_H, BLOCK_N, BLOCK_DV, num_warps, num_stages); not measured yet.
# At DeepSeek dims (L=512, R=64) a 16-bit program holds acc [64, 256] fp32 and q [64, 576]; one
# stage of key tiles is [576, 32] + [32, 256] (52 KB). Two value slices: scores are computed
# twice, in exchange for half the accumulator. Token and request counts are no compile-time keys.
CUDA_CONFIG_16BIT = (64, 32, 256, 8, 2)
CUDA_CONFIG_FP32 = (16, 16, 128, 4, 1)
# The interpreter: small tiles, so tiny test shapes still cover multi-tile loops and value slices.
INTERPRETER_CONFIG = (16, 16, 16, 1, 1)


PROGRAMS_PER_SM = 1  # 16-bit: q [64, 576] plus two stages of key tiles take most of an SM's shared memory


def work_items(num_rows: int, num_requests: int, num_heads: int, latent: int, block_m: int, block_h: int,
          block_dv: int) -> int:
    """(slot, head group, value slice) items of ``num_rows`` query rows: one spare slot per request."""
    return (num_rows // block_m + num_requests) * triton.cdiv(num_heads, block_h) * triton.cdiv(latent, block_dv)


def tile_shape(dtype: torch.dtype, interpreted: bool, num_heads: int, latent: int):
    """``(BLOCK_M, BLOCK_H, BLOCK_N, BLOCK_DV, num_warps, num_stages)`` for queries of ``dtype``."""
    rows, block_n, block_dv, num_warps, num_stages = (
        INTERPRETER_CONFIG if interpreted else CUDA_CONFIG_FP32 if dtype == torch.float32 else CUDA_CONFIG_16BIT
    )
    block_h = min(triton.next_power_of_2(num_heads), rows)
    block_dv = min(block_dv, max(16, triton.next_power_of_2(latent)))
    return rows // block_h, block_h, block_n, block_dv, num_warps, num_stages


def latent_attention(q_lat, q_pe, kv_cache, block_table, query_start_loc, context_lens, softmax_scale, k_scale,
                     o_lat, lse, latent_loc=None, sliding_window=0) -> None:
    """The kernel over queries already in the latent space: q_lat [M, H, L], q_pe [T, H, R] (views
    welcome) -> o_lat [M, H, L], lse [H, T]. ``latent_loc`` [B+1] places request r's queries at
    rows ``latent_loc[r] ..`` of q_lat / o_lat (None: ``query_start_loc``, M = T); a request with
    ``latent_loc[r+1] == latent_loc[r]`` or no context is skipped and its rows stay untouched.
    ``sliding_window``: w (module doc; 0: none)."""
    num_rows, num_heads, latent = q_lat.shape
    rope, num_requests = q_pe.shape[2], context_lens.shape[0]
    if latent_loc is None:
        latent_loc = query_start_loc
    with device_guard(q_lat) as interpreted:
        dtype = dot_dtype(q_lat.dtype, interpreted, "absorbed")
        if num_rows == 0 or num_heads == 0 or num_requests == 0 or kv_cache.numel() == 0:
            return  # nothing to attend: every row stays untouched
        block_m, block_h, block_n, block_dv, num_warps, num_stages = tile_shape(
            q_lat.dtype, interpreted, num_heads, latent)
        is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
        cache = kv_cache.view(torch.uint8) if is_fp8 else kv_cache
        capacity = work_items(num_rows, num_requests, num_heads, latent, block_m, block_h, block_dv)
        grid = persistent_grid(capacity, persistent_programs(q_lat, interpreted, PROGRAMS_PER_SM))
        _absorbed_fwd[grid](
            q_lat, q_pe, cache, block_table, query_start_loc, latent_loc, context_lens,
            k_scale if is_fp8 else lse,  # a never-read placeholder pointer otherwise
            o_lat, lse,
            num_requests, num_heads, num_rows, triton.cdiv(num_heads, block_h), triton.cdiv(latent, block_dv),
            sliding_window, softmax_scale * LOG2E.value,
            *q_lat.stride(), *q_pe.stride(), *cache.stride(), *block_table.stride(),
            query_start_loc.stride(0), latent_loc.stride(0), context_lens.stride(0), *o_lat.stride(), *lse.stride(),
            HEAD_L=latent, HEAD_R=rope,
            BLOCK_L=max(16, triton.next_power_of_2(latent)), BLOCK_R=max(16, triton.next_power_of_2(rope)),
            BLOCK_DV=block_dv, BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_N=block_n,
            PAGE_SIZE=kv_cache.shape[1], WINDOW=sliding_window > 0, IS_FP8=is_fp8,
            IS_DS_MLA=kv_cache.dtype == torch.uint8,
            DOT_DTYPE=dtype, DOT_PRECISION=dot_precision(dtype), INTERPRETED=interpreted,
            num_warps=num_warps, num_stages=num_stages,
        )


def absorbed_context_attention(
    q, kv_cache, block_table, query_start_loc, context_lens, kv_b_proj_weight, softmax_scale, k_scale, out, lse,
    absorbed_rows=-1, absorbed_token_loc=None, sliding_window=0,
) -> None:
    """Same contract as ``torch.ops.mla_ops.absorbed_context_attention`` (module docstring)."""
    num_tokens = q.shape[0]
    num_requests = context_lens.shape[0]
    num_heads, latent, nope, rope, _ = MLADims.from_shapes(q, kv_cache, kv_b_proj_weight)
    with device_guard(q) as interpreted:
        dot_dtype(q.dtype, interpreted, "absorbed")  # a TypeError before any work
        if num_tokens == 0 or num_heads == 0 or num_requests == 0 or kv_cache.numel() == 0:
            return  # nothing to attend: every row stays untouched
        rows = num_tokens if absorbed_rows < 0 else min(absorbed_rows, num_tokens)
        q_lat, o_lat = q.new_empty(2, rows, num_heads, latent).unbind(0)  # the routed tokens' rows, packed
        w_uk, w_uv = split_kv_b_proj(kv_b_proj_weight, num_heads, nope)  # [N, P, L], [N, V, L]
        loc = absorbed_token_loc  # [B+1] packed offsets, on the device: the plan's, or made here
        if loc is None:
            loc = _mla.absorbed_token_loc(query_start_loc, context_lens)
        rows_gemm(q, w_uk.transpose(1, 2), q_lat, loc, query_start_loc, map_a=True)  # fold: q_nope @ W_UK
        latent_attention(q_lat, q[..., nope:], kv_cache, block_table, query_start_loc, context_lens,
                         softmax_scale, k_scale, o_lat, lse, latent_loc=loc, sliding_window=sliding_window)
        rows_gemm(o_lat, w_uv, out, loc, query_start_loc, map_c=True)  # unfold: o_lat @ W_UV^T


def latent_context_attention(q, kv_cache, block_table, query_start_loc, context_lens, softmax_scale, k_scale,
                             out, lse) -> None:
    """The ``latent_context_attention`` op's contract (q ``[T, H, L+R]``) on ``latent_attention``."""
    latent = out.shape[2]
    latent_attention(q[..., :latent], q[..., latent:], kv_cache, block_table, query_start_loc, context_lens,
                     softmax_scale, k_scale, out, lse)
