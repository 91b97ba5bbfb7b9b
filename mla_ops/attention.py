"""Reference varlen attention over up-projected MLA keys (the oracle of both attention ops).

q       [Tq, N, P+R]   queries of n requests, rows cu_q[i]:cu_q[i+1]
k_nope  [Tk, N, P]     per-head key part     k_pe [Tk, R] rotary key part, shared by all heads
v       [Tk, N, V]     values of n requests, rows cu_k[i]:cu_k[i+1]
-> out  [Tq, N, V] float32 (float64 for float64 q), lse [N, Tq] natural log; no keys: 0 / -inf

``causal`` aligns the mask bottom-right: query j of m sees keys ``0 .. s - m + j`` of s.
"""

from __future__ import annotations

import torch

from .merge import lse_dtype, merge_states_reference

# Keys per block in the reference loop: bounds the score matrix at N x m x KEY_BLOCK.
KEY_BLOCK = 4096


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
