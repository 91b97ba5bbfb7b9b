"""Modeled work of context attention (DESIGN §1 cost model): FLOPs and bytes, no measurement.

Per context row and head the MHA path up-projects (2*L*(P+V) FLOPs) and attends (2*(P+R+V) per
query); the absorbed path attends over the latent rows (2*(2L+R) per query) and up-projects nothing.
"""

from __future__ import annotations

import numpy as np

from .batches import Dims


def modeled_flops(context_lens, query_lens, heads: int, latent: int, nope: int, rope: int, value: int,
                  absorb_max_query_len: int) -> dict:
    """Context-attention FLOPs of a batch, all-MHA versus routed by ``absorb_max_query_len``, and the
    context rows each path takes."""
    c = np.asarray(context_lens, dtype=np.float64)
    q = np.asarray(query_lens, dtype=np.float64)
    mha = heads * (c * 2 * latent * (nope + value) + q * c * 2 * (nope + rope + value))
    absorbed = heads * q * c * 2 * (2 * latent + rope)
    routed = q <= absorb_max_query_len
    return {
        "mha_only": float(mha.sum()),
        "routed": float(np.where(routed, absorbed, mha).sum()),
        "absorbed_context_tokens": int(c[routed].sum()),
        "mha_context_tokens": int(c[~routed].sum()),
    }


def pipeline_cost(context_lens, query_lens, dims: Dims, dtype_bytes: int) -> tuple[int, int]:
    """(FLOPs, bytes) of the chunked MHA context pipeline (``pipeline.context_pipeline``) on a batch.

    Bytes: cache rows read, workspace written and read, K/V written and read, queries and partials."""
    N, L, P, R, V = dims
    rows = sum(context_lens)
    flops = 2 * L * (P + V) * N * rows
    flops += 2 * (P + R + V) * N * sum(c * q for c, q in zip(context_lens, query_lens))
    row_bytes = (3 * (L + R) + 2 * N * (P + V)) * dtype_bytes
    token_bytes = N * (P + R + 2 * V) * dtype_bytes
    return flops, rows * row_bytes + sum(query_lens) * token_bytes
