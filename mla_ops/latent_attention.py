"""Latent attention over the paged cache, the queries already folded into the latent space.

q               [T, H, L+R]   absorbed queries ``[q_nope @ W_UK | q_pe]`` of H heads
kv_cache        [num_blocks, block_size, L+R]   bf16/fp16/fp32, or float8_e4m3fn with k_scale
block_table     [B, max_blocks] int32   query_start_loc [B+1] int32   context_lens [B] int32
k_scale         [1] float32 or None     dequantized = stored * k_scale (float8_e4m3fn caches only)
-> out          [T, H, L]   lse [H, T] float32 (float64 for float64 q), natural log   (out=)

Per request r with ``context_lens[r] > 0`` and its context rows ``x = [kv_c | k_pe]`` (DESIGN §2
paging), non-causally, one KV head shared by all H query heads:

    scores = softmax_scale * q @ x^T      (= q_lat . kv_c + q_pe . k_pe)     [H, q_r, c_r]
    out    = softmax(scores) @ kv_c                                           [q_r, H, L]

This is ``absorbed_context_attention`` (``mla_ops/absorbed.py``) without its fold (``W_UK``) and
unfold (``W_UV``): context parallel all-gathers the folded queries of every rank's heads, runs
this op over the rank's own shard of the cache, and sends the latent partials back to the heads'
owners, who merge them and unfold (``mla_ops/context_parallel.py``). Rows of requests without
context are left untouched, as in the absorbed op.

Kernels: the torch reference below (the oracle and the CPU path) and, on CUDA, the absorbed
path's Triton kernel (``mla_ops/triton/absorbed.py``, which takes the folded queries and the
latent output as strided views), launched here with that module's tile configurations.
"""

from __future__ import annotations

import torch

from . import backends
from .absorbed import KEY_BLOCK, _context_rows
from .merge import lse_dtype, merge_states_reference


def latent_attention_reference(q, kv_cache, block_table, query_start_loc, context_lens, softmax_scale, k_scale,
                               out, lse) -> None:
    acc = lse_dtype(q.dtype)
    latent = out.shape[2]
    bounds, contexts = query_start_loc.tolist(), context_lens.tolist()  # host reads: CPU / oracle path
    for r, context in enumerate(contexts):
        t0, t1 = bounds[r], bounds[r + 1]
        if context <= 0 or t0 >= t1:
            continue
        qr = q[t0:t1].to(acc) * softmax_scale  # [m, H, L+R]
        o_r, lse_r = None, None
        for k0 in range(0, context, KEY_BLOCK):
            rows = _context_rows(kv_cache, block_table, r, k0, min(k0 + KEY_BLOCK, context), k_scale, acc)  # [s, L+R]
            scores = torch.einsum("mhd,sd->hms", qr, rows)
            block_lse = torch.logsumexp(scores, dim=-1)  # [H, m]
            block_out = torch.einsum("hms,sl->mhl", torch.exp(scores - block_lse.unsqueeze(-1)), rows[:, :latent])
            if o_r is None:
                o_r, lse_r = block_out, block_lse
            else:
                o_r, lse_r = merge_states_reference(o_r, lse_r, block_out, block_lse)
        out[t0:t1] = o_r.to(out.dtype)
        lse[:, t0:t1] = lse_r.to(lse.dtype)


@torch.library.custom_op("mla_ops::latent_context_attention", mutates_args=("out", "lse"))
def _latent_context_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float,
    k_scale: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    latent_attention_reference(q, kv_cache, block_table, query_start_loc, context_lens, softmax_scale, k_scale,
                               out, lse)


@_latent_context_attention.register_fake
def _(q, kv_cache, block_table, query_start_loc, context_lens, softmax_scale, k_scale, out, lse) -> None:
    return None


def latent_attention_triton(q, kv_cache, block_table, query_start_loc, context_lens, softmax_scale, k_scale,
                            out, lse) -> None:
    """The op's contract on the absorbed Triton kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
    import triton

    from .triton import absorbed as kernel
    from .triton._common import LOG2E, device_guard, dot_dtype, dot_precision

    num_tokens, num_heads = q.shape[0], q.shape[1]
    latent = out.shape[2]
    rope = q.shape[2] - latent
    num_requests = context_lens.shape[0]
    with device_guard(q) as interpreted:
        dtype = dot_dtype(q.dtype, interpreted, "latent attention")
        if num_tokens == 0 or num_heads == 0 or num_requests == 0 or kv_cache.numel() == 0:
            return
        rows, block_n, block_dv, num_warps, num_stages = (
            kernel.INTERPRETER_CONFIG if interpreted
            else kernel.CUDA_CONFIG_FP32 if q.dtype == torch.float32 else kernel.CUDA_CONFIG_16BIT
        )
        block_l = max(16, triton.next_power_of_2(latent))
        block_dv = min(block_dv, block_l)
        block_h = min(triton.next_power_of_2(num_heads), rows)
        block_m = rows // block_h
        q_lat, q_pe = q[..., :latent], q[..., latent:]  # [T, H, L], [T, H, R] views
        is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
        cache = kv_cache.view(torch.uint8) if is_fp8 else kv_cache
        grid = (num_tokens // block_m + num_requests, triton.cdiv(num_heads, block_h), triton.cdiv(latent, block_dv))
        kernel._absorbed_fwd[grid](
            q_lat, q_pe, cache, block_table, query_start_loc, context_lens,
            k_scale if is_fp8 else lse,  # a never-read placeholder pointer otherwise
            out, lse,
            num_requests, num_heads, softmax_scale * LOG2E.value,
            *q_lat.stride(), *q_pe.stride(), *cache.stride(), *block_table.stride(),
            query_start_loc.stride(0), context_lens.stride(0), *out.stride(), *lse.stride(),
            HEAD_L=latent, HEAD_R=rope,
            BLOCK_L=block_l, BLOCK_R=max(16, triton.next_power_of_2(rope)), BLOCK_DV=block_dv,
            BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_N=block_n,
            PAGE_SIZE=kv_cache.shape[1], IS_FP8=is_fp8,
            DOT_DTYPE=dtype, DOT_PRECISION=dot_precision(dtype), INTERPRETED=interpreted,
            num_warps=num_warps, num_stages=num_stages,
        )


def _latent_attention_cuda(*args) -> None:
    if not backends.triton_available() or args[0].dtype == torch.float64:
        return latent_attention_reference(*args)
    return latent_attention_triton(*args)


torch.library.register_kernel("mla_ops::latent_context_attention", "cuda", _latent_attention_cuda)


def latent_kernel(kernels: backends.Kernels):
    """The implementation that goes with the other ops a ``run_prefill`` call picked (``backends.select``)."""
    if kernels.gather_context is backends.REFERENCE.gather_context:
        return latent_attention_reference
    if kernels.gather_context is backends.OPS.gather_context:
        return torch.ops.mla_ops.latent_context_attention.default
    return latent_attention_triton
