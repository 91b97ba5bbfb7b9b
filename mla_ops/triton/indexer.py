"""Triton kernels of the lightning indexer (DSA, DESIGN §12): one piece's scores folded into the running
top-k (``fold_piece_topk``, the op's CUDA path), and the same scores written out (``chunk_scores``).

q_index        [T, H_I, D_I]  fp16/bf16/fp32 (bf16 upcast to fp32 under the interpreter)
index_weights  [T, H_I]       float32 or the queries' dtype
k_index        [T, D_I]       the step's new index keys, dtype of q_index
index_cache    [num_blocks, block_size, D_I]  dtype of q_index, or float8_e4m3fn with k_scale, or
                              fp8_per_token's [.., .., D_I + D_I/128*4] uint8 (block-major codes then scales)
block_table    [>= B, max_blocks] int32;  query_start_loc [B+1], context_lens [B] int32
starts [B], cu_seq_lens [B+1]   the chunk's rows: request r's positions ``starts[r] ..`` at rows ``cu_seq_lens[r] ..``
slot_token     [M] int64       each slot's token (``ops.indexer.slot_tokens``; T or more: a dead slot)
k_scale        [1] float32 or None   fp8 caches: dequantized = stored * k_scale
best           [T, K_PAD] int64 (in place)  each token's running top K_PAD keys, sorted descending
not_finite     [T] int32 (in place)  set to 1 for a token with a non-finite candidate score
scores         [M, W] float32 (out=, ``chunk_scores``)  slot m, row w: ``I(slot_token[m], row w)``, -inf off
                              the candidates

The oracle is ``ops/indexer.py``: ``chunk_scores_reference`` and its ``torch.topk`` fold. A tile's scores
(``_tile_scores``, shared by both kernels): each row's request by a binary search over ``cu_seq_lens`` and
its key where it lives (the paged cache for context positions, ``k_index`` for the step's new ones), each
slot's request over ``query_start_loc``, the H_I heads' dots (``relu``, weighted) in an fp32 accumulator; a
non-finite score becomes NaN (its token is flagged), then the request/causal mask writes -inf. Every bound is
read on the device (token count, row count).

The fused kernel: a program owns BLOCK_M slots (a token is in one slot of a piece, so no two programs share
a row of ``best``) and walks the piece's rows in BLOCK_N tiles. Each score becomes one int64 key that sorts
as (score, then lower position first): the float32 bits made order-preserving in the high half,
``LAST_POSITION - position`` in the low half; -inf and NaN give EMPTY_KEY, below every candidate. A tile
whose keys all fall below every slot's K_PAD-th best is skipped; otherwise the tile, sorted ascending and
padded in front with EMPTY_KEY to K_PAD, meets the running keys (descending) in an elementwise max, which
holds the top K_PAD of the union (a bitonic merge), and one ``tl.sort`` restores the order. K_PAD is a
power of two >= K, so the first K keys are the top-k. A tile of dead slots (live slots come first: all of a
device-form slot past the step's pieces) exits after one load.

fp8 rows are decoded from their bits (``e4m3fn_to_float32``); the raw e4m3 values are exact in
fp16/bf16, so they enter ``tl.dot`` undequantized and ``k_scale`` (or an fp8_per_token row's own
scale at D_I = 128, read from its block's scale bytes) multiplies the context rows' fp32 dots (a positive
scale commutes with relu). At D_I = 256, 384, ... an fp8_per_token key has a scale per 128 values, so its
codes are dequantized before the dot (code * a power of two: exact in fp32 and bf16; fp16 may flush values
below 2**-24).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _mla
from ._common import device_guard, dot_dtype, dot_precision, e4m3fn_to_float32, find_request, load_float32_bytes

INDEX_TILE = tl.constexpr(_mla.INDEX_TILE)  # fp8_per_token: values per float32 scale


@triton.jit
def _slot_tokens(slot_token_ptr, qsl_ptr, ctx_ptr, offs_m, num_slots, num_tokens, num_requests, stride_slot,
                 stride_qsl, stride_ctx):
    """A tile's slots: (token, live, request, position) [BLOCK_M] each; a dead slot reads token 0."""
    token = tl.load(slot_token_ptr + offs_m * stride_slot, mask=offs_m < num_slots, other=num_tokens)
    slot_live = token < num_tokens
    token = tl.where(slot_live, token, 0)
    slot_request = find_request(qsl_ptr, stride_qsl, num_requests, token, 1, 0)
    slot_position = tl.load(ctx_ptr + slot_request * stride_ctx) + token - tl.load(qsl_ptr + slot_request * stride_qsl)
    return token, slot_live, slot_request, slot_position


@triton.jit
def _tile_scores(
    q_ptr, w_ptr, k_index_ptr, cache_ptr, block_table_ptr, qsl_ptr, ctx_ptr, starts_ptr, cu_ptr, k_scale_ptr,
    token, slot_live, slot_request, slot_position, offs_n, num_rows, num_requests, block_size, head_dim, scales_at,
    stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_kt, stride_kd,
    stride_cache_block, stride_cache_token, stride_cache_col, stride_table_row, stride_table_col,
    stride_qsl, stride_ctx, stride_starts, stride_cu,
    NUM_HEADS: tl.constexpr, IS_FP8: tl.constexpr, SCALES_PER_TOKEN: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] float32: the slots' scores against the chunk's rows ``offs_n``, -inf off the
    candidates, NaN where a candidate's score is not finite (the module doc), and the rows' positions [BLOCK_N]."""
    # Rows: request, sequence position, and where the key lives.
    row_live = offs_n < num_rows
    row_request = find_request(cu_ptr, stride_cu, num_requests, offs_n, 1, 0)
    position = tl.load(starts_ptr + row_request * stride_starts) + offs_n - tl.load(cu_ptr + row_request * stride_cu)
    context = tl.load(ctx_ptr + row_request * stride_ctx)
    in_context = row_live & (position < context)
    is_new = row_live & (position >= context)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    table = row_request.to(tl.int64) * stride_table_row + (position // block_size).to(tl.int64) * stride_table_col
    block = tl.load(block_table_ptr + table, mask=in_context, other=0)
    cache_row = block.to(tl.int64) * stride_cache_block + (position % block_size).to(tl.int64) * stride_cache_token
    new_token = tl.load(qsl_ptr + row_request * stride_qsl) + position - context
    # Keys as [BLOCK_D, BLOCK_N]: the dot's right operand.
    cached = tl.load(cache_ptr + cache_row[None, :] + offs_d.to(tl.int64)[:, None] * stride_cache_col,
                     mask=d_mask[:, None] & in_context[None, :], other=0)
    if IS_FP8 or SCALES_PER_TOKEN:
        cached = e4m3fn_to_float32(cached.to(tl.int32))
    # fp8_per_token: a block's scales follow its codes, SCALES_PER_TOKEN (D_I / 128) a token: token i's tile j
    # at byte scales_at + 4 (i * SCALES_PER_TOKEN + j).
    offset = (position % block_size).to(tl.int64)
    scale_at = block.to(tl.int64) * stride_cache_block + scales_at + 4 * SCALES_PER_TOKEN * offset
    if SCALES_PER_TOKEN > 1:  # a scale per 128 values: the keys dequantized before the dot (exact in fp32, bf16)
        tile = (offs_d // INDEX_TILE).to(tl.int64)
        tile_scale = load_float32_bytes(cache_ptr + scale_at[None, :] + 4 * tile[:, None],
                                        d_mask[:, None] & in_context[None, :])
        cached = cached * tile_scale
    new = tl.load(k_index_ptr + new_token.to(tl.int64)[None, :] * stride_kt + offs_d.to(tl.int64)[:, None] * stride_kd,
                  mask=d_mask[:, None] & is_new[None, :], other=0)
    keys = tl.where(in_context[None, :], cached.to(DOT_DTYPE), new.to(DOT_DTYPE))
    if IS_FP8:
        row_scale = tl.where(in_context, tl.load(k_scale_ptr).to(tl.float32), 1.0)
    if SCALES_PER_TOKEN == 1:  # one scale a key: the raw codes (exact in 16 bits) enter the dot, scaled after it
        row_scale = tl.where(in_context, load_float32_bytes(cache_ptr + scale_at, in_context), 1.0)
    q_rows = q_ptr + token.to(tl.int64)[:, None] * stride_qt + offs_d.to(tl.int64)[None, :] * stride_qd
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for h in range(NUM_HEADS):
        q = tl.load(q_rows + h * stride_qh, mask=slot_live[:, None] & d_mask[None, :], other=0)
        weight = tl.load(w_ptr + token.to(tl.int64) * stride_wt + h * stride_wh, mask=slot_live, other=0)
        dot = tl.dot(q.to(DOT_DTYPE), keys, input_precision=DOT_PRECISION)
        if IS_FP8 or SCALES_PER_TOKEN == 1:
            dot = dot * row_scale[None, :]
        # relu that keeps NaN (tl.maximum's default drops it, as fmaxf does): a NaN query or key shows.
        acc += weight.to(tl.float32)[:, None] * tl.maximum(dot, 0.0, propagate_nan=tl.PropagateNan.ALL)
    acc = tl.where((acc == acc) & (tl.abs(acc) < float("inf")), acc, float("nan"))  # not finite: NaN
    candidate = (slot_live[:, None] & row_live[None, :] & (slot_request[:, None] == row_request[None, :])
                 & (position[None, :] <= slot_position[:, None]))
    return tl.where(candidate, acc, float("-inf")), position


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, k_index_ptr, cache_ptr, block_table_ptr, qsl_ptr, ctx_ptr, starts_ptr, cu_ptr,
    slot_token_ptr, k_scale_ptr, scores_ptr,
    num_tokens, num_requests, block_size, head_dim, num_slots, num_rows_cap, scales_at,
    stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_kt, stride_kd,
    stride_cache_block, stride_cache_token, stride_cache_col, stride_table_row, stride_table_col,
    stride_qsl, stride_ctx, stride_starts, stride_cu, stride_slot, stride_sm, stride_sw,
    NUM_HEADS: tl.constexpr, IS_FP8: tl.constexpr, SCALES_PER_TOKEN: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row_tiles = tl.cdiv(num_rows_cap, BLOCK_N)
    pid = tl.program_id(0)
    tile_m, tile_n = pid // row_tiles, pid % row_tiles
    num_rows = tl.load(cu_ptr + num_requests * stride_cu)  # the chunk's live rows (a device count)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    scores = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    # Live slots come first: a tile whose first slot is dead is all dead.
    first_token = tl.load(slot_token_ptr + tile_m * BLOCK_M * stride_slot)
    if (first_token < num_tokens) & (tile_n * BLOCK_N < num_rows):
        token, slot_live, slot_request, slot_position = _slot_tokens(
            slot_token_ptr, qsl_ptr, ctx_ptr, offs_m, num_slots, num_tokens, num_requests, stride_slot, stride_qsl,
            stride_ctx)
        scores, _ = _tile_scores(
            q_ptr, w_ptr, k_index_ptr, cache_ptr, block_table_ptr, qsl_ptr, ctx_ptr, starts_ptr, cu_ptr, k_scale_ptr,
            token, slot_live, slot_request, slot_position, offs_n, num_rows, num_requests, block_size, head_dim,
            scales_at, stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_kt, stride_kd,
            stride_cache_block, stride_cache_token, stride_cache_col, stride_table_row, stride_table_col,
            stride_qsl, stride_ctx, stride_starts, stride_cu,
            NUM_HEADS, IS_FP8, SCALES_PER_TOKEN, DOT_DTYPE, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_D)
    out = scores_ptr + offs_m.to(tl.int64)[:, None] * stride_sm + offs_n.to(tl.int64)[None, :] * stride_sw
    tl.store(out, scores, mask=(offs_m < num_slots)[:, None] & (offs_n < num_rows_cap)[None, :])


BLOCK_M = 16  # query slots per tile (tl.dot's least)
BLOCK_N = 64  # rows per tile
NUM_WARPS = 4


def chunk_scores(q_index, index_weights, k_index, index_cache, block_table, query_start_loc, context_lens,
                 starts, cu_seq_lens, slot_token, k_scale, scores) -> None:
    """Same contract as ``chunk_scores_reference`` (module doc); float32 ``scores`` only. The op does not use it
    (``fold_piece_topk`` holds no scores): it shows the shared tile scorer equal to the torch one, value by
    value, NaN and -inf in place, in the interpreter tests."""
    num_slots, rows = scores.shape
    num_tokens, num_heads, head_dim = q_index.shape
    num_requests = context_lens.shape[0]
    with device_guard(scores) as interpreted:
        dtype = dot_dtype(q_index.dtype, interpreted, "indexer")
        if scores.dtype != torch.float32:
            raise TypeError(f"the Triton indexer kernel writes float32 scores, got {scores.dtype}")
        if num_slots == 0 or rows == 0:
            return
        if num_tokens == 0 or num_requests == 0:
            scores.fill_(float("-inf"))
            return
        is_fp8 = index_cache.dtype == torch.float8_e4m3fn
        per_token = index_cache.dtype == torch.uint8  # fp8_per_token: block-major codes, then scales
        cache = index_cache.view(torch.uint8) if is_fp8 else index_cache
        cache_strides = (cache.stride(0), head_dim, 1) if per_token else cache.stride()
        grid = (triton.cdiv(num_slots, BLOCK_M) * triton.cdiv(rows, BLOCK_N),)
        _index_scores_kernel[grid](
            q_index, index_weights, k_index, cache, block_table, query_start_loc, context_lens, starts, cu_seq_lens,
            slot_token,
            k_scale if is_fp8 else scores,  # a never-read placeholder pointer otherwise
            scores,
            num_tokens, num_requests, index_cache.shape[1], head_dim, num_slots, rows, index_cache.shape[1] * head_dim,
            *q_index.stride(), *index_weights.stride(), *k_index.stride(), *cache_strides, *block_table.stride(),
            query_start_loc.stride(0), context_lens.stride(0), starts.stride(0), cu_seq_lens.stride(0),
            slot_token.stride(0),
            *scores.stride(),
            NUM_HEADS=num_heads, IS_FP8=is_fp8, SCALES_PER_TOKEN=head_dim // _mla.INDEX_TILE if per_token else 0,
            DOT_DTYPE=dtype,
            DOT_PRECISION=dot_precision(dtype),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            num_warps=NUM_WARPS,
        )


# The fused score + running top-k: each candidate is one int64 key, so a sort orders (score, position).
# A key: the score's bits made order-preserving (a signed int32) above ``LAST_POSITION - position`` (lower
# positions first on equal scores). EMPTY_KEY (-inf's high bits, 0 below) is below every candidate's key.
LAST_POSITION = 0x7FFFFFFF
EMPTY_KEY = tl.constexpr(-9187343244130779136)


@triton.jit
def _score_keys(scores, position):
    """[BLOCK_M, BLOCK_N] int64 keys of a tile's scores, ``position`` [BLOCK_N] its rows': a negative score's
    bits but the sign flipped order as a signed int32. -inf (no candidate) and NaN (its token is flagged)
    give ``EMPTY_KEY``."""
    scores = tl.where(scores == 0.0, 0.0, scores)  # -0.0 == 0.0 as a score
    bits = scores.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    keys = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - position).to(tl.int64)[None, :]
    return tl.where((scores == scores) & (scores > float("-inf")), keys, EMPTY_KEY)


@triton.jit
def _fold_tile(
    row0, threshold, not_finite, best_ptrs, group,
    q_ptr, w_ptr, k_index_ptr, cache_ptr, block_table_ptr, qsl_ptr, ctx_ptr, starts_ptr, cu_ptr, k_scale_ptr,
    token, slot_live, slot_request, slot_position, num_rows, num_requests, block_size, head_dim, scales_at,
    stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_kt, stride_kd,
    stride_cache_block, stride_cache_token, stride_cache_col, stride_table_row, stride_table_col,
    stride_qsl, stride_ctx, stride_starts, stride_cu,
    NUM_HEADS: tl.constexpr, IS_FP8: tl.constexpr, SCALES_PER_TOKEN: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, K_PAD: tl.constexpr,
):
    """The rows ``row0 .. row0 + BLOCK_N`` scored and folded into the slots' running keys (at ``best_ptrs``):
    ``(threshold, not_finite)`` [BLOCK_M] each, the K_PAD-th best key and the non-finite flag after it."""
    offs_n = row0 + tl.arange(0, BLOCK_N)
    scores, position = _tile_scores(
        q_ptr, w_ptr, k_index_ptr, cache_ptr, block_table_ptr, qsl_ptr, ctx_ptr, starts_ptr, cu_ptr,
        k_scale_ptr, token, slot_live, slot_request, slot_position, offs_n, num_rows, num_requests,
        block_size, head_dim, scales_at, stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_kt,
        stride_kd, stride_cache_block, stride_cache_token, stride_cache_col, stride_table_row,
        stride_table_col, stride_qsl, stride_ctx, stride_starts, stride_cu,
        NUM_HEADS, IS_FP8, SCALES_PER_TOKEN, DOT_DTYPE, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_D)
    not_finite = tl.maximum(not_finite, tl.max((scores != scores).to(tl.int32), axis=1))
    keys = _score_keys(scores, position)
    # Merge only where a key beats a slot's K_PAD-th (after the first tiles, most tiles do not).
    if tl.max(tl.max((keys > threshold[:, None]).to(tl.int32), axis=1), axis=0) > 0:
        best = tl.load(best_ptrs, mask=slot_live[:, None], other=EMPTY_KEY)
        # Bitonic merge: the running keys descending against the tile's ascending, padded at the front
        # with EMPTY to K_PAD: the elementwise max holds the top K_PAD of the union (its last group only
        # can change), then one sort puts them back in order.
        tile = tl.reshape(tl.sort(keys), [BLOCK_M, 1, BLOCK_N])
        best = tl.reshape(best, [BLOCK_M, K_PAD // BLOCK_N, BLOCK_N])
        best = tl.where(group == K_PAD // BLOCK_N - 1, tl.maximum(best, tile), best)
        best = tl.sort(tl.reshape(best, [BLOCK_M, K_PAD]), descending=True)
        tl.store(best_ptrs, best, mask=slot_live[:, None])
        threshold = tl.min(best, axis=1)
    return threshold, not_finite


@triton.jit
def _index_topk_kernel(
    q_ptr, w_ptr, k_index_ptr, cache_ptr, block_table_ptr, qsl_ptr, ctx_ptr, starts_ptr, cu_ptr,
    slot_token_ptr, k_scale_ptr, best_ptr, not_finite_ptr,
    num_tokens, num_requests, block_size, head_dim, num_slots, scales_at,
    stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_kt, stride_kd,
    stride_cache_block, stride_cache_token, stride_cache_col, stride_table_row, stride_table_col,
    stride_qsl, stride_ctx, stride_starts, stride_cu, stride_slot, stride_bt,
    NUM_HEADS: tl.constexpr, IS_FP8: tl.constexpr, SCALES_PER_TOKEN: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, K_PAD: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    # Live slots come first: a tile whose first slot is dead is all dead, and costs this load only.
    first_token = tl.load(slot_token_ptr + tl.program_id(0) * BLOCK_M * stride_slot)
    if first_token < num_tokens:
        num_rows = tl.load(cu_ptr + num_requests * stride_cu)  # the chunk's live rows (a device count)
        token, slot_live, slot_request, slot_position = _slot_tokens(
            slot_token_ptr, qsl_ptr, ctx_ptr, offs_m, num_slots, num_tokens, num_requests, stride_slot, stride_qsl,
            stride_ctx)
        # Each live slot's running top K_PAD keys, sorted descending: a token is in one slot of a piece.
        best_ptrs = best_ptr + token.to(tl.int64)[:, None] * stride_bt + tl.arange(0, K_PAD)[None, :]
        threshold = tl.load(best_ptr + token.to(tl.int64) * stride_bt + K_PAD - 1, mask=slot_live,
                            other=EMPTY_KEY)  # the K_PAD-th best so far
        not_finite = tl.zeros([BLOCK_M], tl.int32)
        group = tl.arange(0, K_PAD // BLOCK_N)[None, :, None]
        # The row count is read from a tensor: no range() over it under the interpreter (mla_ops/triton/_common.py).
        if INTERPRETED:
            row0 = 0
            while row0 < num_rows:
                threshold, not_finite = _fold_tile(
                    row0, threshold, not_finite, best_ptrs, group,
                    q_ptr, w_ptr, k_index_ptr, cache_ptr, block_table_ptr, qsl_ptr, ctx_ptr, starts_ptr, cu_ptr,
                    k_scale_ptr, token, slot_live, slot_request, slot_position, num_rows, num_requests, block_size,
                    head_dim, scales_at, stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_kt, stride_kd,
                    stride_cache_block, stride_cache_token, stride_cache_col, stride_table_row, stride_table_col,
                    stride_qsl, stride_ctx, stride_starts, stride_cu,
                    NUM_HEADS, IS_FP8, SCALES_PER_TOKEN, DOT_DTYPE, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_D, K_PAD)
                row0 += BLOCK_N
        else:
            for row0 in range(0, num_rows, BLOCK_N):
                threshold, not_finite = _fold_tile(
                    row0, threshold, not_finite, best_ptrs, group,
                    q_ptr, w_ptr, k_index_ptr, cache_ptr, block_table_ptr, qsl_ptr, ctx_ptr, starts_ptr, cu_ptr,
                    k_scale_ptr, token, slot_live, slot_request, slot_position, num_rows, num_requests, block_size,
                    head_dim, scales_at, stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_kt, stride_kd,
                    stride_cache_block, stride_cache_token, stride_cache_col, stride_table_row, stride_table_col,
                    stride_qsl, stride_ctx, stride_starts, stride_cu,
                    NUM_HEADS, IS_FP8, SCALES_PER_TOKEN, DOT_DTYPE, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_D, K_PAD)
        tl.store(not_finite_ptr + token, not_finite, mask=slot_live & (not_finite > 0))


def running_width(topk: int) -> int:
    """K_PAD: the running top-k's width, a power of two >= K (and >= 16, ``tl.dot``'s least rows)."""
    return max(16, triton.next_power_of_2(topk))


def running_keys(num_tokens: int, topk: int, device) -> torch.Tensor:
    """[T, K_PAD] int64 all ``EMPTY_KEY``: the identity of the fold (no candidate yet)."""
    return torch.full((num_tokens, running_width(topk)), EMPTY_KEY.value, dtype=torch.int64, device=device)


def key_positions(best: torch.Tensor, topk: int) -> torch.Tensor:
    """[T, K] int64: the positions of the K best keys of ``best`` (sorted descending), -1 for ``EMPTY_KEY``."""
    best = best.narrow(1, 0, topk)
    return torch.where(best > EMPTY_KEY.value, LAST_POSITION - (best & 0xFFFFFFFF), -1)


def fold_piece_topk(q_index, index_weights, k_index, index_cache, block_table, query_start_loc, context_lens,
                    starts, cu_seq_lens, slot_token, k_scale, best, not_finite) -> None:
    """Scores one index piece (``chunk_scores``'s inputs, no scores buffer) and folds them into each live slot
    token's running keys ``best`` [T, K_PAD] int64 (``running_keys``; sorted descending) in place; sets
    ``not_finite`` [T] int32 to 1 for a token with a non-finite candidate score. A tile of dead slots exits at
    once; the device form's dead pieces cost a launch."""
    num_slots = slot_token.shape[0]
    num_tokens, num_heads, head_dim = q_index.shape
    num_requests = context_lens.shape[0]
    k_pad = best.shape[1]
    with device_guard(best) as interpreted:
        dtype = dot_dtype(q_index.dtype, interpreted, "indexer")
        if num_slots == 0 or num_tokens == 0 or num_requests == 0:
            return
        is_fp8 = index_cache.dtype == torch.float8_e4m3fn
        per_token = index_cache.dtype == torch.uint8  # fp8_per_token: block-major codes, then scales
        cache = index_cache.view(torch.uint8) if is_fp8 else index_cache
        cache_strides = (cache.stride(0), head_dim, 1) if per_token else cache.stride()
        _index_topk_kernel[(triton.cdiv(num_slots, BLOCK_M),)](
            q_index, index_weights, k_index, cache, block_table, query_start_loc, context_lens, starts, cu_seq_lens,
            slot_token,
            k_scale if is_fp8 else best,  # a never-read placeholder pointer otherwise
            best, not_finite,
            num_tokens, num_requests, index_cache.shape[1], head_dim, num_slots, index_cache.shape[1] * head_dim,
            *q_index.stride(), *index_weights.stride(), *k_index.stride(), *cache_strides, *block_table.stride(),
            query_start_loc.stride(0), context_lens.stride(0), starts.stride(0), cu_seq_lens.stride(0),
            slot_token.stride(0), best.stride(0),
            NUM_HEADS=num_heads, IS_FP8=is_fp8, SCALES_PER_TOKEN=head_dim // _mla.INDEX_TILE if per_token else 0,
            DOT_DTYPE=dtype,
            DOT_PRECISION=dot_precision(dtype),
            BLOCK_M=BLOCK_M, BLOCK_N=min(BLOCK_N, k_pad), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            K_PAD=k_pad, INTERPRETED=interpreted, num_warps=NUM_WARPS if k_pad <= 256 else 8,
        )
