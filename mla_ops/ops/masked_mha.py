"""Top-k-masked MHA: a DSA request's sparse attention computed densely (DESIGN §12, docs/dsa.md).

The same contract as ``sparse_attention`` (``ops/sparse.py``) for the requests it is given, by the other
formula of DESIGN §1: each request's c_r + q_r latent rows gathered once (the context's from the paged cache,
dequantized, then the step's new rows) and up-projected to per-head keys and values, then its queries attend
them densely, a block of queries at a time over the keys up to the block's last position, with every key
outside a query's selection masked (as transformers' eager DSA attention does). Exact either way: the
selection is the mask, so both routes compute one softmax over the same keys.

Which route a request takes is the cost model's (``planning.routing.masked_mha_requests``): this one pays the
up-projection of all c_r + q_r keys and q_r x (c_r + q_r / 2) dense pairs, the absorbed sparse path K_I pairs
per query at the wider latent width. Short sequences are cheaper here.

Non-finite inputs keep ``sparse_attention``'s answers: a key row that is not finite gets a zero value (a
query that does not select it must not see its NaN through a zero weight) and its scores stay non-finite,
so a query that selects it comes out NaN (out and lse), as does a token whose row holds -2.

CPU / eager only: the requests' lengths are read on the host (``step.py`` routes only where that is free).
"""

from __future__ import annotations

import torch

from .. import _checks as checks
from .._mla import NO_FINITE_SELECTION, MLADims, lse_dtype
from ..planning.routing import masked_mha_requests
from .backends import OPS, REFERENCE
from .cache_formats import latent_rows
from .merge import poisoned_rows, scores_nan_for_neg_inf_

# Scores (heads x queries x keys) one query block holds: 32 MiB of float32; and its most queries.
BLOCK_SCORES = 1 << 23
QUERY_BLOCK = 128


def largest_magnitude(t: torch.Tensor) -> torch.Tensor:
    """max |t| (NaN if any is): the inf-norm, by one min-max pass (linalg.vector_norm's is ~10x slower on CPU)."""
    low, high = t.aminmax()
    return torch.maximum(high, -low)


def request_rows(kv_cache, block_table, kv_c, k_pe, request: int, context: int, first_token: int, num_queries: int,
                 start: int, k_scale, dtype) -> torch.Tensor:
    """[c_r + q_r - start, L+R] ``dtype``: request r's latent rows from sequence position ``start`` on (the
    context's from the paged cache, dequantized, then its new rows)."""
    new = torch.cat([kv_c[first_token:first_token + num_queries], k_pe[first_token:first_token + num_queries]],
                    1).to(dtype)
    if start >= context:
        return new[start - context:]
    block_size = kv_cache.shape[1]
    position = torch.arange(start, context, device=kv_c.device)
    block = block_table[request].long().index_select(0, position // block_size)
    return torch.cat([latent_rows(kv_cache, block, position % block_size, k_scale, dtype), new])


def masked_mha(q, kv_c, k_pe, kv_cache, block_table, query_start_loc: list[int], context_lens: list[int],
               requests: list[int], topk_indices, kv_b_proj_weight, softmax_scale: float, k_scale, out, lse,
               sliding_window: int = 0) -> None:
    """``sparse_attention``'s result for the tokens of ``requests`` (host lists: ``query_start_loc`` [B+1],
    ``context_lens`` [B]), written into ``out`` [T, N, V] and ``lse`` [N, T]; other rows untouched."""
    acc = lse_dtype(q.dtype)
    dims = MLADims.from_shapes(q, kv_cache, kv_b_proj_weight)
    num_heads, latent, nope, rope = dims.num_heads, dims.latent, dims.nope, dims.rope
    if num_heads == 0 or nope + rope == 0:
        return  # nothing to attend: the rows stay as given
    weight = kv_b_proj_weight.to(acc)
    for r in requests:
        first, end, context = query_start_loc[r], query_start_loc[r + 1], context_lens[r]
        num_queries = end - first
        if num_queries == 0:
            continue
        # Under a window w the first query sees keys from c_r - w + 1 on: the rows before are never attended.
        start = max(0, context - sliding_window + 1) if sliding_window else 0
        rows = request_rows(kv_cache, block_table, kv_c, k_pe, r, context, first, num_queries, start, k_scale, acc)
        keys = rows.shape[0]
        k_nope, v = dims.split_kv(rows[:, :latent] @ weight.t())  # [S, N, P], [S, N, V]
        if not bool(torch.isfinite(largest_magnitude(rows))):  # some row is not finite:
            finite = torch.isfinite(rows).all(1)  # its value is 0 (its scores flag the queries that select it)
            v = torch.where(finite[:, None, None], v, 0)
        v = v.transpose(0, 1).contiguous()  # [N, S, V]
        k = rows.new_empty(num_heads, nope + rope, keys)  # [N, P+R, S]: the GEMMs' layout, written once
        k[:, :nope] = k_nope.permute(1, 2, 0)
        k[:, nope:] = rows[:, latent:].t()
        q_r = (q[first:end].to(acc) * softmax_scale).transpose(0, 1).contiguous()  # [N, q_r, P+R], scale folded in
        # A score is finite wherever its query and key are and the products cannot overflow: then no score needs
        # the -inf -> NaN pass below (a cheap bound on the whole request).
        bound = largest_magnitude(q_r) * largest_magnitude(k) * (nope + rope)
        exact_scores = bool(bound < torch.finfo(acc).max)  # False for a NaN bound
        selected = topk_indices[first:end].long() - start  # [q_r, K] columns of the request's rows
        position = context - start + torch.arange(num_queries, device=q.device)[:, None]  # [q_r, 1] the query's
        ok = (selected >= 0) & (selected <= position)
        if sliding_window:
            ok &= selected > position - sliding_window
        empty = ~ok.any(1)  # [q_r]: no key, the empty partial
        no_selection = (selected + start == NO_FINITE_SELECTION).any(1)  # [q_r]: NaN (module doc)
        marked = bool(empty.any() | no_selection.any())  # host reads: the CPU path
        # Hidden key columns of each query: True; the invalid entries land in a spare last column.
        columns = torch.where(ok, selected, keys)
        # Query blocks: causally, a block sees the keys up to its last query, so small blocks skip most of the
        # masked upper triangle; the scores budget bounds a block over a long context.
        block = max(1, min(QUERY_BLOCK, BLOCK_SCORES // max(num_heads * keys, 1)))
        for j0 in range(0, num_queries, block):
            j1 = min(num_queries, j0 + block)
            visible = context + j1 - start  # keys up to the block's last query
            hidden = torch.ones(j1 - j0, keys + 1, dtype=torch.bool, device=q.device)
            hidden = hidden.scatter_(1, columns[j0:j1], False)[:, :visible]
            scores = torch.bmm(q_r[:, j0:j1], k[:, :, :visible])  # [N, b, keys]
            if not exact_scores:  # -inf from the inputs is not finite: NaN, before the mask writes -inf (ops/merge.py)
                scores.nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=float("nan"))
            scores.masked_fill_(hidden, float("-inf"))
            top = scores.amax(-1)  # [N, b]: -inf without keys, NaN / inf for a non-finite score
            probs = torch.softmax(scores, -1)
            o = torch.bmm(probs, v[:, :visible])  # [N, b, V]
            # lse = max + log(sum exp(s - max)) = max - log(the largest probability), without another pass over exp
            block_lse = top - torch.log(probs.amax(-1))
            if marked or not exact_scores:
                bad = poisoned_rows(top, empty[j0:j1]) | no_selection[j0:j1]
                block_lse.masked_fill_(empty[j0:j1], float("-inf")).masked_fill_(bad, float("nan"))
                o.masked_fill_(empty[j0:j1, None], 0).masked_fill_(bad[..., None], float("nan"))
            out[first + j0:first + j1] = o.transpose(0, 1)
            lse[:, first + j0:first + j1] = block_lse


def attend_selected(call, kv_c, k_pe, sparse_rows, topk_indices, out, lse) -> None:
    """A DSA layer's sparse requests (``sparse_rows`` [B] bool) over their selected keys, into ``out`` / ``lse``
    (``call``: the step's ``chunk_loop.LayerCall``): each request on the route the cost model picks at the
    layer's dims (``planning.routing.masked_mha_requests``, the plan's ``masked_mha_ratio``), masked MHA here or
    the sparse kernel. Masked MHA runs where the lengths are free to read and the kernels are torch's (CPU,
    eager); elsewhere every request takes the sparse kernel."""
    plan, dims = call.plan, call.dims
    mha = []
    # Traced (torch.compile) or on other kernels: nothing to decide, every request takes the sparse kernel.
    if checks.values_readable(plan.query_start_loc, plan.context_lens, sparse_rows, topk_indices, call.q) and \
            call.kernels in (OPS, REFERENCE) and plan.options is not None and plan.options.masked_mha_cost_ratio:
        ratio = plan.options.masked_mha_cost_ratio
        qsl, ctx = plan.query_start_loc.tolist(), plan.context_lens.tolist()
        mha = masked_mha_requests(ctx, [b - a for a, b in zip(qsl, qsl[1:])], sparse_rows.tolist(), plan.index_topk,
                                  (dims.latent, dims.nope, dims.rope, dims.value), ratio)
    if mha:
        masked_mha(call.q, kv_c, k_pe, call.kv_cache, plan.block_table, qsl, ctx, mha, topk_indices, call.weight,
                   call.softmax_scale, call.k_scale, out, lse, plan.sliding_window)
        if len(mha) == int(sparse_rows.sum()):
            return
        sparse_rows = sparse_rows.clone()
        sparse_rows[mha] = False
    call.kernels.sparse_attention(call.q, kv_c, k_pe, call.kv_cache, plan.block_table, plan.query_start_loc,
                                  plan.context_lens, sparse_rows, topk_indices, call.weight, call.softmax_scale,
                                  call.k_scale, out, lse, *call.window())
