"""Sparse attention (DSA, DESIGN §12): absorbed MQA over each query's selected keys, read where they are.

q                [T, N, P+R]   rotated queries          kv_c [T, L], k_pe [T, R]: the step's new rows (q's dtype)
kv_cache         [num_blocks, block_size, L+R]   bf16/fp16/fp32, or float8_e4m3fn with k_scale
block_table      [B, max_blocks] int32   query_start_loc [B+1] int32   context_lens [B] int32
sparse           [B] bool      the requests this op serves (the plan's ``sparse``)
topk_indices     [T, K] int32  per token, positions in its request's sequence (-1: none; -2, NO_FINITE_SELECTION:
                               the indexer had no finite scores for the token, whose output is then NaN)
kv_b_proj_weight [N*(P+V), L]  W_UK = [:, :P] [N, P, L], W_UV = [:, P:] [N, V, L] (``_mla.split_kv_b_proj``)
k_scale          [1] float32 or None   dequantized = stored * k_scale (float8_e4m3fn caches only)
sliding_window   int           w (DESIGN §11; 0: none): a selected key counts only if it lies in the query's window
-> out           [T, N, V]   lse [N, T] float32 (float64 for float64 q), natural log   (out=)

For token t of a request r with ``sparse[r]``, at position ``c_r + j`` of its sequence: its keys are
the entries s of ``topk_indices[t]`` with ``0 <= s <= c_r + j`` (and ``s >= c_r + j - w + 1`` under a sliding
window w; the indexer selects among every candidate, the window masks the selection) (a position past the query's own is
never attended; -1 pads; a position appears at most once in a row: refused on the CPU, a device assert
under ``mla_ops.set_debug(True)``, else counted as often as it appears). Position s is the row ``[kv_c | k_pe]``

    kv_cache[block_table[r, s // block_size], s % block_size]   (* k_scale for fp8)   if s < c_r
    [kv_c | k_pe][query_start_loc[r] + s - c_r]                                         otherwise

and per head n (DESIGN §1, absorbed path):

    q_lat  = q_nope @ W_UK[n]                                        [L]
    scores = softmax_scale * (q_lat . kv_c_row + q_pe . k_pe_row)    over the selected rows
    o_lat  = softmax(scores) @ kv_c rows                             [L]
    out    = o_lat @ W_UV[n]^T                                       [V]

A token without a valid key gets the empty partial (0, -inf). A token whose row holds -2 anywhere gets NaN
(out and lse): ``index_topk``'s mark of a token whose scores were not finite; so does a token (per head) with
a NaN or inf attention score over its selected keys (a non-finite input, an overflow). Rows of tokens of the
other requests and past ``query_start_loc[-1]`` are left untouched: ``run_prefill`` writes the dense paths' merged
result first and this op overwrites the sparse requests' tokens.

Kernels: ``mla_ops/triton/sparse.py`` (Triton); ``sparse_reference`` here is their oracle (float32,
float64 for float64 q) and the CPU op: tokens in blocks, so the gathered rows [tokens, K, L+R] stay
bounded. ``sparse_attention`` is the checked public function.
"""

from __future__ import annotations

import torch

from .. import _checks as checks
from .._mla import (NO_FINITE_SELECTION, MLADims, fold_queries, lse_dtype, split_kv_b_proj, token_requests,
                   unfold_outputs)
from .cache_formats import latent_rows
from .layer_checks import check_layer
from .merge import poisoned_rows, scores_nan_for_neg_inf_

# Gathered rows (tokens x K) per block of the reference: at L+R = 576 fp32, 72 MiB.
REFERENCE_ROWS = 1 << 15


def sparse_reference(q, kv_c, k_pe, kv_cache, block_table, query_start_loc, context_lens, sparse, topk_indices,
                     kv_b_proj_weight, softmax_scale, k_scale, out, lse, sliding_window=0) -> None:
    num_tokens, num_keys = topk_indices.shape
    if num_tokens == 0 or context_lens.shape[0] == 0 or q.shape[1] == 0:
        return
    acc = lse_dtype(q.dtype)
    num_heads, latent, nope, _, _ = MLADims.from_shapes(q, kv_cache, kv_b_proj_weight)
    w_uk, w_uv = split_kv_b_proj(kv_b_proj_weight, num_heads, nope)
    request, position, valid = token_requests(query_start_loc, num_tokens)
    tokens = torch.nonzero(valid & sparse[request]).squeeze(1)  # host read: the CPU / oracle path
    if tokens.numel() == 0:
        return
    new_rows = torch.cat([kv_c, k_pe], dim=1)  # [T, L+R]
    block_size = kv_cache.shape[1]
    step = max(1, REFERENCE_ROWS // max(num_keys, 1))
    for begin in range(0, tokens.numel(), step):
        t = tokens[begin:begin + step]  # [n] token rows
        r = request[t]
        context = context_lens.long()[r][:, None]  # [n, 1]
        s = topk_indices[t].long()  # [n, K]
        key_ok = (s >= 0) & (s <= context + position[t][:, None])
        if sliding_window:  # and inside the query's window
            key_ok &= s > context + position[t][:, None] - sliding_window
        in_cache = key_ok & (s < context)
        # Each selected row read once, from where it lives (host-read masks: the CPU / oracle path);
        # the unselected stay 0 (the cache may hold NaN there: 0 * NaN is NaN).
        rows = q.new_zeros(*s.shape, new_rows.shape[1], dtype=acc)  # [n, K, L+R]
        cached = in_cache.nonzero(as_tuple=True)
        pos = s[cached]
        block = block_table.long()[r[cached[0]], pos // block_size]
        rows[cached] = latent_rows(kv_cache, block, pos % block_size, k_scale, acc)
        fresh = (key_ok & ~in_cache).nonzero(as_tuple=True)
        rows[fresh] = new_rows[query_start_loc.long()[r[fresh[0]]] + s[fresh] - context[fresh[0], 0]].to(acc)
        q_t = q[t]
        folded = torch.cat([fold_queries(q_t, w_uk, acc).transpose(0, 1), q_t[..., nope:].to(acc)], -1)  # [n, N, L+R]
        scores = scores_nan_for_neg_inf_(torch.bmm(folded, rows.transpose(1, 2)) * softmax_scale)  # [n, N, K]
        scores = scores.masked_fill(~key_ok[:, None, :], float("-inf"))
        top = scores.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, 0)  # no key: keep exp() finite
        probs = torch.exp(scores - top)
        total = probs.sum(-1)  # [n, N]
        o_lat = torch.bmm(probs, rows[..., :latent]) / torch.where(total > 0, total, 1)[..., None]
        token_lse = torch.log(total) + top.squeeze(-1)  # -inf without keys
        # NaN, out and lse: a non-finite score among the token's keys, or -2 in its row (no finite selection).
        bad = poisoned_rows(token_lse, ~key_ok.any(1, keepdim=True)) | (s == NO_FINITE_SELECTION).any(1, keepdim=True)
        o_lat = o_lat.masked_fill_(bad.unsqueeze(-1), float("nan"))
        out.index_copy_(0, t, unfold_outputs(o_lat.transpose(0, 1), w_uv).transpose(0, 1).to(out.dtype))
        lse.index_copy_(1, t, token_lse.masked_fill_(bad, float("nan")).t().to(lse.dtype))


@torch.library.custom_op("mla_ops::sparse_attention", mutates_args=("out", "lse"))
def _sparse_attention(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    sparse: torch.Tensor,
    topk_indices: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    softmax_scale: float,
    k_scale: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    sliding_window: int = 0,
) -> None:
    sparse_reference(q, kv_c, k_pe, kv_cache, block_table, query_start_loc, context_lens, sparse, topk_indices,
                     kv_b_proj_weight, softmax_scale, k_scale, out, lse, sliding_window)


@_sparse_attention.register_fake
def _(q, kv_c, k_pe, kv_cache, block_table, query_start_loc, context_lens, sparse, topk_indices, kv_b_proj_weight,
      softmax_scale, k_scale, out, lse, sliding_window=0) -> None:
    return None


def check_topk_indices(topk_indices, num_tokens: int, index_topk: int | None, device: torch.device,
                       device_of: str = "q") -> None:
    """``topk_indices`` [T, K] int32 on ``device`` (K = ``index_topk`` where given)."""
    checks.check_int32(topk_indices, "topk_indices", 2, "[T, index_topk]", device, device_of)
    if topk_indices.shape[0] != num_tokens or (index_topk is not None and topk_indices.shape[1] != index_topk):
        want = [num_tokens, "K" if index_topk is None else index_topk]
        raise ValueError(f"topk_indices must be [T, index_topk] = {want}, got {list(topk_indices.shape)}")


def topk_rows(query_start_loc, context_lens, sparse, num_tokens: int):
    """What ``check_topk_values`` checks a step's rows against, the same for every layer: per token its
    request, ``c_r + q_r``, and whether its row is checked (a live token of a sparse request) [T, 1]."""
    request, _, valid = token_requests(query_start_loc, num_tokens)
    seq = (context_lens + (query_start_loc[1:] - query_start_loc[:-1])).index_select(0, request)  # [T]: c_r + q_r
    return request, seq, (valid & sparse.index_select(0, request))[:, None]


def check_topk_values(topk_indices, query_start_loc, context_lens, sparse, rows=None) -> None:
    """Where readable (CPU): every entry of a sparse request's token lies in ``-2 .. c_r + q_r - 1``
    (positions in its request's sequence) and no position repeats in a row (the softmax would count
    that key twice); other tokens' rows are ignored, so not checked. Elsewhere, under the debug switch
    (``mla_ops.set_debug``), the same checks as device-side asserts. ``rows``: ``topk_rows`` of the step,
    where a step made them once for all its layers."""
    if topk_indices.numel() == 0 or context_lens.shape[0] == 0:
        return
    readable = checks.values_readable(topk_indices, query_start_loc, context_lens, sparse)
    if not (readable or checks.debug_enabled()):
        return
    request, seq, checked = rows or topk_rows(query_start_loc, context_lens, sparse, topk_indices.shape[0])
    bad = ((topk_indices < NO_FINITE_SELECTION) | (topk_indices >= seq[:, None])) & checked
    ordered = topk_indices.sort(dim=1).values  # a repeat is two equal neighbours
    repeated = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)) & checked
    if not readable:  # the debug switch: device-side asserts, no host sync
        torch._assert_async(~bad.any(), "mla_ops debug: topk_indices must lie in -2 .. c_r + q_r - 1")
        torch._assert_async(~repeated.any(), "mla_ops debug: topk_indices must not repeat a position in a row")
        return
    if bad.any():
        t, k = (int(i) for i in torch.nonzero(bad)[0])
        r = int(request[t])
        raise ValueError(f"topk_indices[{t}, {k}] is {int(topk_indices[t, k])}: token {t} of request {r} selects "
                         f"positions in -1 .. {int(seq[t]) - 1} (c_r + q_r - 1; -1 pads, -2 marks a token "
                         "without a finite selection)")
    if repeated.any():
        t, k = (int(i) for i in torch.nonzero(repeated)[0])
        position = int(ordered[t, k])
        columns = torch.nonzero(topk_indices[t] == position).squeeze(1).tolist()
        raise ValueError(f"topk_indices row {t} (request {int(request[t])}) holds position {position} "
                         f"{len(columns)} times (columns {columns}): each selected key must appear once "
                         "(the softmax would count it twice)")


def sparse_attention(q, kv_c, k_pe, kv_cache, block_table, query_start_loc, context_lens, sparse, topk_indices,
                     kv_b_proj_weight, softmax_scale, k_scale=None, *, out=None, lse=None, sliding_window=None):
    """The sparse requests' attention over their selected keys (module doc): ``(out [T, N, V], lse [N, T])``.

    ``out`` / ``lse``: written in place where given (other tokens' rows untouched), else made with the
    empty partial ``0 / -inf``. ``k_scale``: a float or a one-element float32 tensor, required for a
    float8_e4m3fn cache. ``sliding_window``: w, keys outside a query's window are not attended (None: no
    window). Checks everything before anything is written; values (lengths, block ids,
    ``topk_indices`` ranges) only where they are free to read (CPU).
    """
    dims = check_layer(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, out=out)
    window = checks.check_int(sliding_window, "sliding_window", 1, optional=True, most=checks.INT32_MAX) or 0
    device, (num_tokens, num_heads) = q.device, q.shape[:2]
    checks.check_int32(block_table, "block_table", 2, "[B, max_blocks]", device, "q")
    checks.check_int32(query_start_loc, "query_start_loc", 1, "[B+1]", device, "q")
    checks.check_int32(context_lens, "context_lens", 1, "[B]", device, "q")
    checks.check_tensor(sparse, "sparse", 1, "[B]", device, "q", dtype=torch.bool)
    batch = context_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1 or sparse.shape[0] != batch or block_table.shape[0] < batch:
        raise ValueError(f"query_start_loc [B+1], sparse [B] and block_table [>= B, max_blocks] must fit B={batch} "
                         f"context_lens, got {list(query_start_loc.shape)}, {list(sparse.shape)}, "
                         f"{list(block_table.shape)}")
    check_topk_indices(topk_indices, num_tokens, None, device)
    checks.check_k_scale(k_scale, kv_cache, device)
    acc = lse_dtype(q.dtype)
    if lse is not None:
        checks.check_tensor(lse, "lse", 2, "[N, T]", device, "q", dtype=acc)
        if tuple(lse.shape) != (num_heads, num_tokens):
            raise ValueError(f"lse must be [N, T] = {[num_heads, num_tokens]}, got {list(lse.shape)}")
    if checks.values_readable(query_start_loc, context_lens, block_table):
        top = checks.check_lengths(query_start_loc.tolist(), context_lens.tolist(), block_table.numpy(),
                                   kv_cache.shape[1])
        if top >= kv_cache.shape[0]:
            raise ValueError(f"block_table uses block {top}, past the {kv_cache.shape[0]} blocks of kv_cache")
        if int(query_start_loc[-1]) > num_tokens:
            raise ValueError(f"query_start_loc[-1] is {int(query_start_loc[-1])}, past the {num_tokens} tokens of q")
    check_topk_values(topk_indices, query_start_loc, context_lens, sparse)
    if out is None:
        out = q.new_zeros(num_tokens, num_heads, dims.value)
    if lse is None:
        lse = q.new_full((num_heads, num_tokens), float("-inf"), dtype=acc)
    torch.ops.mla_ops.sparse_attention(q, kv_c, k_pe, kv_cache, block_table, query_start_loc, context_lens, sparse,
                                       topk_indices, kv_b_proj_weight, float(softmax_scale),
                                       checks.k_scale_tensor(k_scale, kv_cache), out, lse, window)
    return out, lse

