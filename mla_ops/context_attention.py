"""Context attention of one chunk, folded into the running context partial.

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
"""

from __future__ import annotations

import torch

from .attention import varlen_attention_reference
from .merge import merge_states_reference


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
