"""Attention over up-projected MLA keys: the chunk's context partial and the causal suffix partial.

Both ops share one oracle, ``varlen_attention_reference``:

q       [Tq, N, P+R]   queries of n requests, rows cu_q[i]:cu_q[i+1]
k_nope  [Tk, N, P]     per-head key part     k_pe [Tk, R] rotary key part, shared by all heads
v       [Tk, N, V]     values of n requests, rows cu_k[i]:cu_k[i+1]
-> out  [Tq, N, V] float32 (float64 for float64 q), lse [N, Tq] natural log; no keys: 0 / -inf

``causal`` aligns the mask bottom-right: query j of m sees keys ``0 .. s - m + j`` of s.

``context_attention``: context attention of one chunk, folded into the running context partial.

q               [Tq, N, P+R]  queries of the chunk's requests (the chunk's token range)
k_nope          [S, N, P]     up-projected keys of the workspace rows   k_pe [S, R]
v               [S, N, V]     up-projected values of the workspace rows
query_start_loc [n+1] int32   the chunk's query offsets, rebased to 0
cu_seq_lens     [n+1] int32   the chunk's workspace row offsets
starts          [n] int32     context offset of each request's rows in this chunk
out             [Tq, N, V]    running context partial of the chunk's tokens (out=)
lse             [N, Tq]       its LSE, float32 (float64 for float64 q) (out=)

Non-causal: request i's queries see all its rows of the chunk. A request whose rows continue an
earlier chunk (``starts[i] > 0``; in a host schedule only ever the first) merges its partial into
``out``/``lse``; a request starting here overwrites its rows, so they need no initialization. A
request with no rows in the chunk is left untouched: the caller gives requests without context the
empty partial ``0 / -inf`` once, and the same op then serves a schedule over the whole batch (the
device form), where most requests have no rows in a given chunk.

``suffix_attention``: causal attention of the new tokens over their own keys (the suffix partial).

q               [T, N, P+R]   rotated queries of the new tokens
k_nope          [T, N, P]     up-projected keys of the new tokens   k_pe [T, R]
v               [T, N, V]     up-projected values of the new tokens
query_start_loc [B+1] int32   request boundaries (keys share them)
out             [T, N, V]     (out=)
lse             [N, T]        float32 (float64 for float64 q), natural log (out=)
"""

from __future__ import annotations

import torch

from .._mla import KEY_BLOCK, lse_dtype
from .merge import merge_states_reference


def varlen_attention_reference(q, k_nope, k_pe, v, cu_q, cu_k, softmax_scale, causal):
    acc = lse_dtype(q.dtype)
    num_tokens, num_heads = q.shape[0], q.shape[1]
    out = q.new_zeros(num_tokens, num_heads, v.shape[-1], dtype=acc)
    lse = q.new_full((num_heads, num_tokens), float("-inf"), dtype=acc)
    q_bounds, k_bounds = cu_q.tolist(), cu_k.tolist()  # host reads: CPU / oracle path only
    for q0, q1, k0, k1 in zip(q_bounds[:-1], q_bounds[1:], k_bounds[:-1], k_bounds[1:]):
        m, s = q1 - q0, k1 - k0
        if m == 0 or s == 0:
            continue
        qi = q[q0:q1].to(acc) * softmax_scale  # [m, N, P+R]
        q_nope, q_pe = qi.split([k_nope.shape[-1], k_pe.shape[-1]], dim=-1)
        o_i, lse_i = None, None
        for b0 in range(0, s, KEY_BLOCK):
            b1 = min(b0 + KEY_BLOCK, s)
            scores = torch.einsum("mnp,snp->nms", q_nope, k_nope[k0 + b0 : k0 + b1].to(acc))
            scores += torch.einsum("mnr,sr->nms", q_pe, k_pe[k0 + b0 : k0 + b1].to(acc))
            if causal:
                key = torch.arange(b0, b1, device=q.device)
                query = torch.arange(m, device=q.device) + (s - m)
                scores.masked_fill_(key[None, :] > query[:, None], float("-inf"))
            block_lse = torch.logsumexp(scores, dim=-1)  # [N, m]
            probs = torch.exp(scores - block_lse.unsqueeze(-1)).nan_to_num_(0.0)
            block_out = torch.einsum("nms,snv->mnv", probs, v[k0 + b0 : k0 + b1].to(acc))
            if o_i is None:
                o_i, lse_i = block_out, block_lse
            else:
                o_i, lse_i = merge_states_reference(o_i, lse_i, block_out, block_lse)
        out[q0:q1] = o_i
        lse[:, q0:q1] = lse_i
    return out, lse


def context_attention_reference(
    q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, softmax_scale, out, lse
) -> None:
    part_out, part_lse = varlen_attention_reference(
        q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, softmax_scale, causal=False
    )
    bounds, rows = query_start_loc.tolist(), cu_seq_lens.tolist()  # host reads: CPU / oracle path
    for i, start in enumerate(starts.tolist()):
        t0, t1 = bounds[i], bounds[i + 1]
        if rows[i + 1] == rows[i] or t0 == t1:
            continue
        if start > 0:  # continuation: fold into what earlier chunks left
            out[t0:t1], lse[:, t0:t1] = merge_states_reference(
                out[t0:t1], lse[:, t0:t1], part_out[t0:t1], part_lse[:, t0:t1]
            )
        else:
            out[t0:t1] = part_out[t0:t1]
            lse[:, t0:t1] = part_lse[:, t0:t1]


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
) -> None:
    context_attention_reference(
        q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, softmax_scale, out, lse
    )


@_context_attention.register_fake
def _(q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, softmax_scale, out, lse) -> None:
    return None


def suffix_attention_reference(q, k_nope, k_pe, v, query_start_loc, softmax_scale, out, lse) -> None:
    part_out, part_lse = varlen_attention_reference(
        q, k_nope, k_pe, v, query_start_loc, query_start_loc, softmax_scale, causal=True
    )
    out.copy_(part_out)
    lse.copy_(part_lse)


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
) -> None:
    suffix_attention_reference(q, k_nope, k_pe, v, query_start_loc, softmax_scale, out, lse)


@_suffix_attention.register_fake
def _(q, k_nope, k_pe, v, query_start_loc, softmax_scale, out, lse) -> None:
    return None
