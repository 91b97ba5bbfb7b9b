"""DSA test helpers: random top-k selections and the masked dense float64 oracle (DESIGN §12), written
from the design (independently of mla_ops/ops/sparse.py).

    topk_indices [T, K] int32: per token, positions in its request's sequence (0 .. c_r + j), -1 pads
    masked_reference(batch, topk, sparse) -> out [T, N, V], lse [N, T] float64 for the sparse tokens
"""

import math

import torch

from tests.support.batches import _dims, _request_keys


def random_topk(context_lens, query_lens, k, *, seed, sparse=None, shuffle=True, future=False, empty=0.1):
    """[T, k] int32: for each token of a request with ``sparse[r]`` (default: every request) a random
    subset of its candidates ``0 .. c_r + j`` (at most k of them, sometimes none, often all of a short
    sequence), padded with -1; ``shuffle`` mixes the padding in (else valid positions first),
    ``future`` puts positions past the token's own (up to c_r + q_r - 1) into some padding slots.
    Other tokens' rows hold arbitrary positions of their request."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for r, (c, q) in enumerate(zip(context_lens, query_lens)):
        for j in range(q):
            n = c + j + 1
            if sparse is not None and not sparse[r]:
                rows.append(torch.randint(-1, c + q, (k,), generator=g))
                continue
            draw = float(torch.rand((), generator=g))
            size = 0 if draw < empty else min(k, n) if draw < 0.3 else int(torch.randint(1, min(k, n) + 1, (),
                                                                                         generator=g))
            row = torch.full((k,), -1, dtype=torch.int64)
            row[:size] = torch.randperm(n, generator=g)[:size]
            if future and c + q > n and size < k:
                spare = k - size
                later = torch.randint(n, c + q, (spare,), generator=g)
                row[size:] = torch.where(torch.rand(spare, generator=g) < 0.5, later, -1)
            if shuffle:
                row = row[torch.randperm(k, generator=g)]
            rows.append(row)
    return torch.stack(rows).to(torch.int32) if rows else torch.zeros(0, k, dtype=torch.int32)


def masked_reference(batch, topk, sparse, k_scale=None, *, sliding_window=None, sinks=None):
    """float64 ``(out [T, N, V], lse [N, T], rows [T] bool)``: per token of a sparse request, MHA attention
    over all its c_r + j + 1 keys (up-projected, DESIGN §1) with the keys outside its selection masked;
    ``rows`` marks those tokens (other rows are 0 / -inf here). DESIGN §11: ``sliding_window`` w also masks
    the keys before position c_r + j - w + 1; ``sinks`` [N] appends one more score per head (no value)."""
    q, kv_c, k_pe, cache = batch.q, batch.kv_c, batch.k_pe, batch.kv_cache
    N, L, P, R, V = _dims(q, k_pe, cache, batch.kv_b_proj_weight)
    qsl, ctx = batch.query_start_loc.tolist(), batch.context_lens.tolist()
    w = batch.kv_b_proj_weight.double()
    k_scale = batch.k_scale if k_scale is None else k_scale
    out = torch.zeros(q.shape[0], N, V, dtype=torch.float64)
    lse = torch.full((N, q.shape[0]), -math.inf, dtype=torch.float64)
    rows = torch.zeros(q.shape[0], dtype=torch.bool)
    for r, c in enumerate(ctx):
        s, e = qsl[r], qsl[r + 1]
        if e == s or not bool(sparse[r]):
            continue
        latent, rope, qr = _request_keys(r, q, kv_c, k_pe, cache, batch.block_table, qsl, ctx, k_scale)
        kv = (latent @ w.T).view(-1, N, P + V)  # [S, N, P+V]
        k = torch.cat([kv[..., :P], rope[:, None, :].expand(-1, N, R)], dim=-1)
        scores = torch.einsum("qnd,knd->nqk", qr, k) * batch.softmax_scale  # [N, q_r, S]
        for j in range(e - s):
            t = s + j
            rows[t] = True
            chosen = torch.zeros(c + j + 1, dtype=torch.bool)
            picks = topk[t].long()
            picks = picks[(picks >= 0) & (picks <= c + j)]
            chosen[picks] = True
            if sliding_window is not None:
                chosen[: max(0, c + j - sliding_window + 1)] = False
            sc = scores[:, j, : c + j + 1].masked_fill(~chosen, -math.inf)
            if sinks is not None:  # one more score, no value
                sc = torch.cat([sc, sinks.double()[:, None]], dim=-1)
            elif not chosen.any():
                continue
            lse[:, t] = torch.logsumexp(sc, -1)
            probs = torch.softmax(sc, -1)[:, : c + j + 1]
            out[t] = torch.einsum("nk,knv->nv", probs, kv[: c + j + 1, :, P:])
    return out, lse, rows
