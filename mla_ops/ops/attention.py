"""Attention over up-projected MLA keys: the chunk's context partial and the causal suffix partial.

Both ops share one oracle, ``varlen_attention_reference``: one softmax per request, slow and
obvious, exact in float64 (the Triton kernels and the CPU path are checked against it; it is
``backend="torch"`` on a GPU). On CPU the ops run the batched engine of ``ops/cpu_attention.py``.

q       [Tq, N, P+R]   queries of n requests, rows cu_q[i]:cu_q[i+1]
k_nope  [Tk, N, P]     per-head key part     k_pe [Tk, R] rotary key part, shared by all heads
v       [Tk, N, V]     values of n requests, rows cu_k[i]:cu_k[i+1]
-> out  [Tq, N, V] float32 (float64 for float64 q), lse [N, Tq] natural log; no keys: 0 / -inf; a
   query with a non-finite score among those it sees (a NaN or inf input, an overflow): NaN, out and lse

``causal`` aligns the mask bottom-right: query j of m sees keys ``0 .. s - m + j`` of s.

A sliding window (DESIGN §11; ``sliding_window`` w > 0, 0: none): a query at position ``c_r + j`` sees only keys
at positions ``c_r + j - w + 1 ..``. Where a query sees no key of a call it gets the empty partial ``0 / -inf``.

``context_attention``: context attention of one chunk, folded into the running context partial.

q               [Tq, N, P+R]  queries of the chunk's requests (the chunk's token range)
k_nope          [S, N, P]     up-projected keys of the workspace rows   k_pe [S, R]
v               [S, N, V]     up-projected values of the workspace rows
query_start_loc [n+1] int32   the chunk's query offsets, rebased to 0
cu_seq_lens     [n+1] int32   the chunk's workspace row offsets
starts          [n] int32     context offset of each request's rows in this chunk
out             [Tq, N, V]    running context partial of the chunk's tokens (out=)
lse             [N, Tq]       its LSE, float32 (float64 for float64 q) (out=)
context_lens    [n] int32     (a sliding window only) each request's context length c_i
sliding_window  int           w; 0: none

Non-causal: request i's queries see all its rows of the chunk. A request whose rows continue an
earlier chunk (``starts[i] > 0``; in a host schedule only ever the first) merges its partial into
``out``/``lse``; a request starting here overwrites its rows, so they need no initialization. A
request with no rows in the chunk is left untouched: the caller gives requests without context the
empty partial ``0 / -inf`` once, and the same op then serves a schedule over the whole batch (the
device form), where most requests have no rows in a given chunk.

With a sliding window, row k of request i is context position ``starts[i] + k`` (a windowed plan reads a request's
context from its window's first position ``max(0, c_i - w + 1)`` on), query j (position ``c_i + j``) sees it iff
``starts[i] + k >= c_i + j - w + 1``, and a request continues an earlier chunk iff ``starts[i]`` is past its
window's first position.

``suffix_attention``: causal attention of the new tokens over their own keys (the suffix partial).

q               [T, N, P+R]   rotated queries of the new tokens
k_nope          [T, N, P]     up-projected keys of the new tokens   k_pe [T, R]
v               [T, N, V]     up-projected values of the new tokens
query_start_loc [B+1] int32   request boundaries (keys share them)
out             [T, N, V]     (out=)
lse             [N, T]        float32 (float64 for float64 q), natural log (out=)
sliding_window  int           w: query j sees its request's new keys ``j - w + 1 .. j``; 0: ``0 .. j``
"""

from __future__ import annotations

import torch

from .._mla import lse_dtype
from . import cpu_attention
from .cpu_attention import window_starts
from .merge import merge_states_reference, poisoned_rows, scores_nan_for_neg_inf_


def varlen_attention_reference(q, k_nope, k_pe, v, cu_q, cu_k, softmax_scale, causal, window_offsets=None):
    """The oracle: request i's queries ``cu_q[i]:cu_q[i+1]`` over its keys ``cu_k[i]:cu_k[i+1]``, one
    softmax each, in float32 (float64 for float64 q) -> ``(out, lse)``. Memory: N x m x s scores of
    one request at a time (a checking tool, not a long-context engine). ``window_offsets`` (a sliding
    window): per request d_i, its query j sees only keys k >= j - d_i."""
    acc = lse_dtype(q.dtype)
    num_heads = q.shape[1]
    out = q.new_zeros(q.shape[0], num_heads, v.shape[-1], dtype=acc)
    lse = q.new_full((num_heads, q.shape[0]), float("-inf"), dtype=acc)
    q_bounds, k_bounds = cu_q.tolist(), cu_k.tolist()  # host reads
    for i, (t0, t1, s0, s1) in enumerate(zip(q_bounds, q_bounds[1:], k_bounds, k_bounds[1:])):
        if t1 == t0 or s1 == s0:
            continue
        k = torch.cat([k_nope[s0:s1], k_pe[s0:s1, None, :].expand(-1, num_heads, -1)], dim=-1)  # [s, N, P+R]
        scores = torch.einsum("mnd,snd->nms", q[t0:t1].to(acc), k.to(acc)) * softmax_scale  # [N, m, s]
        scores_nan_for_neg_inf_(scores)
        empty = None
        if causal:  # bottom-right
            m, s = t1 - t0, s1 - s0
            hidden = torch.arange(s, device=q.device) > torch.arange(m, device=q.device)[:, None] + (s - m)
            scores.masked_fill_(hidden, float("-inf"))
            empty = hidden.all(-1)  # [m]: queries that see no key
        if window_offsets is not None:  # a sliding window: keys before j - d_i are out of it
            below = torch.arange(s1 - s0, device=q.device) < torch.arange(t1 - t0, device=q.device)[:, None] - \
                window_offsets[i]
            scores.masked_fill_(below, float("-inf"))
            empty = below.all(-1) if empty is None else empty | (below | hidden).all(-1)
        part_lse = torch.logsumexp(scores, dim=-1)
        bad = poisoned_rows(part_lse, empty)  # a non-finite score: NaN out and lse
        probs = torch.softmax(scores, dim=-1).masked_fill_(bad.unsqueeze(-1), float("nan"))
        if empty is not None:
            probs.masked_fill_(empty[:, None], 0.0)  # a query that sees no key: the empty partial
        lse[:, t0:t1] = part_lse.masked_fill_(bad, float("nan"))
        out[t0:t1] = torch.einsum("nms,snv->mnv", probs, v[s0:s1].to(acc))
    return out, lse


def context_attention_reference(
    q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, softmax_scale, out, lse, context_lens=None,
    sliding_window=0,
) -> None:
    """The oracle of ``context_attention``: each request's partial over its rows of the chunk, merged
    into ``out``/``lse`` if it continues an earlier chunk, else written; requests without rows untouched."""
    first, offsets = window_starts(starts, context_lens, sliding_window)
    part_out, part_lse = varlen_attention_reference(q, k_nope, k_pe, v, query_start_loc, cu_seq_lens,
                                                    softmax_scale, causal=False, window_offsets=offsets)
    q_bounds, k_bounds = query_start_loc.tolist(), cu_seq_lens.tolist()  # host reads
    for r, start in enumerate(starts.tolist()):
        t0, t1 = q_bounds[r], q_bounds[r + 1]
        if k_bounds[r + 1] == k_bounds[r]:
            continue
        new_out, new_lse = part_out[t0:t1], part_lse[:, t0:t1]
        if start > first[r]:
            new_out, new_lse = merge_states_reference(out[t0:t1], lse[:, t0:t1], new_out, new_lse)
        out[t0:t1], lse[:, t0:t1] = new_out.to(out.dtype), new_lse.to(lse.dtype)


def suffix_attention_reference(q, k_nope, k_pe, v, query_start_loc, softmax_scale, out, lse,
                               sliding_window=0) -> None:
    """The oracle of ``suffix_attention``: causal per request; tokens without keys get 0 / -inf."""
    offsets = [sliding_window - 1] * (query_start_loc.shape[0] - 1) if sliding_window else None
    part_out, part_lse = varlen_attention_reference(q, k_nope, k_pe, v, query_start_loc, query_start_loc,
                                                    softmax_scale, causal=True, window_offsets=offsets)
    out.copy_(part_out)
    lse.copy_(part_lse)


@torch.library.custom_op("mla_ops::context_attention", mutates_args=("out", "lse"))
def _context_attention(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    starts: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    context_lens: torch.Tensor | None = None,
    sliding_window: int = 0,
) -> None:
    cpu_attention.context_attention(q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, softmax_scale, out, lse,
                                    context_lens, sliding_window)


@_context_attention.register_fake
def _(q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, softmax_scale, out, lse, context_lens=None,
      sliding_window=0) -> None:
    return None


@torch.library.custom_op("mla_ops::suffix_attention", mutates_args=("out", "lse"))
def _suffix_attention(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    sliding_window: int = 0,
) -> None:
    cpu_attention.suffix_attention(q, k_nope, k_pe, v, query_start_loc, softmax_scale, out, lse, sliding_window)


@_suffix_attention.register_fake
def _(q, k_nope, k_pe, v, query_start_loc, softmax_scale, out, lse, sliding_window=0) -> None:
    return None
