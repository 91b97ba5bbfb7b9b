"""Triton kernel: merge two attention partials over disjoint key sets by log-sum-exp.

prefix_out [T, N, V]   prefix_lse [N, T]   natural log; any strides
suffix_out [T, N, V]   suffix_lse [N, T]
-> out [T, N, V] (dtype of prefix_out, contiguous), lse [N, T] float32 (float64 for float64 out)

Per (token, head): ``lse = logaddexp(a, b)``, ``out = out_a * exp(a - lse) + out_b * exp(b - lse)``
(oracle: ``merge_states_reference`` in ``mla_ops/ops/merge.py``, same order of operations). An LSE of
``±inf`` is an empty partial (FA2 and FlashMLA report ``+inf``) and counts as ``-inf``; two empty
partials merge to ``0 / -inf``, never NaN; a NaN partial (a non-finite score) merges to NaN. One program
per token and BLOCK_H heads; V is padded to a power of two and masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._mla import lse_dtype
from ._common import device_guard


@triton.jit
def _merge_attn_states_kernel(
    out_ptr,  # [T, N, V]
    lse_ptr,  # [N, T]
    prefix_out_ptr,  # [T, N, V]
    prefix_lse_ptr,  # [N, T]
    suffix_out_ptr,  # [T, N, V]
    suffix_lse_ptr,  # [N, T]
    num_heads,
    head_dim,
    stride_out_t, stride_out_h, stride_out_v,
    stride_lse_h, stride_lse_t,
    stride_prefix_t, stride_prefix_h, stride_prefix_v,
    stride_prefix_lse_h, stride_prefix_lse_t,
    stride_suffix_t, stride_suffix_h, stride_suffix_v,
    stride_suffix_lse_h, stride_suffix_lse_t,
    BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_V)
    head_mask = heads < num_heads
    mask = head_mask[:, None] & (dims < head_dim)[None, :]
    acc_type = lse_ptr.dtype.element_ty  # float32, or float64 for an exact float64 oracle run

    a = tl.load(prefix_lse_ptr + heads * stride_prefix_lse_h + token * stride_prefix_lse_t, mask=head_mask)
    b = tl.load(suffix_lse_ptr + heads * stride_suffix_lse_h + token * stride_suffix_lse_t, mask=head_mask)
    a = a.to(acc_type)
    b = b.to(acc_type)
    a = tl.where(a == float("inf"), float("-inf"), a)  # +inf (FA2, FlashMLA) means empty too
    b = tl.where(b == float("inf"), float("-inf"), b)
    m = tl.maximum(a, b)
    m = tl.where(m == float("-inf"), 0.0, m)  # both empty: keep exp() finite
    wa = tl.exp(a - m)
    wb = tl.exp(b - m)
    total = wa + wb
    empty = total == 0  # both empty; a NaN partial (total NaN) stays NaN, out and lse
    total = tl.where(empty, 1.0, total)
    lse = tl.where(empty, float("-inf"), tl.log(total) + m)  # -inf where both are empty
    wa = wa / total
    wb = wb / total
    tl.store(lse_ptr + heads * stride_lse_h + token * stride_lse_t, lse, mask=head_mask)

    prefix = tl.load(
        prefix_out_ptr + token * stride_prefix_t + heads[:, None] * stride_prefix_h + dims[None, :] * stride_prefix_v,
        mask=mask,
    )
    suffix = tl.load(
        suffix_out_ptr + token * stride_suffix_t + heads[:, None] * stride_suffix_h + dims[None, :] * stride_suffix_v,
        mask=mask,
    )
    out = prefix.to(acc_type) * wa[:, None] + suffix.to(acc_type) * wb[:, None]
    out_ptrs = out_ptr + token * stride_out_t + heads[:, None] * stride_out_h + dims[None, :] * stride_out_v
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


ELEMENTS_PER_PROGRAM = 2048  # BLOCK_H * BLOCK_V: 16 heads of V = 128
NUM_WARPS = 4


def merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials of the same queries; returns ``(out [T, N, V], lse [N, T])``."""
    tokens, heads, head_dim = prefix_out.shape
    out = torch.empty((tokens, heads, head_dim), dtype=prefix_out.dtype, device=prefix_out.device)
    lse = torch.empty((heads, tokens), dtype=lse_dtype(prefix_out.dtype), device=prefix_out.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    with device_guard(prefix_out):
        block_v = triton.next_power_of_2(head_dim)
        block_h = min(triton.next_power_of_2(heads), max(1, ELEMENTS_PER_PROGRAM // block_v))
        grid = (tokens, triton.cdiv(heads, block_h))
        _merge_attn_states_kernel[grid](
            out,
            lse,
            prefix_out,
            prefix_lse,
            suffix_out,
            suffix_lse,
            heads,
            head_dim,
            *out.stride(),
            *lse.stride(),
            *prefix_out.stride(),
            *prefix_lse.stride(),
            *suffix_out.stride(),
            *suffix_lse.stride(),
            BLOCK_H=block_h,
            BLOCK_V=block_v,
            num_warps=NUM_WARPS,
        )
    return out, lse
