"""Triton kernel: varlen flash attention over MLA's split keys (context and suffix partials).

q               [Tq, N, P+R]  queries; q_nope = columns [0, P), q_pe = columns [P, P+R)
k_nope          [S, N, P]     per-head key part          k_pe [S, R] rope key part, shared by all heads
v               [S, N, V]     values
query_start_loc [n+1] int32   query rows of request i: query_start_loc[i] .. query_start_loc[i+1]
cu_seq_lens     [n+1] int32   key rows of request i (context); the suffix uses query_start_loc
starts          [n] int32     context: > 0 means request i continues an earlier chunk (merge)
-> out          [Tq, N, V]    any float dtype   lse [N, Tq] float32, natural log (out=)
context_lens    [n] int32     (a sliding window's context only) c_i      sliding_window  int w (0: none)

``scores = softmax_scale * (q_nope . k_nope + q_pe . k_pe)``; a query with a NaN or inf score among its keys
gets NaN (out and lse), as in the oracles; oracles: ``context_attention_reference``
(``mla_ops/ops/attention.py``) and ``suffix_attention_reference`` (the same module).
Every tensor may be a strided view (q narrowed along tokens, k_nope / v two views of one
``[S, N, P+V]`` buffer, k_pe a column view of the ``[W, L+R]`` workspace, out / lse narrowed).

Inside, the online softmax runs in fp32 on base-2 statistics (scores scaled by
``softmax_scale * LOG2E``); the LSE that leaves the kernel is natural log (``* LN2``).

Work distribution (no host read of a device value, so one launch serves any batch of a capacity
bucket and can be captured in a CUDA graph): there are ``(Tq // BLOCK_M + n) * N`` (slot, head)
items. Request i owns the program slots
``query_start_loc[i] // BLOCK_M + i .. query_start_loc[i+1] // BLOCK_M + i``, i.e.
``floor((a+q)/B) - floor(a/B) + 1 >= ceil(q/B)`` slots for its q queries: a closed-form upper bound
of the prefix sum of per-request tile counts (vLLM's unified attention uses the same trick), so
no cumsum is needed. Each item finds its request by a binary search over ``query_start_loc``
(log2(n) scalar loads from a cached [n+1] array) and is skipped when its slot is the spare one
of its request, the request has no queries, or (context) no rows in this chunk: in a device
schedule, most requests of the batch have no rows in a given chunk and stay untouched.
The launch is persistent (``grid``: at most a few programs per SM): the requests with keys are a
contiguous run ``first .. last`` found by two binary searches over the key offsets, and the
programs stride over that run's slots times the heads only, so an empty chunk costs a launch.

Key loop per (query tile, head), as in Triton's fused-attention tutorial: full key tiles without
masks, then the masked remainder. Causal (suffix, keys = queries of the same request): tiles left
of the diagonal unmasked, the diagonal block masked, tiles past it skipped.

A sliding window (DESIGN §11, ``WINDOW``): query j of a request sees its keys k >= j - d (suffix: d = w - 1;
context: d = starts[i] + w - 1 - c_i, the chunk's row k being context position starts[i] + k), so a query
tile reads the key tiles from its first query's lowest key on, every one masked; a row may see no key of the
call (then 0 / -inf), and a request continues an earlier chunk when ``starts[i]`` is past its window's first
position ``max(0, c_i - w + 1)``.

Dtypes: q / k / v in float16, bfloat16 or float32 (float64 raises TypeError: the torch reference is
the float64 path). 16-bit operands go to ``tl.dot`` as they are (fp32 accumulation; probabilities
are rounded to the value dtype for the second product, as in FlashAttention); fp32 operands use
``input_precision="ieee"`` (no TF32). Triton's interpreter has no bf16 arithmetic: there bf16 is
upcast to fp32 before any math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    LN2,
    LOG2E,
    device_guard,
    dot_dtype,
    dot_precision,
    find_request,
    neg_inf_to_nan,
    online_softmax_step,
    online_softmax_step_masked,
    persistent_grid,
    persistent_programs,
)


@triton.jit
def _attn_key_tile(
    acc, l_i, m_i,  # [BLOCK_M, BLOCK_V] fp32, [BLOCK_M] fp32 (base-2 running sum and max)
    q_nope, q_pe,  # [BLOCK_M, BLOCK_P], [BLOCK_M, BLOCK_R]
    k_nope_ptrs,  # [BLOCK_P, 1] at key 0 of the request (loaded transposed)
    k_pe_ptrs,  # [BLOCK_R, 1]
    v_ptrs,  # [1, BLOCK_V]
    stride_kt, stride_pt, stride_vt,
    mask_p, mask_r, mask_v,  # [BLOCK_P, 1], [BLOCK_R, 1], [1, BLOCK_V]: head-dim bounds
    query_pos,  # [BLOCK_M] positions of the tile's queries in their request
    key_floor,  # [BLOCK_M] (WINDOW only) the lowest key each query sees
    start_n, offs_n, num_keys, qk_scale,  # offs_n: tl.arange(0, BLOCK_N), made once outside the loop
    BLOCK_N: tl.constexpr,
    DIAGONAL: tl.constexpr,  # causal mask: key <= query position
    MASK_KEYS: tl.constexpr,  # key tiles may run past num_keys
    WINDOW: tl.constexpr,  # a sliding window: key >= key_floor
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold the key tile ``start_n .. start_n + BLOCK_N`` into the running softmax."""
    keys = start_n + offs_n  # [BLOCK_N] key positions in the request
    rows = keys.to(tl.int64)
    if MASK_KEYS:
        key_ok = keys < num_keys
        k_nope = tl.load(k_nope_ptrs + rows[None, :] * stride_kt, mask=mask_p & key_ok[None, :], other=0.0)
        k_pe = tl.load(k_pe_ptrs + rows[None, :] * stride_pt, mask=mask_r & key_ok[None, :], other=0.0)
        v = tl.load(v_ptrs + rows[:, None] * stride_vt, mask=key_ok[:, None] & mask_v, other=0.0)
    else:
        k_nope = tl.load(k_nope_ptrs + rows[None, :] * stride_kt, mask=mask_p, other=0.0)
        k_pe = tl.load(k_pe_ptrs + rows[None, :] * stride_pt, mask=mask_r, other=0.0)
        v = tl.load(v_ptrs + rows[:, None] * stride_vt, mask=mask_v, other=0.0)
    qk = tl.dot(q_nope, k_nope.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    qk = tl.dot(q_pe, k_pe.to(DOT_DTYPE), qk, input_precision=DOT_PRECISION)
    qk = neg_inf_to_nan(qk * qk_scale)  # base-2 logits; scaled before the max so any sign of the scale works
    if MASK_KEYS:
        qk = tl.where(key_ok[None, :], qk, float("-inf"))
    if DIAGONAL:
        qk = tl.where(keys[None, :] <= query_pos[:, None], qk, float("-inf"))
    if WINDOW:  # a row may see no key of this tile, nor of the ones before
        qk = tl.where(keys[None, :] >= key_floor[:, None], qk, float("-inf"))
        p, acc, l_i, m_i = online_softmax_step_masked(qk, acc, l_i, m_i)
    else:
        # Every row sees a key in the first tile it processes, so the running max is finite from then on (or the
        # row has a non-finite score and comes out NaN, out and lse).
        p, acc, l_i, m_i = online_softmax_step(qk, acc, l_i, m_i)
    acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i,  # [BLOCK_M, BLOCK_V] fp32, [BLOCK_M] fp32 (base-2 running sum and max)
    q_nope, q_pe,  # [BLOCK_M, BLOCK_P], [BLOCK_M, BLOCK_R]
    k_nope_ptrs,  # [BLOCK_P, 1] at key 0 of the request (loaded transposed)
    k_pe_ptrs,  # [BLOCK_R, 1]
    v_ptrs,  # [1, BLOCK_V]
    stride_kt, stride_pt, stride_vt,
    mask_p, mask_r, mask_v,  # [BLOCK_P, 1], [BLOCK_R, 1], [1, BLOCK_V]: head-dim bounds
    query_pos,  # [BLOCK_M] positions of the tile's queries in their request
    key_floor,  # [BLOCK_M] (WINDOW only) the lowest key each query sees
    lo, hi, num_keys, qk_scale,
    BLOCK_N: tl.constexpr,
    DIAGONAL: tl.constexpr,  # causal mask: key <= query position
    MASK_KEYS: tl.constexpr,  # key tiles may run past num_keys
    WINDOW: tl.constexpr,  # a sliding window: key >= key_floor
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Key tiles ``lo, lo + BLOCK_N, ...`` below ``hi``, folded into the running softmax."""
    offs_n = tl.arange(0, BLOCK_N)
    if INTERPRETED:  # bounds read from tensors: no range() under the interpreter (mla_ops/triton/_common.py)
        start_n = lo
        while start_n < hi:
            acc, l_i, m_i = _attn_key_tile(
                acc, l_i, m_i, q_nope, q_pe, k_nope_ptrs, k_pe_ptrs, v_ptrs, stride_kt, stride_pt, stride_vt,
                mask_p, mask_r, mask_v, query_pos, key_floor, start_n, offs_n, num_keys, qk_scale,
                BLOCK_N, DIAGONAL, MASK_KEYS, WINDOW, DOT_DTYPE, DOT_PRECISION,
            )
            start_n += BLOCK_N
    else:
        for start_n in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _attn_key_tile(
                acc, l_i, m_i, q_nope, q_pe, k_nope_ptrs, k_pe_ptrs, v_ptrs, stride_kt, stride_pt, stride_vt,
                mask_p, mask_r, mask_v, query_pos, key_floor, start_n, offs_n, num_keys, qk_scale,
                BLOCK_N, DIAGONAL, MASK_KEYS, WINDOW, DOT_DTYPE, DOT_PRECISION,
            )
    return acc, l_i, m_i


@triton.jit
def _attn_tile(
    slot,  # program slot of the query tile (see the module doc)
    head,  # int64
    q_ptr,  # [Tq, N, P+R]
    k_nope_ptr,  # [S, N, P]
    k_pe_ptr,  # [S, R]
    v_ptr,  # [S, N, V]
    out_ptr,  # [Tq, N, V]
    lse_ptr,  # [N, Tq] float32, natural log
    query_start_loc_ptr,  # [n+1]
    cu_k_ptr,  # [n+1] key row offsets
    starts_ptr,  # [n] (MERGE only)
    context_lens_ptr,  # [n] (WINDOW and MERGE only)
    num_requests,  # n
    window,  # w (WINDOW only)
    qk_scale,  # softmax_scale * LOG2E
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_pt, stride_pd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_lh, stride_lt,
    stride_qsl, stride_cuk, stride_starts, stride_ctx,
    HEAD_P: tl.constexpr, HEAD_R: tl.constexpr, HEAD_V: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,  # suffix: query j sees keys 0..j of its request
    MERGE: tl.constexpr,  # context: fold into out/lse where starts[i] > 0
    WINDOW: tl.constexpr,  # a sliding window (module doc)
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One (query tile, head): attention over its request's keys, stored or merged into out/lse."""
    request = find_request(query_start_loc_ptr, stride_qsl, num_requests, slot, BLOCK_M, 1)
    q_begin = tl.load(query_start_loc_ptr + request * stride_qsl)
    q_len = tl.load(query_start_loc_ptr + (request + 1) * stride_qsl) - q_begin
    k_begin = tl.load(cu_k_ptr + request * stride_cuk)
    num_keys = tl.load(cu_k_ptr + (request + 1) * stride_cuk) - k_begin
    m_start = (slot - (q_begin // BLOCK_M + request)) * BLOCK_M
    # Not a spare slot, a request without queries, or (context) one without rows: those stay untouched.
    if (m_start >= 0) & (m_start < q_len) & (num_keys > 0):
        offs_m = tl.arange(0, BLOCK_M)
        offs_p = tl.arange(0, BLOCK_P)
        offs_r = tl.arange(0, BLOCK_R)
        offs_v = tl.arange(0, BLOCK_V)
        query_pos = m_start + offs_m  # [BLOCK_M] in the request
        row_ok = query_pos < q_len
        q_rows = q_begin.to(tl.int64) + query_pos  # [BLOCK_M] token rows of q / out / lse

        q_row_ptrs = q_ptr + q_rows[:, None] * stride_qt + head * stride_qh
        q_nope = tl.load(
            q_row_ptrs + offs_p[None, :] * stride_qd, mask=row_ok[:, None] & (offs_p[None, :] < HEAD_P), other=0.0
        ).to(DOT_DTYPE)
        q_pe = tl.load(
            q_row_ptrs + (HEAD_P + offs_r)[None, :] * stride_qd, mask=row_ok[:, None] & (offs_r[None, :] < HEAD_R),
            other=0.0,
        ).to(DOT_DTYPE)

        k_first = k_begin.to(tl.int64)
        k_nope_ptrs = k_nope_ptr + k_first * stride_kt + head * stride_kh + offs_p[:, None] * stride_kd
        k_pe_ptrs = k_pe_ptr + k_first * stride_pt + offs_r[:, None] * stride_pd
        v_ptrs = v_ptr + k_first * stride_vt + head * stride_vh + offs_v[None, :] * stride_vd
        mask_p = offs_p[:, None] < HEAD_P
        mask_r = offs_r[:, None] < HEAD_R
        mask_v = offs_v[None, :] < HEAD_V

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
        first = 0  # the context position a request's (windowed) rows begin at
        if WINDOW:
            # Query j sees keys k >= j - shift: from the tile's first query's lowest key on, every tile masked.
            shift = window - 1
            if not CAUSAL:  # chunk row k is context position starts[i] + k, query j is position c_i + j
                context = tl.load(context_lens_ptr + request * stride_ctx)
                shift = tl.load(starts_ptr + request * stride_starts) + window - 1 - context
                first = tl.maximum(context - window + 1, 0)
            hi = num_keys
            if CAUSAL:
                hi = tl.minimum(m_start + BLOCK_M, num_keys)
            acc, l_i, m_i = _attn_fwd_inner(
                acc, l_i, m_i, q_nope, q_pe, k_nope_ptrs, k_pe_ptrs, v_ptrs, stride_kt, stride_pt, stride_vt,
                mask_p, mask_r, mask_v, query_pos, query_pos - shift, tl.maximum(m_start - shift, 0), hi, num_keys,
                qk_scale, BLOCK_N, CAUSAL, True, True, DOT_DTYPE, DOT_PRECISION, INTERPRETED,
            )
        elif CAUSAL:
            # Keys left of the tile's diagonal block are visible to all its queries (and < num_keys).
            acc, l_i, m_i = _attn_fwd_inner(
                acc, l_i, m_i, q_nope, q_pe, k_nope_ptrs, k_pe_ptrs, v_ptrs, stride_kt, stride_pt, stride_vt,
                mask_p, mask_r, mask_v, query_pos, query_pos, 0, m_start, num_keys, qk_scale,
                BLOCK_N, False, False, False, DOT_DTYPE, DOT_PRECISION, INTERPRETED,
            )
            acc, l_i, m_i = _attn_fwd_inner(
                acc, l_i, m_i, q_nope, q_pe, k_nope_ptrs, k_pe_ptrs, v_ptrs, stride_kt, stride_pt, stride_vt,
                mask_p, mask_r, mask_v, query_pos, query_pos, m_start, tl.minimum(m_start + BLOCK_M, num_keys),
                num_keys, qk_scale, BLOCK_N, True, True, False, DOT_DTYPE, DOT_PRECISION, INTERPRETED,
            )
        else:
            full = (num_keys // BLOCK_N) * BLOCK_N
            acc, l_i, m_i = _attn_fwd_inner(
                acc, l_i, m_i, q_nope, q_pe, k_nope_ptrs, k_pe_ptrs, v_ptrs, stride_kt, stride_pt, stride_vt,
                mask_p, mask_r, mask_v, query_pos, query_pos, 0, full, num_keys, qk_scale,
                BLOCK_N, False, False, False, DOT_DTYPE, DOT_PRECISION, INTERPRETED,
            )
            acc, l_i, m_i = _attn_fwd_inner(
                acc, l_i, m_i, q_nope, q_pe, k_nope_ptrs, k_pe_ptrs, v_ptrs, stride_kt, stride_pt, stride_vt,
                mask_p, mask_r, mask_v, query_pos, query_pos, full, num_keys, num_keys, qk_scale,
                BLOCK_N, False, True, False, DOT_DTYPE, DOT_PRECISION, INTERPRETED,
            )

        # Epilogue: normalize, optionally fold into the running partial, store a natural-log LSE.
        if WINDOW:  # a row that saw no key: the empty partial 0 / -inf
            has_keys = l_i > 0
            acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
            lse2 = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        else:
            acc = acc / l_i[:, None]
            lse2 = m_i + tl.math.log2(l_i)  # base 2
        out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_v[None, :] * stride_od
        lse_ptrs = lse_ptr + head * stride_lh + q_rows * stride_lt
        out_mask = row_ok[:, None] & mask_v
        if MERGE:
            if tl.load(starts_ptr + request * stride_starts) > first:  # continuation: merge, as merge_states_reference
                prev2 = tl.load(lse_ptrs, mask=row_ok, other=float("-inf")).to(tl.float32) * LOG2E
                prev2 = tl.where((prev2 == float("inf")) | (prev2 == float("-inf")), float("-inf"), prev2)  # empty
                prev_out = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
                m = tl.maximum(prev2, lse2)  # finite: this partial has keys (WINDOW: maybe neither has)
                if WINDOW:
                    m = tl.where(m == float("-inf"), 0.0, m)
                w_prev = tl.math.exp2(prev2 - m)
                w_new = tl.math.exp2(lse2 - m)
                total = w_prev + w_new
                if WINDOW:  # two empty partials merge to 0 / -inf
                    nonempty = total > 0
                    total = tl.where(nonempty, total, 1.0)
                acc = (prev_out * (w_prev / total)[:, None]) + acc * (w_new / total)[:, None]
                lse2 = m + tl.math.log2(total)
                if WINDOW:
                    lse2 = tl.where(nonempty, lse2, float("-inf"))
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        tl.store(lse_ptrs, (lse2 * LN2).to(lse_ptr.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize=["num_requests", "window"])  # the batch size changes every step
def _attn_fwd(
    q_ptr,  # [Tq, N, P+R]
    k_nope_ptr,  # [S, N, P]
    k_pe_ptr,  # [S, R]
    v_ptr,  # [S, N, V]
    out_ptr,  # [Tq, N, V]
    lse_ptr,  # [N, Tq] float32, natural log
    query_start_loc_ptr,  # [n+1]
    cu_k_ptr,  # [n+1] key row offsets
    starts_ptr,  # [n] (MERGE only)
    context_lens_ptr,  # [n] (WINDOW and MERGE only)
    num_requests,  # n
    num_heads,  # N
    window,  # w (WINDOW only)
    qk_scale,  # softmax_scale * LOG2E
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_pt, stride_pd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_lh, stride_lt,
    stride_qsl, stride_cuk, stride_starts, stride_ctx,
    HEAD_P: tl.constexpr, HEAD_R: tl.constexpr, HEAD_V: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,  # suffix: query j sees keys 0..j of its request
    MERGE: tl.constexpr,  # context: fold into out/lse where starts[i] > 0
    WINDOW: tl.constexpr,  # a sliding window (module doc)
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    tl.static_assert(BLOCK_M % BLOCK_N == 0)  # causal: the unmasked tiles end on the diagonal
    # Persistent: the requests with keys are a run [first, last] of the batch (the rest of a device
    # schedule's chunk is empty); stride over their query-tile slots times the heads only.
    num_keys_total = tl.load(cu_k_ptr + num_requests * stride_cuk)
    if num_keys_total > 0:  # an empty chunk (most of a device schedule's slots) reads one offset
        first = find_request(cu_k_ptr, stride_cuk, num_requests, num_keys_total * 0, 1, 0)  # last with offset 0
        last = find_request(cu_k_ptr, stride_cuk, num_requests, num_keys_total - 1, 1, 0)
        slot_lo = tl.load(query_start_loc_ptr + first * stride_qsl) // BLOCK_M + first
        slot_hi = tl.load(query_start_loc_ptr + (last + 1) * stride_qsl) // BLOCK_M + last + 1
        num_slots = slot_hi - slot_lo
        num_items = num_slots * num_heads
        item = tl.program_id(0)
        while item < num_items:
            _attn_tile(
                slot_lo + item % num_slots, (item // num_slots).to(tl.int64),
                q_ptr, k_nope_ptr, k_pe_ptr, v_ptr, out_ptr, lse_ptr, query_start_loc_ptr, cu_k_ptr, starts_ptr,
                context_lens_ptr, num_requests, window, qk_scale,
                stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_pt, stride_pd,
                stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_lh, stride_lt,
                stride_qsl, stride_cuk, stride_starts, stride_ctx,
                HEAD_P, HEAD_R, HEAD_V, BLOCK_P, BLOCK_R, BLOCK_V, BLOCK_M, BLOCK_N,
                CAUSAL, MERGE, WINDOW, DOT_DTYPE, DOT_PRECISION, INTERPRETED,
            )
            item += tl.num_programs(0)


# (BLOCK_M, BLOCK_N, num_warps, num_stages). At DeepSeek dims (P=128, R=64, V=128), compiled ahead of
# time for sm90 with Triton 3.6 and 3.9 (not run): 16-bit takes 104 KB of shared memory and 232-255
# registers per thread without spills, so two programs fit an SM (3 stages: 144 KB, one per SM).
# fp32 runs tl.dot without tensor cores ("ieee"): 64-row tiles spill kilobytes; 32 x 32 tiles with
# 8 warps spill 0-32 bytes (3.6) or 60-572 (3.9, causal worst). Token and request counts are not compile-time
# keys: a new batch never recompiles.
CUDA_CONFIG_16BIT = (64, 64, 4, 2)
PROGRAMS_PER_SM = 2  # two 16-bit programs fit an SM (above)
# Wider heads (BLOCK_P + BLOCK_R > 256 or BLOCK_V > 128: GLM-4.7-Flash's P=192, V=256), built for sm90
# with Triton 3.6 (benchmarks/sm90_build.py): 64 x 64 with 4 warps spills 832 bytes a thread (merging),
# 64 x 32 with 8 warps 496, 128 x 16 with 8 warps 168 in 116 KB of shared memory (one program an SM).
CUDA_CONFIG_16BIT_WIDE = (128, 16, 8, 2)
PROGRAMS_PER_SM_WIDE = 1
CUDA_CONFIG_FP32 = (32, 32, 8, 2)
# The interpreter: small tiles, so small test shapes still cover multi-tile loops and merges.
INTERPRETER_CONFIG = (16, 16, 1, 1)


def head_blocks(nope_dim: int, rope_dim: int, value_dim: int) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_R, BLOCK_V): the head dims padded to powers of two, at least 16 (tl.dot's minimum)."""
    return tuple(max(16, triton.next_power_of_2(d)) for d in (nope_dim, rope_dim, value_dim))


def launch_config(dtype: torch.dtype, interpreted: bool, nope_dim: int, rope_dim: int, value_dim: int):
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages, programs per SM)`` for these head dims (above)."""
    if interpreted:
        return (*INTERPRETER_CONFIG, PROGRAMS_PER_SM)
    if dtype == torch.float32:
        return (*CUDA_CONFIG_FP32, PROGRAMS_PER_SM)
    block_p, block_r, block_v = head_blocks(nope_dim, rope_dim, value_dim)
    if block_p + block_r > 256 or block_v > 128:
        return (*CUDA_CONFIG_16BIT_WIDE, PROGRAMS_PER_SM_WIDE)
    return (*CUDA_CONFIG_16BIT, PROGRAMS_PER_SM)


def slots(num_tokens: int, num_requests: int, block_m: int) -> int:
    """Query-tile slots of a batch (or of its live run of requests): one spare slot per request."""
    return num_tokens // block_m + num_requests


def grid(num_tokens: int, num_requests: int, num_heads: int, block_m: int, programs: int) -> tuple[int]:
    """The launch grid: at most ``programs``, at most the batch's (slot, head) items."""
    return persistent_grid(slots(num_tokens, num_requests, block_m) * num_heads, programs)


def _launch(q, k_nope, k_pe, v, query_start_loc, cu_k, starts, softmax_scale, out, lse, causal: bool,
            context_lens=None, window: int = 0) -> None:
    num_tokens, num_heads = q.shape[0], q.shape[1]
    num_requests = query_start_loc.shape[0] - 1
    with device_guard(q) as interpreted:
        dtype = dot_dtype(q.dtype, interpreted, "attention")
        if num_tokens == 0 or num_heads == 0 or num_requests <= 0 or k_nope.shape[0] == 0:
            return  # nothing to attend; context rows of requests without keys stay untouched
        nope_dim, rope_dim, value_dim = k_nope.shape[-1], k_pe.shape[-1], v.shape[-1]
        block_m, block_n, num_warps, num_stages, per_sm = launch_config(q.dtype, interpreted, nope_dim, rope_dim,
                                                                        value_dim)
        block_p, block_r, block_v = head_blocks(nope_dim, rope_dim, value_dim)
        merge = starts is not None
        if starts is None:
            starts = query_start_loc  # unused (MERGE is off); any valid pointer
        if window and merge and context_lens is None:
            raise ValueError("context_attention with a sliding_window needs context_lens (the chunk's requests' [n])")
        if context_lens is None:
            context_lens = query_start_loc  # unused (no window, or the suffix's); any valid pointer

        programs = persistent_programs(q, interpreted, per_sm)
        _attn_fwd[grid(num_tokens, num_requests, num_heads, block_m, programs)](
            q, k_nope, k_pe, v, out, lse,
            query_start_loc, cu_k, starts, context_lens,
            num_requests, num_heads, window, softmax_scale * LOG2E.value,
            *q.stride(), *k_nope.stride(), *k_pe.stride(), *v.stride(), *out.stride(), *lse.stride(),
            query_start_loc.stride(0), cu_k.stride(0), starts.stride(0), context_lens.stride(0),
            HEAD_P=nope_dim, HEAD_R=rope_dim, HEAD_V=value_dim,
            BLOCK_P=block_p, BLOCK_R=block_r, BLOCK_V=block_v, BLOCK_M=block_m, BLOCK_N=block_n,
            CAUSAL=causal, MERGE=merge, WINDOW=window > 0,
            DOT_DTYPE=dtype, DOT_PRECISION=dot_precision(dtype), INTERPRETED=interpreted,
            num_warps=num_warps, num_stages=num_stages,
        )


def context_attention(
    q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, softmax_scale, out, lse, context_lens=None,
    sliding_window=0,
) -> None:
    """Non-causal attention of each request's queries over its rows of the chunk, folded into out/lse.

    Request i (queries ``query_start_loc[i]:[i+1]``, keys ``cu_seq_lens[i]:[i+1]``) merges its
    partial into ``out``/``lse`` when ``starts[i] > 0`` (an ``±inf`` LSE there counts as empty),
    overwrites its rows otherwise, and is left untouched when it has no rows in the chunk. A sliding
    window (``context_lens`` [n], ``sliding_window`` w): see the module doc.
    """
    _launch(q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, softmax_scale, out, lse, causal=False,
            context_lens=context_lens, window=sliding_window)


def suffix_attention(q, k_nope, k_pe, v, query_start_loc, softmax_scale, out, lse, sliding_window=0) -> None:
    """Causal attention of each request's queries over its own keys (same rows); writes every token. With a
    sliding window w, query j sees keys ``j - w + 1 .. j``."""
    _launch(q, k_nope, k_pe, v, query_start_loc, query_start_loc, None, softmax_scale, out, lse, causal=True,
            window=sliding_window)
