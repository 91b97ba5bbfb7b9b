"""Absorbed ("MQA") context attention: queries folded into the latent space, paged cache read in place.

q                [T, N, P+R]   rotated queries            kv_cache [num_blocks, block_size, L+R]
kv_b_proj_weight [N*(P+V), L]  viewed [N, P+V, L]: W_UK = [:, :P] [N, P, L], W_UV = [:, P:] [N, V, L]
block_table      [B, max_blocks] int32   query_start_loc [B+1] int32   context_lens [B] int32
k_scale          [1] float32 or None     dequantized = stored * k_scale (float8_e4m3fn caches only)
-> out           [T, N, V]   lse [N, T] float32 (float64 for float64 q), natural log   (out=)
max_absorbed_tokens  int, -1: T         a static bound of the tokens of the requests with context:
                                         the GPU kernels pack those tokens (``routed_token_loc``) into
                                         a scratch of this many rows (tokens past it get no partial)

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
between the two paths is just two context_lens vectors (``mla_ops.routing.route_context``).

Kernels: ``mla_ops/triton/absorbed.py`` (Triton) and ``mla_ops/flashmla.py`` (FlashMLA, SM90);
this module is their oracle and the CPU path, computing in float32 (float64 for float64 q).
"""

from __future__ import annotations

import torch

from .merge import lse_dtype, merge_states_reference

# Context rows per block in the reference loop: bounds the score matrix at N x q_r x KEY_BLOCK.
KEY_BLOCK = 4096


def absorbed_dims(q: torch.Tensor, kv_cache: torch.Tensor, kv_b_proj_weight: torch.Tensor):
    """``(N, L, P, R, V)`` read from the shapes (module docstring)."""
    num_heads, latent = q.shape[1], kv_b_proj_weight.shape[1]
    rope = kv_cache.shape[2] - latent
    nope = q.shape[2] - rope
    value = kv_b_proj_weight.shape[0] // max(num_heads, 1) - nope
    return num_heads, latent, nope, rope, value


def split_kv_b_proj(kv_b_proj_weight: torch.Tensor, num_heads: int, nope: int):
    """``(W_UK [N, P, L], W_UV [N, V, L])``, views of ``kv_b_proj_weight [N*(P+V), L]``."""
    w = kv_b_proj_weight.view(num_heads, -1, kv_b_proj_weight.shape[1])  # [N, P+V, L]
    return w[:, :nope], w[:, nope:]


def fold_queries(q: torch.Tensor, w_uk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q_lat [N, T, L] = q_nope [T, N, P] @ W_UK [N, P, L], one batched matmul in ``dtype``."""
    q_nope = q[..., : w_uk.shape[1]].transpose(0, 1)  # [N, T, P]
    return torch.bmm(q_nope.to(dtype), w_uk.to(dtype))


def unfold_outputs(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """out [N, T, V] = o_lat [N, T, L] @ W_UV^T [N, L, V], one batched matmul in o_lat's dtype."""
    return torch.bmm(o_lat, w_uv.to(o_lat.dtype).transpose(1, 2))


def token_requests(query_start_loc: torch.Tensor, num_tokens: int):
    """Per query token, on the device (no host read): ``(request, position, valid)``, each [T].

    ``request`` (int64, clamped into [0, B)) owns the token, ``position`` (int64) is its index in
    the request's queries, ``valid`` is False for tokens past ``query_start_loc[-1]``.
    """
    tokens = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    request = torch.searchsorted(query_start_loc, tokens, right=True) - 1
    request = request.clamp(0, max(query_start_loc.shape[0] - 2, 0))
    position = tokens.long() - query_start_loc.long()[request]
    return request, position, tokens < query_start_loc[-1]


def routed_token_loc(query_start_loc: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """[B+1] int32: request r's tokens at rows ``loc[r] .. loc[r+1]`` of a buffer that packs the
    tokens of the requests with context only (device code, no host read)."""
    lens = torch.where(context_lens > 0, query_start_loc[1:] - query_start_loc[:-1], 0)
    return torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0, dtype=torch.int32)]).to(torch.int32)


def _context_rows(kv_cache, block_table, request: int, begin: int, end: int, k_scale, acc):
    """Context rows ``begin:end`` of ``request`` from the paged cache, dequantized, in ``acc``."""
    position = torch.arange(begin, end, device=kv_cache.device)
    block_size = kv_cache.shape[1]
    rows = kv_cache[block_table[request].long()[position // block_size], position % block_size]
    if kv_cache.dtype == torch.float8_e4m3fn:
        return rows.float().to(acc) * k_scale.to(acc)
    return rows.to(acc)


def latent_partial(qr, kv_cache, block_table, request: int, context: int, latent: int, k_scale, acc):
    """One request's non-causal attention over its context in the latent space, key block by block.

    qr [m, H, L+R]: scaled queries ``[q_lat | q_pe]`` in ``acc`` -> ``(o_lat [m, H, L], lse [H, m])``.
    """
    o_lat, lse = None, None
    for k0 in range(0, context, KEY_BLOCK):
        rows = _context_rows(kv_cache, block_table, request, k0, min(k0 + KEY_BLOCK, context), k_scale, acc)
        scores = torch.einsum("mhd,sd->hms", qr, rows)  # [H, m, s]: q_lat . kv_c + q_pe . k_pe
        block_lse = torch.logsumexp(scores, dim=-1)  # [H, m]
        block_out = torch.einsum("hms,sl->mhl", torch.exp(scores - block_lse.unsqueeze(-1)), rows[:, :latent])
        if o_lat is None:
            o_lat, lse = block_out, block_lse
        else:
            o_lat, lse = merge_states_reference(o_lat, lse, block_out, block_lse)
    return o_lat, lse


def absorbed_reference(
    q, kv_cache, block_table, query_start_loc, context_lens, kv_b_proj_weight, softmax_scale, k_scale, out, lse,
    max_absorbed_tokens=-1,
) -> None:
    del max_absorbed_tokens  # the reference packs nothing
    acc = lse_dtype(q.dtype)
    num_heads, latent, nope, _, _ = absorbed_dims(q, kv_cache, kv_b_proj_weight)
    w_uk, w_uv = (w.to(acc) for w in split_kv_b_proj(kv_b_proj_weight, num_heads, nope))
    bounds, contexts = query_start_loc.tolist(), context_lens.tolist()  # host reads: CPU / oracle path
    for r, context in enumerate(contexts):
        t0, t1 = bounds[r], bounds[r + 1]
        if context <= 0 or t0 == t1:
            continue
        qr = q[t0:t1].to(acc)  # [m, N, P+R]
        q_lat = torch.einsum("mnp,npl->mnl", qr[..., :nope], w_uk)  # [m, N, L]
        folded = torch.cat([q_lat, qr[..., nope:]], dim=-1) * softmax_scale  # [m, N, L+R]
        o_lat, lse_r = latent_partial(folded, kv_cache, block_table, r, context, latent, k_scale, acc)
        out[t0:t1] = torch.einsum("mnl,nvl->mnv", o_lat, w_uv).to(out.dtype)
        lse[:, t0:t1] = lse_r.to(lse.dtype)


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
) -> None:
    absorbed_reference(
        q, kv_cache, block_table, query_start_loc, context_lens, kv_b_proj_weight, softmax_scale, k_scale, out, lse,
        max_absorbed_tokens,
    )


@_absorbed_context_attention.register_fake
def _(q, kv_cache, block_table, query_start_loc, context_lens, kv_b_proj_weight, softmax_scale, k_scale, out, lse,
      max_absorbed_tokens=-1):
    return None
