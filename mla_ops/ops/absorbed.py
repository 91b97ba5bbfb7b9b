"""Absorbed ("MQA") context attention: queries folded into the latent space, paged cache read in place.

q                [T, N, P+R]   rotated queries            kv_cache [num_blocks, block_size, L+R]
kv_b_proj_weight [N*(P+V), L]  viewed [N, P+V, L]: W_UK = [:, :P] [N, P, L], W_UV = [:, P:] [N, V, L]
block_table      [B, max_blocks] int32   query_start_loc [B+1] int32   context_lens [B] int32
k_scale          [1] float32 or None     dequantized = stored * k_scale (float8_e4m3fn caches only)
-> out           [T, N, V]   lse [N, T] float32 (float64 for float64 q), natural log   (out=)
max_absorbed_tokens  int, -1: T         a static bound of the tokens of the requests with context:
                                         the GPU kernels pack those tokens (``routed_token_loc``) into
                                         a scratch of this many rows (tokens past it get no partial)
routed_token_loc [B+1] int32 or None    ``_mla.routed_token_loc(query_start_loc, context_lens)``, made
                                         once per step by the plan (None: the kernels make it)

Dimensions come from shapes: ``L = weight.shape[1]``, ``R = kv_cache.shape[2] - L``,
``P = q.shape[2] - R``, ``V = weight.shape[0] // N - P``.

For request r with ``context_lens[r] > 0`` and its c_r context rows ``[kv_c | k_pe]`` (DESIGN §2
paging), per head n:

    q_lat  = q_nope @ W_UK[n]                                      [q_r, L]
    scores = softmax_scale * (q_lat @ kv_c^T + q_pe @ k_pe^T)      [q_r, c_r], non-causal
    o_lat  = softmax(scores) @ kv_c                                [q_r, L]
    out    = o_lat @ W_UV[n]^T                                     [q_r, V]

which equals the MHA path's context partial (gather, up-project, attend) exactly in real
arithmetic. Rows of requests with ``context_lens[r] == 0`` are left untouched: the caller gives
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

Kernels: ``mla_ops/triton/absorbed.py`` (Triton) and ``mla_ops/ops/flashmla.py`` (FlashMLA, SM90);
this module is their oracle and the CPU path, computing in float32 (float64 for float64 q).
"""

from __future__ import annotations

import torch

from .._mla import KEY_BLOCK, MLADims, fold_queries, lse_dtype, split_kv_b_proj, unfold_outputs
from .attention import PaddedRows, padded_batches
from .merge import merge_into

def _context_rows(kv_cache, tables, context_lens, begin: int, end: int, k_scale, acc):
    """Context rows ``begin:end`` of each request (``tables`` [n, max_blocks] its block table rows),
    dequantized, in ``acc``: ``(rows [n, end - begin, L+R], valid [n, end - begin])``; rows past a
    request's context repeat its first row (a valid block) and are not valid (None: no padding)."""
    position, valid = torch.arange(begin, end, device=kv_cache.device).expand(len(context_lens), -1), None
    if min(context_lens) < end:
        valid = position < torch.tensor(context_lens, device=kv_cache.device)[:, None]
        position = torch.where(valid, position, 0)
    block_size = kv_cache.shape[1]
    slots = tables.gather(1, position // block_size) * block_size + position % block_size
    # One gather of whole rows (flatten is a view for any cache whose blocks are evenly strided).
    rows = kv_cache.flatten(0, 1).index_select(0, slots.flatten()).unflatten(0, slots.shape)
    if kv_cache.dtype == torch.float8_e4m3fn:
        rows = rows.float().to(acc) * k_scale.to(acc)
    return rows.to(acc), valid


def latent_partial(qr, rows, valid, latent: int):
    """Non-causal attention of a padded batch over one key block in the latent space.

    qr [n, m, H, L+R]: scaled queries ``[q_lat | q_pe]``; rows [n, s, L+R], valid [n, s] or None
    -> ``(o_lat [n*m, H, L], lse [H, n*m])``, the layout of ``merge_states_reference``.
    """
    n, m, heads, _ = qr.shape
    scores = torch.bmm(qr.flatten(1, 2), rows.transpose(1, 2))  # [n, m*H, s]: q_lat . kv_c + q_pe . k_pe
    if valid is not None:  # padding rows
        scores.masked_fill_(~valid[:, None, :], float("-inf"))
    block_lse = torch.logsumexp(scores, dim=-1)  # [n, m*H]
    probs = torch.exp(scores - block_lse.unsqueeze(-1))
    if valid is not None:
        probs.nan_to_num_(0.0)  # a block past a short context: 0
    return torch.bmm(probs, rows[..., :latent]).view(n * m, heads, latent), block_lse.view(n * m, heads).t()


def absorbed_reference(
    q, kv_cache, block_table, query_start_loc, context_lens, kv_b_proj_weight, softmax_scale, k_scale, out, lse,
    max_absorbed_tokens=-1, routed_token_loc=None,
) -> None:
    del max_absorbed_tokens, routed_token_loc  # the reference packs nothing
    acc = lse_dtype(q.dtype)
    num_heads, latent, nope, _, _ = MLADims.from_shapes(q, kv_cache, kv_b_proj_weight)
    w_uk, w_uv = split_kv_b_proj(kv_b_proj_weight, num_heads, nope)
    folded = torch.cat([fold_queries(q, w_uk, acc).transpose(0, 1), q[..., nope:].to(acc)], dim=-1)  # [T, N, L+R]
    o_lat = folded.new_zeros(q.shape[0], num_heads, latent)
    lse_lat = folded.new_full((num_heads, q.shape[0]), float("-inf"))
    latent_attention_reference(folded, kv_cache, block_table, query_start_loc, context_lens, softmax_scale, k_scale,
                               o_lat, lse_lat)
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
    max_absorbed_tokens: int = -1,
    routed_token_loc: torch.Tensor | None = None,
) -> None:
    absorbed_reference(
        q, kv_cache, block_table, query_start_loc, context_lens, kv_b_proj_weight, softmax_scale, k_scale, out, lse,
        max_absorbed_tokens, routed_token_loc,
    )


@_absorbed_context_attention.register_fake
def _(q, kv_cache, block_table, query_start_loc, context_lens, kv_b_proj_weight, softmax_scale, k_scale, out, lse,
      max_absorbed_tokens=-1, routed_token_loc=None):
    return None


def latent_attention_reference(q, kv_cache, block_table, query_start_loc, context_lens, softmax_scale, k_scale,
                               out, lse) -> None:
    acc = lse_dtype(q.dtype)
    latent = out.shape[2]
    bounds, contexts = query_start_loc.tolist(), context_lens.tolist()  # host reads: CPU / oracle path
    query_lens = [b - a for a, b in zip(bounds, bounds[1:])]
    for batch in padded_batches(query_lens, contexts, q.shape[1] * (q.shape[2] + latent), KEY_BLOCK):
        # One attention per batch of requests padded to [n, m] queries and [n, s] context rows.
        lens_q, lens_k = [query_lens[r] for r in batch], [contexts[r] for r in batch]
        s = max(lens_k)
        rows_q = PaddedRows([bounds[r] for r in batch], lens_q, 0, max(lens_q), q.device)
        qr = rows_q.take(q).to(acc) * softmax_scale  # [n, m, H, L+R]
        tables = block_table if batch == list(range(len(contexts))) else block_table.index_select(
            0, torch.tensor(batch, device=block_table.device))
        partial = None
        for k0 in range(0, s, KEY_BLOCK):
            rows, valid = _context_rows(kv_cache, tables, lens_k, k0, min(k0 + KEY_BLOCK, s), k_scale, acc)
            partial = merge_into(partial, latent_partial(qr, rows, valid, latent))
        o_lat, lse_lat = partial
        rows_q.put(out, o_lat, 0)
        rows_q.put(lse, lse_lat, 1)


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
