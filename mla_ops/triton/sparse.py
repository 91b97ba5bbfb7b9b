"""Triton kernel: sparse attention (DSA) over each query's selected latent rows, read where they are.

q                [T, N, P+R]   rotated queries          kv_c [T, L], k_pe [T, R]: the step's new rows
kv_cache         [num_blocks, PAGE_SIZE, L+R]   16/32-bit, or float8_e4m3fn with k_scale [1] float32, or
                               fp8_ds_mla's [.., .., 656] uint8 rows (dequantized as read)
block_table      [B, max_blocks] int32   query_start_loc [B+1] int32   context_lens [B] int32
sparse           [B] bool      topk_indices [T, K] int32 (positions in the request's sequence; -1 pads; -2:
                               no finite selection, the token's out and lse are NaN)
kv_b_proj_weight [N*(P+V), L]  W_UK [N, P, L], W_UV [N, V, L] (``mla_ops._mla.split_kv_b_proj``)
-> out           [T, N, V]   lse [N, T] float32, natural log; other tokens' rows are left untouched (out=)
sliding_window   int w (0: none): a selected key counts only at positions ``c_r + j - w + 1 ..``

Oracle: ``sparse_reference`` in ``mla_ops/ops/sparse.py`` (the contract is its module doc). The sparse
requests' tokens are packed in request order at the device-computed offsets ``loc =
absorbed_token_loc(query_start_loc, sparse)`` ([B+1]) and every launch is persistent over the live
count ``loc[-1]`` read on the device (no host read; a step without sparse tokens costs three launches
that each read one integer), as the absorbed path (``mla_ops/triton/absorbed.py``) does:

1. fold (``rows_gemm``, per head): ``q_lat[i] = q_nope[token(i)] @ W_UK`` for packed rows i;
2. the kernel below, one (packed token, head group, value slice) item at a time: the token's K
   selected positions in tiles of BLOCK_N, each row loaded by position from the paged cache (fp8
   decoded from its bits) or from the step's new rows, one online softmax (base-2, fp32) over the
   selected keys, giving ``o_lat`` (packed rows) and the LSE (token rows);
3. unfold (``rows_gemm``, per head): ``out[token(i)] = o_lat[i] @ W_UV^T``.

An item's rows are BLOCK_H heads of one token (its key set is its own), so a key tile ``[BLOCK_N,
L+R]`` serves BLOCK_H query rows; the value width L is cut into BLOCK_DV slices, each recomputing the
scores (slice 0 writes the LSE). Tiles without a valid key are skipped. In an fp8 cache the raw e4m3
values are exact in fp16/bf16 and enter ``tl.dot`` undequantized; ``k_scale`` scales the score
columns and the probabilities of cache rows (a tile mixes cache rows and new rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _mla
from .._mla import MLADims, split_kv_b_proj
from ._common import (
    LN2, LOG2E, device_guard, dot_dtype, dot_precision, ds_mla_latent, ds_mla_rope, e4m3fn_to_float32, find_request,
    neg_inf_to_nan, persistent_grid, persistent_programs,
)
from .rows_gemm import rows_gemm


@triton.jit
def _select_rows(
    cache_ptr, new_ptr, table_row_ptr, rows_new, in_cache, in_new, keys, cols, col_ok,
    stride_table_col, stride_cache_block, stride_cache_token, stride_cache_col, stride_new_col,
    PAGE_SIZE: tl.constexpr, IS_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, KEYS_FIRST: tl.constexpr,
    DS_MLA_PART: tl.constexpr,  # 0: a plain cache; fp8_ds_mla rows: 1 the latent columns, 2 the rope ones
):
    """Columns ``cols`` of the selected rows: ``[BLOCK_N, C]`` (or ``[C, BLOCK_N]`` with KEYS_FIRST
    False), each from the cache (``in_cache``), the new rows (``in_new``) or 0, in DOT_DTYPE."""
    block = tl.load(table_row_ptr + (keys // PAGE_SIZE).to(tl.int64) * stride_table_col, mask=in_cache, other=0)
    row = block.to(tl.int64) * stride_cache_block + (keys % PAGE_SIZE).to(tl.int64) * stride_cache_token
    col = cols.to(tl.int64)
    if KEYS_FIRST:
        row_at, col_at = row[:, None], col[None, :]
        cache_mask = in_cache[:, None] & col_ok[None, :]
        new = tl.load(new_ptr + rows_new[:, None] + col[None, :] * stride_new_col,
                      mask=in_new[:, None] & col_ok[None, :], other=0)
    else:
        row_at, col_at = row[None, :], col[:, None]
        cache_mask = in_cache[None, :] & col_ok[:, None]
        new = tl.load(new_ptr + rows_new[None, :] + col[:, None] * stride_new_col,
                      mask=in_new[None, :] & col_ok[:, None], other=0)
    if DS_MLA_PART == 1:  # dequantized here (float32)
        cached = ds_mla_latent(cache_ptr + row_at, col_at, cache_mask)
    elif DS_MLA_PART == 2:
        cached = ds_mla_rope(cache_ptr + row_at, col_at, cache_mask)
    else:
        cached = tl.load(cache_ptr + row_at + col_at * stride_cache_col, mask=cache_mask, other=0)
    if IS_FP8:
        cached = e4m3fn_to_float32(cached.to(tl.int32))
    if KEYS_FIRST:
        rows = tl.where(in_cache[:, None], cached.to(DOT_DTYPE), new.to(DOT_DTYPE))
    else:
        rows = tl.where(in_cache[None, :], cached.to(DOT_DTYPE), new.to(DOT_DTYPE))
    return rows


@triton.jit
def _sparse_item(
    row, head_group, dv_slice,
    q_lat_ptr, q_pe_ptr, kv_c_ptr, k_pe_ptr, cache_ptr, block_table_ptr, query_start_loc_ptr, loc_ptr,
    context_lens_ptr, topk_ptr, k_scale_ptr, o_lat_ptr, lse_ptr,
    num_requests, num_heads, window, qk_scale,
    stride_qlt, stride_qlh, stride_qld,
    stride_qpt, stride_qph, stride_qpd,
    stride_kvc_t, stride_kvc_d, stride_kpe_t, stride_kpe_d,
    stride_cache_block, stride_cache_token, stride_cache_col,
    stride_table_row, stride_table_col,
    stride_qsl, stride_loc, stride_ctx, stride_topk_t, stride_topk_k,
    stride_olt, stride_olh, stride_old,
    stride_lh, stride_lt,
    HEAD_L: tl.constexpr, HEAD_R: tl.constexpr, NUM_TOPK: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, IS_FP8: tl.constexpr, IS_DS_MLA: tl.constexpr, WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One (packed token row, head group, value slice) item over the token's selected keys."""
    request = find_request(loc_ptr, stride_loc, num_requests, row, 1, 0)
    j = row - tl.load(loc_ptr + request * stride_loc)  # the token's index among its request's queries
    q_begin = tl.load(query_start_loc_ptr + request * stride_qsl)
    token = (q_begin + j).to(tl.int64)
    context = tl.load(context_lens_ptr + request * stride_ctx)
    head = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = head < num_heads
    head = head.to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    offs_dv = dv_slice * BLOCK_DV + tl.arange(0, BLOCK_DV)
    mask_l, mask_r, mask_dv = offs_l < HEAD_L, offs_r < HEAD_R, offs_dv < HEAD_L
    q_lat = tl.load(
        q_lat_ptr + row.to(tl.int64) * stride_qlt + head[:, None] * stride_qlh + offs_l[None, :] * stride_qld,
        mask=head_ok[:, None] & mask_l[None, :], other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_H, BLOCK_L]
    q_pe = tl.load(
        q_pe_ptr + token * stride_qpt + head[:, None] * stride_qph + offs_r[None, :] * stride_qpd,
        mask=head_ok[:, None] & mask_r[None, :], other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_H, BLOCK_R]
    k_scale = 1.0
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
    table_row_ptr = block_table_ptr + request.to(tl.int64) * stride_table_row
    if IS_DS_MLA:  # byte rows: the rope part is found by ds_mla_rope
        rope_ptr = cache_ptr
    else:
        rope_ptr = cache_ptr + HEAD_L * stride_cache_col
    new_base = q_begin.to(tl.int64) - context  # new row of position s: q_begin + s - c_r
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    no_finite = tl.zeros([BLOCK_N], dtype=tl.int32)  # a -2 seen: the indexer had no finite scores
    seen = tl.zeros([BLOCK_N], dtype=tl.int32)  # a valid key seen
    for start_n in range(0, NUM_TOPK, BLOCK_N):  # K is the model's, a constexpr trip count
        slot = start_n + offs_n
        keys = tl.load(topk_ptr + token * stride_topk_t + slot.to(tl.int64) * stride_topk_k,
                       mask=slot < NUM_TOPK, other=-1)
        no_finite = tl.maximum(no_finite, (keys == -2).to(tl.int32))
        key_ok = (keys >= 0) & (keys <= context + j)  # never a position past the query's own
        if WINDOW:  # nor one before its window
            key_ok = key_ok & (keys > context + j - window)
        if tl.max(key_ok.to(tl.int32), 0) > 0:
            seen = tl.maximum(seen, key_ok.to(tl.int32))
            in_cache = key_ok & (keys < context)
            in_new = key_ok & (keys >= context)
            new_rows = new_base + keys  # [BLOCK_N]
            k_lat = _select_rows(cache_ptr, kv_c_ptr, table_row_ptr, new_rows * stride_kvc_t, in_cache, in_new, keys,
                                 offs_l, mask_l, stride_table_col, stride_cache_block, stride_cache_token,
                                 stride_cache_col, stride_kvc_d, PAGE_SIZE, IS_FP8, DOT_DTYPE, False, IS_DS_MLA * 1)
            k_rope = _select_rows(rope_ptr, k_pe_ptr, table_row_ptr,
                                  new_rows * stride_kpe_t, in_cache, in_new, keys, offs_r, mask_r, stride_table_col,
                                  stride_cache_block, stride_cache_token, stride_cache_col, stride_kpe_d, PAGE_SIZE,
                                  IS_FP8, DOT_DTYPE, False, IS_DS_MLA * 2)
            v = _select_rows(cache_ptr, kv_c_ptr, table_row_ptr, new_rows * stride_kvc_t, in_cache, in_new, keys,
                             offs_dv, mask_dv, stride_table_col, stride_cache_block, stride_cache_token,
                             stride_cache_col, stride_kvc_d, PAGE_SIZE, IS_FP8, DOT_DTYPE, True, IS_DS_MLA * 1)
            qk = tl.dot(q_lat, k_lat, input_precision=DOT_PRECISION)
            qk = tl.dot(q_pe, k_rope, qk, input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
            column_scale = tl.where(in_cache, k_scale, 1.0)  # fp8 cache rows enter undequantized
            qk = neg_inf_to_nan(qk * (qk_scale * column_scale)[None, :])  # base-2 logits, scaled before the max
            qk = tl.where(key_ok[None, :], qk, float("-inf"))
            # The first tiles may leave a row without a key: a -inf max must not give exp2(nan).
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(qk - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_ij
            acc = tl.dot((p * column_scale[None, :]).to(DOT_DTYPE), v, acc * alpha[:, None],
                         input_precision=DOT_PRECISION)

    saw_key = tl.max(seen, 0) > 0
    lse2 = m_i + tl.math.log2(tl.where(l_i == 0, 1.0, l_i))  # [BLOCK_H]: -inf without keys (m_i); not finite
    # where a score was not (l_i NaN, or m_i +inf)
    # NaN, out and lse: a head with a non-finite score (its LSE is not finite although the token saw a key), or
    # a token whose row holds -2 (no finite selection). No key: the empty partial, 0 / -inf.
    bad = (saw_key & ~(tl.abs(lse2) < float("inf"))) | (tl.max(no_finite, 0) > 0)
    acc = tl.where(bad[:, None], float("nan"), acc / tl.where(l_i > 0, l_i, 1.0)[:, None])
    o_ptrs = o_lat_ptr + row.to(tl.int64) * stride_olt + head[:, None] * stride_olh + offs_dv[None, :] * stride_old
    tl.store(o_ptrs, acc.to(o_lat_ptr.dtype.element_ty), mask=head_ok[:, None] & mask_dv[None, :])
    if dv_slice == 0:
        lse = tl.where(bad, float("nan"), tl.where(saw_key, lse2 * LN2, float("-inf")))
        tl.store(lse_ptr + head * stride_lh + token * stride_lt, lse.to(lse_ptr.dtype.element_ty), mask=head_ok)


@triton.jit(do_not_specialize=["num_requests", "num_rows_capacity", "window"])  # sizes change every step
def _sparse_fwd(
    q_lat_ptr,  # [M, N, L] packed rows (loc order)
    q_pe_ptr,  # [T, N, R] (column view of q)
    kv_c_ptr, k_pe_ptr,  # [T, L], [T, R]: the step's new rows
    cache_ptr,  # [num_blocks, PAGE_SIZE, L+R] (uint8 bits for fp8 caches)
    block_table_ptr, query_start_loc_ptr, loc_ptr, context_lens_ptr,  # int32
    topk_ptr,  # [T, K] int32
    k_scale_ptr,  # [1] float32 (read only when IS_FP8)
    o_lat_ptr,  # [M, N, L]
    lse_ptr,  # [N, T] float32, natural log
    num_requests, num_heads, num_rows_capacity, num_head_groups, num_dv_slices,
    window,  # w (WINDOW only)
    qk_scale,  # softmax_scale * LOG2E
    stride_qlt, stride_qlh, stride_qld,
    stride_qpt, stride_qph, stride_qpd,
    stride_kvc_t, stride_kvc_d, stride_kpe_t, stride_kpe_d,
    stride_cache_block, stride_cache_token, stride_cache_col,
    stride_table_row, stride_table_col,
    stride_qsl, stride_loc, stride_ctx, stride_topk_t, stride_topk_k,
    stride_olt, stride_olh, stride_old,
    stride_lh, stride_lt,
    HEAD_L: tl.constexpr, HEAD_R: tl.constexpr, NUM_TOPK: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, IS_FP8: tl.constexpr, IS_DS_MLA: tl.constexpr, WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Persistent: stride over the (packed token, head group, value slice) items of the sparse tokens;
    # without any (no request routed here) the launch reads one offset.
    num_rows = tl.minimum(tl.load(loc_ptr + num_requests * stride_loc), num_rows_capacity)
    items_per_row = num_head_groups * num_dv_slices
    item = tl.program_id(0)
    while item < num_rows * items_per_row:
        _sparse_item(
            item // items_per_row, (item % items_per_row) // num_dv_slices, item % num_dv_slices,
            q_lat_ptr, q_pe_ptr, kv_c_ptr, k_pe_ptr, cache_ptr, block_table_ptr, query_start_loc_ptr, loc_ptr,
            context_lens_ptr, topk_ptr, k_scale_ptr, o_lat_ptr, lse_ptr,
            num_requests, num_heads, window, qk_scale,
            stride_qlt, stride_qlh, stride_qld, stride_qpt, stride_qph, stride_qpd,
            stride_kvc_t, stride_kvc_d, stride_kpe_t, stride_kpe_d,
            stride_cache_block, stride_cache_token, stride_cache_col, stride_table_row, stride_table_col,
            stride_qsl, stride_loc, stride_ctx, stride_topk_t, stride_topk_k,
            stride_olt, stride_olh, stride_old, stride_lh, stride_lt,
            HEAD_L, HEAD_R, NUM_TOPK, BLOCK_L, BLOCK_R, BLOCK_DV, BLOCK_H, BLOCK_N,
            PAGE_SIZE, IS_FP8, IS_DS_MLA, WINDOW, DOT_DTYPE, DOT_PRECISION,
        )
        item += tl.num_programs(0)


# (max heads per item, BLOCK_N, BLOCK_DV, num_warps, num_stages); not measured yet. At DeepSeek dims a
# 16-bit item holds acc [64, 256] fp32 and q [64, 576], as the absorbed kernel's tiles (whose numbers
# these are); key tiles are gathered row by row, so no more pipelining stages than it has.
CUDA_CONFIG_16BIT = (64, 32, 256, 8, 2)
CUDA_CONFIG_FP32 = (16, 16, 128, 4, 1)
# The interpreter: small tiles, so tiny test shapes still cover several key tiles and value slices.
INTERPRETER_CONFIG = (16, 16, 16, 1, 1)
MIN_DOT_ROWS = 16  # tl.dot needs every block dim >= 16: few heads are padded to it
PROGRAMS_PER_SM = 1


def tile_shape(dtype: torch.dtype, interpreted: bool, num_heads: int, latent: int):
    """``(BLOCK_H, BLOCK_N, BLOCK_DV, num_warps, num_stages)`` for queries of ``dtype``."""
    rows, block_n, block_dv, num_warps, num_stages = (
        INTERPRETER_CONFIG if interpreted else CUDA_CONFIG_FP32 if dtype == torch.float32 else CUDA_CONFIG_16BIT
    )
    block_h = max(MIN_DOT_ROWS, min(triton.next_power_of_2(num_heads), rows))
    block_dv = min(block_dv, max(16, triton.next_power_of_2(latent)))
    return block_h, block_n, block_dv, num_warps, num_stages


def sparse_attention(q, kv_c, k_pe, kv_cache, block_table, query_start_loc, context_lens, sparse, topk_indices,
                     kv_b_proj_weight, softmax_scale, k_scale, out, lse, sliding_window=0) -> None:
    """Same contract as ``torch.ops.mla_ops.sparse_attention`` (``mla_ops/ops/sparse.py``)."""
    num_tokens, num_topk = topk_indices.shape
    num_requests = context_lens.shape[0]
    num_heads, latent, nope, rope, _ = MLADims.from_shapes(q, kv_cache, kv_b_proj_weight)
    with device_guard(q) as interpreted:
        dtype = dot_dtype(q.dtype, interpreted, "sparse attention")  # a TypeError before any work
        if num_tokens == 0 or num_heads == 0 or num_requests == 0 or num_topk == 0:
            return  # nothing to attend: every row stays untouched
        q_lat, o_lat = q.new_empty(2, num_tokens, num_heads, latent).unbind(0)  # the sparse tokens' rows, packed
        w_uk, w_uv = split_kv_b_proj(kv_b_proj_weight, num_heads, nope)  # [N, P, L], [N, V, L]
        loc = _mla.absorbed_token_loc(query_start_loc, sparse.to(torch.int32))  # [B+1] packed offsets
        rows_gemm(q, w_uk.transpose(1, 2), q_lat, loc, query_start_loc, map_a=True)  # fold: q_nope @ W_UK

        block_h, block_n, block_dv, num_warps, num_stages = tile_shape(q.dtype, interpreted, num_heads, latent)
        is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
        cache = kv_cache.view(torch.uint8) if is_fp8 else kv_cache
        head_groups, dv_slices = triton.cdiv(num_heads, block_h), triton.cdiv(latent, block_dv)
        grid = persistent_grid(num_tokens * head_groups * dv_slices, persistent_programs(q, interpreted,
                                                                                        PROGRAMS_PER_SM))
        q_pe = q[..., nope:]
        _sparse_fwd[grid](
            q_lat, q_pe, kv_c, k_pe, cache, block_table, query_start_loc, loc, context_lens, topk_indices,
            k_scale if is_fp8 else lse,  # a never-read placeholder pointer otherwise
            o_lat, lse,
            num_requests, num_heads, num_tokens, head_groups, dv_slices,
            sliding_window, softmax_scale * LOG2E.value,
            *q_lat.stride(), *q_pe.stride(), *kv_c.stride(), *k_pe.stride(), *cache.stride(), *block_table.stride(),
            query_start_loc.stride(0), loc.stride(0), context_lens.stride(0), *topk_indices.stride(),
            *o_lat.stride(), *lse.stride(),
            HEAD_L=latent, HEAD_R=rope, NUM_TOPK=num_topk,
            BLOCK_L=max(16, triton.next_power_of_2(latent)), BLOCK_R=max(16, triton.next_power_of_2(rope)),
            BLOCK_DV=block_dv, BLOCK_H=block_h, BLOCK_N=block_n,
            PAGE_SIZE=kv_cache.shape[1], IS_FP8=is_fp8, IS_DS_MLA=kv_cache.dtype == torch.uint8,
            WINDOW=sliding_window > 0, DOT_DTYPE=dtype, DOT_PRECISION=dot_precision(dtype),
            num_warps=num_warps, num_stages=num_stages,
        )
        rows_gemm(o_lat, w_uv, out, loc, query_start_loc, map_c=True)  # unfold: o_lat @ W_UV^T
