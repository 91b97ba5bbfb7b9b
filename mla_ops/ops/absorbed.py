"""Absorbed ("MQA") context attention: queries folded into the latent space, paged cache read in place.

q                [T, N, P+R]   rotated queries            kv_cache [num_blocks, block_size, L+R]
kv_b_proj_weight [N*(P+V), L]  viewed [N, P+V, L]: W_UK = [:, :P] [N, P, L], W_UV = [:, P:] [N, V, L]
block_table      [B, max_blocks] int32   query_start_loc [B+1] int32   context_lens [B] int32
k_scale          [1] float32 or None     dequantized = stored * k_scale (float8_e4m3fn caches only)
-> out           [T, N, V]   lse [N, T] float32 (float64 for float64 q), natural log   (out=)
absorbed_rows    int, -1: T    a static bound of the tokens of the requests with context: the GPU
                               kernels pack those tokens (``absorbed_token_loc``) into a scratch of
                               this many rows (tokens past it get no partial)
absorbed_token_loc [B+1] int32 or None   ``_mla.absorbed_token_loc(query_start_loc, context_lens)``,
                               made once per step by the plan (None: the kernels make it)
sliding_window   int           w (DESIGN §11; 0: none): query j of request r (position c_r + j) sees only
                               context positions ``c_r + j - w + 1 ..``: the rows from ``max(0, c_r - w + 1)``
                               are read, and a query that sees none gets ``0 / -inf``

Dimensions come from shapes: ``L = weight.shape[1]``, ``R = kv_cache.shape[2] - L``,
``P = q.shape[2] - R``, ``V = weight.shape[0] // N - P``.

For request r with ``context_lens[r] > 0`` and its c_r context rows ``[kv_c | k_pe]`` (DESIGN §2
paging), per head n:

    q_lat  = q_nope @ W_UK[n]                                      [q_r, L]
    scores = softmax_scale * (q_lat @ kv_c^T + q_pe @ k_pe^T)      [q_r, c_r], non-causal
    o_lat  = softmax(scores) @ kv_c                                [q_r, L]
    out    = o_lat @ W_UV[n]^T                                     [q_r, V]

which equals the MHA path's context partial (gather, up-project, attend) exactly in real
arithmetic. A query with a NaN or inf score (a non-finite input, an overflow) gets NaN, out and lse.
Rows of requests with ``context_lens[r] == 0`` are left untouched: the caller gives
them the empty partial ``0 / -inf`` (or the chunked MHA path fills them), so routing a batch
between the two paths is just two context_lens vectors (``mla_ops.route_context``).

``latent_context_attention``: the same attention without the fold and the unfold, over queries
already in the latent space:

q               [T, H, L+R]   absorbed queries ``[q_nope @ W_UK | q_pe]`` of H heads
kv_cache        [num_blocks, block_size, L+R]   bf16/fp16/fp32, or float8_e4m3fn with k_scale
block_table     [B, max_blocks] int32   query_start_loc [B+1] int32   context_lens [B] int32
k_scale         [1] float32 or None     dequantized = stored * k_scale (float8_e4m3fn caches only)
-> out          [T, H, L]   lse [H, T] float32 (float64 for float64 q), natural log   (out=)

Per request r with ``context_lens[r] > 0`` and its context rows ``x = [kv_c | k_pe]`` (DESIGN §2
paging), non-causally, one KV head shared by all H query heads:

    scores = softmax_scale * q @ x^T      (= q_lat . kv_c + q_pe . k_pe)     [H, q_r, c_r]
    out    = softmax(scores) @ kv_c                                           [q_r, H, L]

Context parallel all-gathers the folded queries of every rank's heads, runs this op over the
rank's own shard of the cache, and sends the latent partials back to the heads' owners, who merge
them and unfold (``mla_ops/parallel/run.py``). Rows of requests without context are left untouched.

Kernels: ``mla_ops/triton/absorbed.py`` (Triton), ``mla_ops/ops/flashmla.py`` (FlashMLA, SM90) and,
on CPU, the batched engine of ``mla_ops/ops/cpu_attention.py``; the ``*_reference`` functions here
are their oracle (one softmax per request, float32, float64 for float64 q; ``backend="torch"``).
"""

from __future__ import annotations

import torch

from .._mla import MLADims, fold_queries, lse_dtype, split_kv_b_proj, unfold_outputs
from . import cpu_attention
from .cache_formats import latent_rows
from .merge import poisoned_rows, scores_nan_for_neg_inf_


def _absorbed(latent_attention, q, kv_cache, block_table, query_start_loc, context_lens, kv_b_proj_weight,
              softmax_scale, k_scale, out, lse, sliding_window=0) -> None:
    """Fold the queries, attend in the latent space with ``latent_attention`` (the oracle or the CPU
    engine), unfold the rows of the requests with context."""
    acc = lse_dtype(q.dtype)
    num_heads, latent, nope, _, _ = MLADims.from_shapes(q, kv_cache, kv_b_proj_weight)
    w_uk, w_uv = split_kv_b_proj(kv_b_proj_weight, num_heads, nope)
    folded = torch.cat([fold_queries(q, w_uk, acc).transpose(0, 1), q[..., nope:].to(acc)], dim=-1)  # [T, N, L+R]
    o_lat = folded.new_zeros(q.shape[0], num_heads, latent)
    lse_lat = folded.new_full((num_heads, q.shape[0]), float("-inf"))
    latent_attention(folded, kv_cache, block_table, query_start_loc, context_lens, softmax_scale, k_scale,
                     o_lat, lse_lat, sliding_window)
    bounds, contexts = query_start_loc.tolist(), context_lens.tolist()  # host reads: CPU / oracle path
    if bounds[-1] == q.shape[0] and min(contexts, default=1) > 0:  # every token has a partial (decode steps)
        out.copy_(unfold_outputs(o_lat.transpose(0, 1), w_uv).transpose(0, 1))
        lse.copy_(lse_lat)
        return
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    rows = torch.repeat_interleave(context_lens > 0, query_lens)  # the tokens with a partial
    rows = torch.cat([rows, rows.new_zeros(q.shape[0] - rows.shape[0])])  # tokens past query_start_loc[-1]
    out[rows] = unfold_outputs(o_lat[rows].transpose(0, 1), w_uv).transpose(0, 1).to(out.dtype)
    lse[:, rows] = lse_lat[:, rows].to(lse.dtype)


def absorbed_reference(
    q, kv_cache, block_table, query_start_loc, context_lens, kv_b_proj_weight, softmax_scale, k_scale, out, lse,
    absorbed_rows=-1, absorbed_token_loc=None, sliding_window=0,
) -> None:
    del absorbed_rows, absorbed_token_loc  # the torch implementations pack nothing
    _absorbed(latent_attention_reference, q, kv_cache, block_table, query_start_loc, context_lens,
              kv_b_proj_weight, softmax_scale, k_scale, out, lse, sliding_window)


@torch.library.custom_op("mla_ops::absorbed_context_attention", mutates_args=("out", "lse"))
def _absorbed_context_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    softmax_scale: float,
    k_scale: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    absorbed_rows: int = -1,
    absorbed_token_loc: torch.Tensor | None = None,
    sliding_window: int = 0,
) -> None:
    del absorbed_rows, absorbed_token_loc  # the CPU engine packs nothing
    _absorbed(cpu_attention.latent_context_attention, q, kv_cache, block_table, query_start_loc, context_lens,
              kv_b_proj_weight, softmax_scale, k_scale, out, lse, sliding_window)


@_absorbed_context_attention.register_fake
def _(q, kv_cache, block_table, query_start_loc, context_lens, kv_b_proj_weight, softmax_scale, k_scale, out, lse,
      absorbed_rows=-1, absorbed_token_loc=None, sliding_window=0):
    return None


def latent_attention_reference(q, kv_cache, block_table, query_start_loc, context_lens, softmax_scale, k_scale,
                               out, lse, sliding_window=0) -> None:
    """The oracle of ``latent_context_attention``: per request, its context rows read through its block
    table row by row, one softmax (``sliding_window`` w: query j masks positions before ``c + j - w + 1``;
    one that sees none gets ``0 / -inf``)."""
    acc = lse_dtype(q.dtype)
    latent, block_size = out.shape[2], kv_cache.shape[1]
    bounds, contexts = query_start_loc.tolist(), context_lens.tolist()  # host reads
    for r, c in enumerate(contexts):
        t0, t1 = bounds[r], bounds[r + 1]
        if c == 0 or t1 == t0:
            continue
        position = torch.arange(c, device=kv_cache.device)
        x = latent_rows(kv_cache, block_table[r].long()[position // block_size], position % block_size, k_scale,
                        acc)  # [c, L+R]
        scores = scores_nan_for_neg_inf_(torch.einsum("mhd,cd->hmc", q[t0:t1].to(acc), x) * softmax_scale)  # [H, m, c]
        empty = None
        if sliding_window:
            hidden = position < c + torch.arange(t1 - t0, device=q.device)[:, None] - sliding_window + 1  # [m, c]
            scores.masked_fill_(hidden, float("-inf"))
            empty = hidden.all(-1)  # [m]: queries that see no key
        part_lse = torch.logsumexp(scores, dim=-1)
        bad = poisoned_rows(part_lse, empty)  # a non-finite score: NaN out and lse
        lse[:, t0:t1] = part_lse.masked_fill_(bad, float("nan")).to(lse.dtype)
        probs = torch.softmax(scores, dim=-1).masked_fill_(bad.unsqueeze(-1), float("nan"))
        if empty is not None:
            probs.masked_fill_(empty[:, None], 0.0)  # a query that sees no key: the empty partial
        out[t0:t1] = torch.einsum("hmc,cl->mhl", probs, x[:, :latent]).to(out.dtype)


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
    cpu_attention.latent_context_attention(q, kv_cache, block_table, query_start_loc, context_lens, softmax_scale,
                                           k_scale, out, lse)


@_latent_context_attention.register_fake
def _(q, kv_cache, block_table, query_start_loc, context_lens, softmax_scale, k_scale, out, lse) -> None:
    return None
