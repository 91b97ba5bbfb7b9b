"""The lightning indexer's top-k (DeepSeek Sparse Attention, DESIGN §12): the keys each query may see.

q_index        [T, H_I, D_I]  the step's index queries (rotated), fp16/bf16/fp32/fp64
index_weights  [T, H_I]       float32 or the queries' dtype, the model's constants folded in
k_index        [T, D_I]       the step's new index keys, dtype of q_index
index_cache    [num_blocks, block_size, D_I]  paged index keys of the context (the latent cache's
                              block table and block size), dtype of q_index or float8_e4m3fn
k_scale        [1] float32 or None   fp8 caches: dequantized = stored * k_scale
the plan's IndexSchedule: starts [C, B], cu_seq_lens [C, B+1], token_start / token_end [C] int32
                              (sparse tokens); rows W and tokens M (static ints); piece_shapes
                              (host form: each piece's (tokens, rows), passed as two int lists)
scores         [M, W]         one chunk's scores (float32; float64 for float64 queries); the host
                              form's piece i: [piece_tokens[i], piece_rows[i]]
-> topk        [T, K] int32   positions in the request's sequence, valid ones first, then -1; a row of
                              NO_FINITE_SELECTION (-2) where the token's scores are not finite

Query token t of request r at position ``c_r + j`` scores the candidates ``s = 0 .. c_r + j``:
``I(t, s) = sum_h w[t, h] * relu(q[t, h] . key[s])``, where ``key[s]`` is the index cache row of
context position ``s < c_r`` (``block_table[r, s // block_size]``, ``s % block_size``) and
``k_index[query_start_loc[r] + s - c_r]`` for ``s >= c_r``; its row holds the K best. A dense-routed
request (``plan.sparse[r]`` False: at most K keys) gets every candidate ``0 .. c_r + j`` unscored;
tokens past ``query_start_loc[-1]`` (padding) get -1 only.

Non-finite scores: a NaN or inf in a sparse token's index query or weights, or in the key of one of its
candidates (or a product that overflows), leaves its ranking undefined. Its row is then all
``NO_FINITE_SELECTION`` (-2), which ``sparse_attention`` turns into a NaN output: never a finite answer
from an undefined selection, and the row format holds (no -1 before valid positions). The scorers write
NaN for a candidate's non-finite score (inf too: -inf marks non-candidates) and the fold flags the token.
A dense-routed request takes every candidate whatever the scores (exact: its selection is all of them).

Scores are never held whole: the plan's index chunks (``mla_ops/planning/index_schedule.py``) each
gather at most W keys (from the cache for context positions, from ``k_index`` for new ones, fp8
dequantized) and score their query tokens (the sparse requests' only: ``slot_tokens`` maps a piece's
sparse tokens to the step's) against them (the torch fold: into one [M, W] buffer, heads one at a time, a
per-head product is [M, W] too); each token keeps the top ``min(K, W)`` of its row and folds
them into the running top-k ``(score, position)`` [T, K]. The fold is associative, ``(-inf, -1)``
its identity (as the LSE merge's ``0 / -inf``), so the chunk order is free. Every chunk is read by
tensor index (no host read of a device value), so the device form's C static chunks run without a
sync and chunks past the count (``token_start == token_end``) fold nothing.

Precision: scores in float32 from the inputs upcast (float64 for float64 queries: the reference is
exact there). Ties in score: the torch fold leaves them to ``torch.topk`` (any of the tied keys may be
picked), the fused kernel keeps the lower position.

Implementations: on CPU the torch scorer and ``torch.topk`` fold below (the oracle); on CUDA the fused
Triton kernel of ``mla_ops/triton/indexer.py`` (``index_topk_fused``: one launch per piece gathers the keys,
decodes fp8, scores and folds each tile into the running top-k as sortable int64 keys, with no scores
buffer; a piece's dead slots exit at once), falling back to the torch fold where Triton is not installed or
for float64.
"""

from __future__ import annotations

from typing import Callable

import torch

from .._checks import FLOAT_DTYPES, check_scale, check_tensor, k_scale_tensor, values_readable
from .._env import triton_available
from .._mla import NO_FINITE_SELECTION
from ..planning.index_schedule import sparse_token_loc
from ..planning.plan import PrefillPlan, current_max_block_id
from .cache_formats import check_index_format, check_per_token_width, index_rows, index_width, per_token_row_bytes

INDEX_CACHE_DTYPES = FLOAT_DTYPES + (torch.float8_e4m3fn,)
# Per-head products (tokens x H_I x rows) the torch scorer holds at once: 64 MiB of float32.
HEAD_PRODUCTS = 1 << 24
INDEX_QUERY_BLOCK = 128  # and the most tokens per block (CPU: a block scores only the rows it may see)


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores (and the running top-k values) are float32, float64 for float64 queries."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _request_of(offsets: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[n] int64: the last request i with ``offsets[i] <= index`` (a row or token's owner), clamped to
    ``0 .. B-1`` for indices past the end (masked by the caller)."""
    found = torch.searchsorted(offsets, index.to(offsets.dtype), right=True) - 1
    return found.clamp(0, offsets.shape[0] - 2)


def chunk_rows(starts: torch.Tensor, cu_seq_lens: torch.Tensor, rows: int):
    """One chunk's W rows (``starts`` [B], ``cu_seq_lens`` [B+1]): ``(request, position, live)`` [W]
    each, int64 / int64 / bool; rows past ``cu_seq_lens[-1]`` are dead, at position 0 of request 0."""
    w = torch.arange(rows, device=starts.device)
    live = w < cu_seq_lens[-1]
    request = torch.where(live, _request_of(cu_seq_lens, w), 0)
    offset = w - cu_seq_lens.long().index_select(0, request)
    position = torch.where(live, starts.long().index_select(0, request) + offset, 0)
    return request, position, live


def chunk_tokens(query_start_loc, context_lens, slot_token, num_tokens: int):
    """One chunk's token slots (``slot_token`` [M], a token each, ``num_tokens`` or more for a dead slot):
    ``(token, request, position, live)`` [M] each; dead slots point at token 0 of request 0."""
    live = slot_token < num_tokens
    t = torch.where(live, slot_token, 0)
    request = torch.where(live, _request_of(query_start_loc, t), 0)
    position = context_lens.long().index_select(0, request) + t - query_start_loc.long().index_select(0, request)
    return t, request, position, live


def slot_tokens(query_start_loc, token_loc, token_start, token_end, tokens: int, num_tokens: int) -> torch.Tensor:
    """[M] int64: the step's token of each of a piece's slots (``token_start`` / ``token_end`` [1] count sparse
    tokens, ``token_loc`` [B+1] their requests' offsets: ``planning.index_schedule.sparse_token_loc``);
    ``num_tokens`` for a dead slot."""
    sparse_token = token_start.long() + torch.arange(tokens, device=token_start.device)
    live = sparse_token < token_end
    request = _request_of(token_loc, sparse_token)
    token = sparse_token - token_loc.index_select(0, request) + query_start_loc.long().index_select(0, request)
    return torch.where(live & (token < num_tokens), token, num_tokens)


def chunk_keys(index_cache, k_index, block_table, query_start_loc, context_lens, k_scale, request, position, live,
               dtype: torch.dtype) -> torch.Tensor:
    """[W, D_I] ``dtype``: the keys of a chunk's rows (``chunk_rows``), dead rows zero."""
    ctx = context_lens.long().index_select(0, request)
    in_context = live & (position < ctx)
    num_tokens, width = k_index.shape
    token = torch.where(live & ~in_context, query_start_loc.long().index_select(0, request) + position - ctx, 0)
    keys = k_index.index_select(0, token.clamp(0, num_tokens - 1)).to(dtype)
    if index_cache.shape[0] and index_cache.shape[1] and block_table.shape[1]:
        block_size = index_cache.shape[1]
        col = torch.where(in_context, position // block_size, 0)
        block = torch.where(in_context, block_table[request, col].long(), 0)  # pad columns may hold anything
        offset = torch.where(in_context, position % block_size, 0)
        cached = index_rows(index_cache, block, offset, k_scale, dtype)
        keys = torch.where(in_context.unsqueeze(1), cached, keys)
    return keys


def chunk_scores_reference(q_index, index_weights, k_index, index_cache, block_table, query_start_loc, context_lens,
                           starts, cu_seq_lens, slot_token, k_scale, scores) -> None:
    """One chunk's masked scores into ``scores`` [M, W] (out=): ``starts`` [B], ``cu_seq_lens`` [B+1],
    ``slot_token`` [M] (``slot_tokens``); -inf where a row is not a candidate of the slot's token (another
    request, past its position, a dead row or slot); NaN where a candidate's score is not finite."""
    rows = scores.shape[1]
    dtype = scores.dtype
    request, position, live = chunk_rows(starts, cu_seq_lens, rows)
    keys = chunk_keys(index_cache, k_index, block_table, query_start_loc, context_lens, k_scale, request, position,
                      live, dtype)
    t, t_request, t_position, t_live = chunk_tokens(query_start_loc, context_lens, slot_token, q_index.shape[0])
    q = q_index.index_select(0, t).to(dtype)  # [M, H_I, D_I]
    w = index_weights.index_select(0, t).to(dtype)  # [M, H_I]
    # Every head's products of a block of tokens in one GEMM, [m, H_I, rows] (bounded by HEAD_PRODUCTS), then the
    # weighted sum over heads as a batched [1, H_I] x [H_I, rows] product per token. Where the lengths are free to
    # read (CPU), a block scores only the rows its tokens may see (from its first request's first row to its last
    # candidate): causally, most of the upper triangle is skipped. The rest is masked below, never read.
    heads = q.shape[1]
    block = max(1, min(INDEX_QUERY_BLOCK, HEAD_PRODUCTS // max(heads * rows, 1)))
    spans = None
    if values_readable(cu_seq_lens, starts, slot_token) and q.shape[0] > block:
        first = cu_seq_lens.long().index_select(0, t_request)  # [M] each token's request's first row
        seen = (t_position - starts.long().index_select(0, t_request) + 1).clamp(min=0)
        last = torch.minimum(first + seen, cu_seq_lens.long().index_select(0, t_request + 1))
        spans = torch.stack([torch.where(t_live, first, rows), torch.where(t_live, last, 0)])  # [2, M]
    for a in range(0, q.shape[0], block):
        lo, hi = (0, rows) if spans is None else (int(spans[0, a:a + block].min()), int(spans[1, a:a + block].max()))
        if hi <= lo:
            continue  # no live candidate in this block: all masked
        products = torch.matmul(q[a:a + block], keys[lo:hi].T).clamp_min_(0)  # [m, H_I, hi - lo]
        scores[a:a + block, lo:hi] = torch.bmm(w[a:a + block].unsqueeze(1), products).squeeze(1)
    candidate = (t_live.unsqueeze(1) & live.unsqueeze(0) & (t_request.unsqueeze(1) == request.unsqueeze(0))
                 & (position.unsqueeze(0) <= t_position.unsqueeze(1)))
    # NaN where a candidate's score is not finite (an inf would pass for a rank, or -inf for the mask); -inf where
    # the row is not a candidate, whatever the tile held there.
    nan = float("nan")
    scores.nan_to_num_(nan=nan, posinf=nan, neginf=nan).masked_fill_(~candidate, float("-inf"))


ChunkScorer = Callable[..., None]  # chunk_scores_reference's signature


def index_pieces(query_start_loc, sparse, token_start, token_end, num_pieces: int, rows: int, tokens: int,
                 piece_tokens: list[int], piece_rows: list[int], num_tokens: int):
    """The op's pieces in order: ``(i, slot_token [M] (slot_tokens), M, W)``, piece i's scores tile
    ``[piece_tokens[i], piece_rows[i]]`` (the host form's), or ``[tokens, rows]`` where the lists are empty (the
    device form's ``num_pieces``); a piece never has more tokens than the step."""
    shapes = [(min(m, num_tokens), w) for m, w in zip(piece_tokens, piece_rows)] or \
        [(min(tokens, num_tokens), rows)] * num_pieces
    token_loc = sparse_token_loc(query_start_loc, sparse)
    for i, (slots, width) in enumerate(shapes):
        yield i, slot_tokens(query_start_loc, token_loc, token_start.narrow(0, i, 1), token_end.narrow(0, i, 1),
                             slots, num_tokens), slots, width


def selected_rows(found, not_finite, query_start_loc, context_lens, sparse, out) -> torch.Tensor:
    """Fills ``out`` [T, K] int32 from the sparse tokens' folded ``found`` [T, K] positions (-1 past the
    candidates) and ``not_finite`` [T] bool: a row of -2 for a flagged token, every candidate ``0 .. c_r + j``
    for a dense-routed request's, -1 for padding (the module doc)."""
    num_tokens, topk = out.shape
    device = out.device
    token = torch.arange(num_tokens, device=device)
    live = token < query_start_loc[-1]
    request = _request_of(query_start_loc, token)
    position = context_lens.long().index_select(0, request) + token - query_start_loc.long().index_select(0, request)
    candidate = torch.arange(topk, device=device)
    dense = torch.where(candidate.unsqueeze(0) <= position.unsqueeze(1), candidate, -1)
    chosen = torch.where(not_finite.unsqueeze(1), NO_FINITE_SELECTION, found)
    chosen = torch.where(sparse.index_select(0, request).unsqueeze(1), chosen, dense)
    out.copy_(torch.where(live.unsqueeze(1), chosen, -1))
    return out


def index_topk_chunked(score_chunk: ChunkScorer, q_index, index_weights, k_index, index_cache, block_table,
                       query_start_loc, context_lens, sparse, starts, cu_seq_lens, token_start, token_end, k_scale,
                       topk: int, rows: int, tokens: int, piece_tokens: list[int],
                       piece_rows: list[int]) -> torch.Tensor:
    """The op (module doc) with ``score_chunk`` scoring each piece (``index_pieces``) into a scores tile that
    ``torch.topk`` folds into the running top-k."""
    num_tokens, num_requests = q_index.shape[0], context_lens.shape[0]
    device = q_index.device
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=device)
    if num_tokens == 0 or num_requests == 0:
        return out
    dtype = score_dtype(q_index.dtype)
    pieces = list(index_pieces(query_start_loc, sparse, token_start, token_end, starts.shape[0], rows, tokens,
                               piece_tokens, piece_rows, num_tokens))
    # Running top-k; row T is a scratch row that dead token slots read and write (no masked scatter).
    best = torch.full((num_tokens + 1, topk), float("-inf"), dtype=dtype, device=device)
    best_pos = torch.full((num_tokens + 1, topk), -1, dtype=torch.int64, device=device)
    not_finite = torch.zeros(num_tokens + 1, dtype=torch.bool, device=device)  # a NaN score seen (module doc)
    tiles = torch.empty(max((m * w for _, _, m, w in pieces), default=0), dtype=dtype, device=device)
    for i, t, slots, width in pieces:
        scores = tiles.narrow(0, 0, slots * width).view(slots, width)
        score_chunk(q_index, index_weights, k_index, index_cache, block_table, query_start_loc, context_lens,
                    starts[i], cu_seq_lens[i], t, k_scale, scores)
        _, position, _ = chunk_rows(starts[i], cu_seq_lens[i], width)
        value, index = scores.topk(min(topk, width), dim=1)  # [M, kept]
        found = torch.where(value > float("-inf"), position[index], -1)
        not_finite.index_copy_(0, t, not_finite.index_select(0, t) | scores.isnan().any(1))
        if i == 0:  # nothing to merge with yet (the running top-k is the identity): the piece's own, padded
            kept = value.shape[1]
            best.index_copy_(0, t, torch.nn.functional.pad(value, (0, topk - kept), value=float("-inf")))
            best_pos.index_copy_(0, t, torch.nn.functional.pad(found, (0, topk - kept), value=-1))
            continue
        merged = torch.cat([best.index_select(0, t), value], 1)
        merged_pos = torch.cat([best_pos.index_select(0, t), found], 1)
        value, index = merged.topk(topk, dim=1)
        best.index_copy_(0, t, value)
        best_pos.index_copy_(0, t, merged_pos.gather(1, index))
    return selected_rows(best_pos[:num_tokens], not_finite[:num_tokens], query_start_loc, context_lens, sparse, out)


def index_topk_fused(q_index, index_weights, k_index, index_cache, block_table, query_start_loc, context_lens,
                     sparse, starts, cu_seq_lens, token_start, token_end, k_scale, topk: int, rows: int, tokens: int,
                     piece_tokens: list[int], piece_rows: list[int]) -> torch.Tensor:
    """The op (module doc) on the fused Triton kernel (``mla_ops/triton/indexer.py``): each piece scored and
    folded into the running top-k keys in one launch, no scores buffer; float16/bfloat16/float32 queries."""
    from ..triton.indexer import fold_piece_topk, key_positions, running_keys

    num_tokens, num_requests = q_index.shape[0], context_lens.shape[0]
    device = q_index.device
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=device)
    if num_tokens == 0 or num_requests == 0:
        return out
    best = running_keys(num_tokens, topk, device)
    not_finite = torch.zeros(num_tokens, dtype=torch.int32, device=device)
    for i, t, _, _ in index_pieces(query_start_loc, sparse, token_start, token_end, starts.shape[0], rows, tokens,
                                   piece_tokens, piece_rows, num_tokens):
        fold_piece_topk(q_index, index_weights, k_index, index_cache, block_table, query_start_loc, context_lens,
                        starts[i], cu_seq_lens[i], t, k_scale, best, not_finite)
    return selected_rows(key_positions(best, topk), not_finite.bool(), query_start_loc, context_lens, sparse, out)


def index_topk_reference(*args) -> torch.Tensor:
    """The op on the torch scorer (the oracle; any device)."""
    return index_topk_chunked(chunk_scores_reference, *args)


@torch.library.custom_op("mla_ops::index_topk", mutates_args=())
def _index_topk(
    q_index: torch.Tensor,
    index_weights: torch.Tensor,
    k_index: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    sparse: torch.Tensor,
    starts: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    token_start: torch.Tensor,
    token_end: torch.Tensor,
    k_scale: torch.Tensor | None,
    topk: int,
    rows: int,
    tokens: int,
    piece_tokens: list[int],
    piece_rows: list[int],
) -> torch.Tensor:
    return index_topk_reference(q_index, index_weights, k_index, index_cache, block_table, query_start_loc,
                                context_lens, sparse, starts, cu_seq_lens, token_start, token_end, k_scale, topk,
                                rows, tokens, piece_tokens, piece_rows)


@_index_topk.register_fake
def _(q_index, index_weights, k_index, index_cache, block_table, query_start_loc, context_lens, sparse, starts,
      cu_seq_lens, token_start, token_end, k_scale, topk, rows, tokens, piece_tokens, piece_rows):
    return q_index.new_empty((q_index.shape[0], topk), dtype=torch.int32)


def _index_topk_cuda(q_index, *args) -> torch.Tensor:
    """The op's CUDA kernel: the fused Triton score + top-k, else the torch fold (float64, no Triton)."""
    if not triton_available() or q_index.dtype == torch.float64:
        return index_topk_reference(q_index, *args)
    return index_topk_fused(q_index, *args)


torch.library.register_kernel("mla_ops::index_topk", "cuda", _index_topk_cuda)

_index_topk_op = torch.ops.mla_ops.index_topk.default


def check_index_topk(q_index, index_weights, k_index, index_cache, plan, k_scale_index,
                     index_cache_format: str = "auto") -> None:
    """Every check of an ``index_topk`` call, on shapes and host values only (before anything runs)."""
    check_index_step(plan, index_cache, k_scale_index, index_cache_format)
    check_index_layer(q_index, index_weights, k_index, index_cache, plan, index_cache_format)
    if index_cache_format == "auto" and index_cache.dtype == torch.float8_e4m3fn and k_scale_index is None:
        raise ValueError("k_scale_index is required for a float8_e4m3fn index_cache "
                         "(dequantized = stored * k_scale_index)")


def check_index_step(plan, index_cache, k_scale_index, index_cache_format: str = "auto") -> None:
    """What an index cache must be for a step's plan, the same for every layer: checked once a step
    (``begin_step``, or each ``index_topk`` call). Reads the block table's largest id where readable."""
    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan must be a PrefillPlan (mla_ops.plan_prefill), got {type(plan).__name__}")
    if not plan.index_topk or plan.index_schedule is None or plan.sparse is None:
        raise ValueError("plan was made without index_topk: plan the step with plan_prefill(..., index_topk=K)")
    if plan.context_parallel is not None:
        raise ValueError("plan is a context-parallel plan: the indexer takes a single-device plan")
    device = plan.device
    check_tensor(index_cache, "index_cache", 3, "[num_blocks, block_size, D_I]", device, "plan (its block table)")
    check_index_format(index_cache_format, index_cache)
    if index_cache.shape[1] != plan.block_size:
        raise ValueError(f"index_cache has block_size {index_cache.shape[1]}, but plan was made for block_size "
                         f"{plan.block_size} (the index cache shares the latent cache's block table)")
    max_block_id = current_max_block_id(plan)
    if max_block_id >= index_cache.shape[0]:
        raise ValueError(f"plan's block table uses block {max_block_id}, past the {index_cache.shape[0]} blocks "
                         "of index_cache")
    if index_cache_format != "auto":
        if k_scale_index is not None:
            raise ValueError(f"k_scale_index is for a per-tensor float8_e4m3fn index_cache: {index_cache_format} "
                             "stores its own scales (pass None)")
    elif k_scale_index is not None:  # required by the call that reads a float8 cache (a step's layer may pass its own)
        check_scale(k_scale_index, "k_scale_index", device)


def check_index_layer(q_index, index_weights, k_index, index_cache, plan, index_cache_format: str = "auto") -> None:
    """One layer's indexer tensors against each other, its index cache and the plan: shapes and dtypes."""
    device = plan.device
    check_tensor(q_index, "q_index", 3, "[T, H_I, D_I]", device, "plan (its block table)")
    check_tensor(index_weights, "index_weights", 2, "[T, H_I]", device, "plan (its block table)")
    check_tensor(k_index, "k_index", 2, "[T, D_I]", device, "plan (its block table)")
    check_tensor(index_cache, "index_cache", 3, "[num_blocks, block_size, D_I]", device, "plan (its block table)")
    dtype = q_index.dtype
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"q_index must be float16, bfloat16, float32 or float64, got {dtype}")
    if index_weights.dtype not in (torch.float32, dtype):
        raise TypeError(f"index_weights must be float32 or the dtype of q_index ({dtype}), got {index_weights.dtype}")
    if k_index.dtype != dtype:
        raise TypeError(f"k_index must have the dtype of q_index ({dtype}), got {k_index.dtype}")
    packed = index_cache_format == "fp8_per_token"
    if packed != (index_cache.dtype == torch.uint8):
        check_index_format(index_cache_format, index_cache)
    if not packed and index_cache.dtype not in (dtype, torch.float8_e4m3fn):
        raise TypeError(f"index_cache must have the dtype of q_index ({dtype}) or be float8_e4m3fn, "
                        f"got {index_cache.dtype}")
    num_tokens, heads, width = q_index.shape
    if tuple(index_weights.shape) != (num_tokens, heads):
        raise ValueError(f"index_weights must be [T, H_I] = {[num_tokens, heads]} (q_index's T and H_I), "
                         f"got {list(index_weights.shape)}")
    if tuple(k_index.shape) != (num_tokens, width):
        raise ValueError(f"k_index must be [T, D_I] = {[num_tokens, width]} (q_index's T and D_I), "
                         f"got {list(k_index.shape)}")
    if packed:
        check_per_token_width(width, "q_index's D_I")
    if index_width(index_cache) != width:
        size = f"D_I + D_I/128*4 = {per_token_row_bytes(width)} bytes" if packed else f"D_I = {width}"
        raise ValueError(f"index_cache rows must be {size} wide (q_index's D_I), got {index_cache.shape[2]}")
    if plan.num_tokens is not None and plan.num_tokens != num_tokens:
        raise ValueError(f"plan was made for T={plan.num_tokens} tokens (its query_start_loc[-1]), but q_index "
                         f"has {num_tokens}")


def index_topk(
    q_index: torch.Tensor,
    index_weights: torch.Tensor,
    k_index: torch.Tensor,
    index_cache: torch.Tensor,
    plan: PrefillPlan,
    *,
    k_scale_index: float | torch.Tensor | None = None,
    index_cache_format: str = "auto",
) -> torch.Tensor:
    """The K = ``plan.index_topk`` keys each new token's sparse attention may see (module doc).

    Returns [T, K] int32: per token, positions in its request's sequence (``0 .. c_r + j``), valid ones
    first in any order, then -1 where there are fewer than K candidates; a sparse token whose scores are
    not finite (a NaN or inf in its query, weights or a candidate key) gets a row of -2, which
    ``run_prefill`` turns into a NaN output. A float8_e4m3fn
    ``index_cache`` needs ``k_scale_index`` (a float or a one-element float32 tensor). Reads no device
    value on the host; runs under torch.compile with a device-form plan made inside the graph.
    ``index_cache_format="fp8_per_token"``: ``index_cache`` [num_blocks, block_size, D_I + D_I/128*4] uint8 in
    vLLM's indexer layout (D_I a multiple of 128; ``mla_ops/ops/cache_formats.py``; no ``k_scale_index``),
    dequantized as it is read.
    """
    check_index_topk(q_index, index_weights, k_index, index_cache, plan, k_scale_index, index_cache_format)
    return index_topk_checked(q_index, index_weights, k_index, index_cache, plan,
                              k_scale_tensor(k_scale_index, index_cache))


def index_topk_checked(q_index, index_weights, k_index, index_cache, plan, k_scale_index) -> torch.Tensor:
    """``index_topk`` after its checks, ``k_scale_index`` a one-element tensor or None (``PrefillStep.select``)."""
    schedule = plan.index_schedule
    return _index_topk_op(
        q_index, index_weights, k_index, index_cache, plan.block_table, plan.query_start_loc, plan.context_lens,
        plan.sparse, schedule.starts, schedule.cu_seq_lens, schedule.token_start, schedule.token_end,
        k_scale_index, plan.index_topk, schedule.rows, schedule.tokens,
        [m for m, _ in schedule.piece_shapes], [w for _, w in schedule.piece_shapes],
    )
