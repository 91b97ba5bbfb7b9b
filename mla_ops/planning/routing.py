"""Per-request routing of context attention: absorbed (MQA over the latent cache) or chunked MHA.

Per (query, context key, head) the MHA path costs 2*(P+R+V) FLOPs plus, per (context key, head),
2*L*(P+V) for the up-projection; the absorbed path costs 2*(2L+R) per (query, key, head) and no
up-projection, gather or workspace (DESIGN §1). So a request is cheaper absorbed when its query
length q satisfies ``q * (2*(2L+R) - 2*(P+R+V)) < 2*L*(P+V)``: q < ~170 for DeepSeek's dims.

``absorb_max_query_len`` routes requests with ``query_len <= absorb_max_query_len`` (and some
context) to the absorbed path; ``0`` disables it. Its default is the cost model's break-even,
because no GPU measurement has been made yet (``MEASURED_ABSORB_MAX_QUERY_LEN`` stays ``None``
until ``benchmarks/gpu_check.sh`` has run the absorbed-vs-MHA sweep on an H200).
"""

from __future__ import annotations

import numpy as np
import torch

# Filled in from the H200 sweep (benchmarks/results/gpu_absorbed.json) once it has run.
MEASURED_ABSORB_MAX_QUERY_LEN: int | None = None


def cost_model_threshold(latent: int, nope: int, rope: int, value: int) -> int:
    """Largest query length for which the absorbed path needs fewer FLOPs than chunked MHA."""
    per_key_query_extra = 2 * (2 * latent + rope) - 2 * (nope + rope + value)
    if per_key_query_extra <= 0:  # absorbed never costs more per query: always cheaper
        return 2**31 - 1
    return int(2 * latent * (nope + value) // per_key_query_extra)


DEEPSEEK_DIMS = (512, 128, 64, 128)  # (L, P, R, V) of every released DeepSeek-V2/V3 model


def default_threshold(latent: int, nope: int, rope: int, value: int) -> int:
    """``absorb_max_query_len=None`` at these dims: the measured threshold where there is one (DeepSeek's
    dims, once the H200 sweep has run), else the cost model's break-even."""
    if (latent, nope, rope, value) == DEEPSEEK_DIMS and MEASURED_ABSORB_MAX_QUERY_LEN is not None:
        return MEASURED_ABSORB_MAX_QUERY_LEN
    return cost_model_threshold(latent, nope, rope, value)


# What ``absorb_max_query_len=None`` means where the dims are unknown (``plan_prefill`` alone): DeepSeek's
# (170). A model's steps (``Generator``, ``PrefillGraphs``) take ``default_threshold`` at its own dims.
DEFAULT_ABSORB_MAX_QUERY_LEN: int = default_threshold(*DEEPSEEK_DIMS)


def route_context(context_lens, query_lens, absorb_max_query_len: int, max_absorbed_tokens: int | None = None):
    """Split each request's context between the paths: ``(mha_context_lens, absorbed_context_lens)``.

    Works on tensors (device code, no host sync), on lists and on numpy arrays (plan the
    chunked MHA path with ``plan_context_chunks(mha_context_lens, ...)``). Exactly one of the two
    is non-zero for a request with context. ``max_absorbed_tokens``: the absorbed path's static
    token capacity; the first routed requests whose queries fit it take it, later ones stay MHA
    (either path is exact, so the cap only moves work).
    """
    if isinstance(context_lens, torch.Tensor):
        absorbed = (query_lens <= absorb_max_query_len) & (context_lens > 0)
        if max_absorbed_tokens is not None:
            absorbed &= torch.cumsum(torch.where(absorbed, query_lens, 0), 0) <= max_absorbed_tokens
        absorbed_lens = torch.where(absorbed, context_lens, torch.zeros_like(context_lens))
        return context_lens - absorbed_lens, absorbed_lens
    if isinstance(context_lens, list):  # a small batch's host lengths
        absorbed_lens, taken = [], 0
        for c, q in zip(context_lens, query_lens):
            routed = q <= absorb_max_query_len and c > 0
            taken += q if routed else 0
            absorbed_lens.append(c if routed and (max_absorbed_tokens is None or taken <= max_absorbed_tokens) else 0)
        return [c - a for c, a in zip(context_lens, absorbed_lens)], absorbed_lens
    context_lens, query_lens = np.asarray(context_lens), np.asarray(query_lens)
    absorbed = (query_lens <= absorb_max_query_len) & (context_lens > 0)
    if max_absorbed_tokens is not None:
        absorbed &= np.cumsum(np.where(absorbed, query_lens, 0)) <= max_absorbed_tokens
    absorbed_lens = np.where(absorbed, context_lens, 0)
    return context_lens - absorbed_lens, absorbed_lens


# ---- DeepSeek Sparse Attention: absorbed sparse attention or top-k-masked MHA, per request ----------------
#
# A sparse request (c context rows, q new tokens, K_I = index_topk) costs, per head, in FLOPs:
#   absorbed sparse (ops/sparse.py):   q * (2L(P+V) + K_I * 2(2L+R))         fold/unfold + K_I latent keys a query
#   masked MHA (ops/masked_mha.py):    (c+q) * 2L(P+V) + q * (c + q/2) * 2(P+R+V)   up-projection + dense pairs
# The two paths do not run FLOPs equally fast: the sparse path gathers a row per selected key and multiplies
# small matrices, MHA runs large GEMMs. ``masked_mha_ratio`` is how many masked-MHA FLOPs cost what one sparse
# FLOP does on the machine; a request takes masked MHA when its MHA FLOPs < ratio x its sparse FLOPs.

# Measured on this project's 2-core AVX-512 CPU, shared (load average ~15), 2 threads (benchmarks/dsa_route_bench.py,
# benchmarks/results/dsa_route_bench.json): the geometric mean over its configurations of the two routes'
# FLOP-rate ratio at DeepSeek-V3.2's widths (it grows with the sequence, 1.9 at 512 new tokens to 7.3 at 8k context).
MEASURED_MASKED_MHA_RATIO: float = 4.2


def sparse_flops(query_len: int, index_topk: int, latent: int, nope: int, rope: int, value: int) -> int:
    """Per head: the absorbed sparse path's FLOPs for a request of ``query_len`` tokens (K_I keys a query)."""
    return query_len * (2 * latent * (nope + value) + index_topk * 2 * (2 * latent + rope))


def masked_mha_flops(context_len: int, query_len: int, latent: int, nope: int, rope: int, value: int) -> int:
    """Per head: top-k-masked MHA's FLOPs for a request (every key up-projected, the causal dense pairs)."""
    pairs = query_len * context_len + query_len * (query_len + 1) // 2
    return (context_len + query_len) * 2 * latent * (nope + value) + pairs * 2 * (nope + rope + value)


def masked_mha_requests(context_lens: list[int], query_lens: list[int], candidates: list[bool], index_topk: int,
                        dims: tuple[int, int, int, int], ratio: float) -> list[int]:
    """The requests among ``candidates`` (host lists, [B]) that take top-k-masked MHA: those whose MHA FLOPs
    are under ``ratio`` x their sparse FLOPs at ``dims`` = (L, P, R, V). ``ratio`` 0: none; inf: all."""
    return [r for r, (c, q, ok) in enumerate(zip(context_lens, query_lens, candidates))
            if ok and q and masked_mha_flops(c, q, *dims) < ratio * sparse_flops(q, index_topk, *dims)]
