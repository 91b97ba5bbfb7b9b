"""Causal attention of the new tokens over their own keys (the suffix partial), varlen.

q               [T, N, P+R]   rotated queries of the new tokens
k_nope          [T, N, P]     up-projected keys of the new tokens   k_pe [T, R]
v               [T, N, V]     up-projected values of the new tokens
query_start_loc [B+1] int32   request boundaries (keys share them)
out             [T, N, V]     (out=)
lse             [N, T]        float32 (float64 for float64 q), natural log (out=)
"""

from __future__ import annotations

import torch

from .attention import varlen_attention_reference


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
