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
from .absorbed import latent_partial
from .merge import lse_dtype


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
        o_r, lse_r = latent_partial(qr, kv_cache, block_table, r, context, latent, k_scale, acc)
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
    from .triton.absorbed import latent_attention

    latent = out.shape[2]
    latent_attention(q[..., :latent], q[..., latent:], kv_cache, block_table, query_start_loc, context_lens,
                     softmax_scale, k_scale, out, lse)


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
