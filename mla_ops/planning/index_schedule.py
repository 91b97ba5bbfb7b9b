"""The lightning indexer's chunks (DSA, DESIGN §12): which key rows each chunk scores, against which queries.

seq_lens [B] int32   each sparse request's whole sequence, c_r + q_r keys (0: a dense-routed request)
context_lens [B] int32   query_start_loc [B+1] int32    rows W, tokens M, chunk capacity C: static ints
-> starts [C, B], seq_lens [C, B], cu_seq_lens [C, B+1], token_start [C], token_end [C] (int32),
   truncated [B] bool, piece_shapes (host form: each piece's scores tile)

The keys of sparse request r are its sequence positions ``0 .. c_r + q_r - 1``: context positions
``p < c_r`` live in the paged index cache, the step's new keys ``p >= c_r`` in ``k_index`` (token
``query_start_loc[r] + p - c_r``). Concatenate the sparse requests' sequences into one stream and cut
it into row chunks of W rows (the packed schedule, ``device_schedule``); the scores of a row chunk
against its requests' query tokens would be up to (tokens x W), so each row chunk is split along its
query tokens (less the first request's queries that precede all of the chunk's rows, causally) into
pieces. Index chunk i is one piece: the rows ``cu_seq_lens[i]`` (request r's rows ``starts[i, r] ..``
in workspace rows ``cu_seq_lens[i, r] ..``) scored by the query tokens ``token_start[i] ..
token_end[i]`` (each token against its own request's rows, causally). Top-k partials of the pieces
merge like LSE partials.

Token indices count **sparse tokens** only: the tokens of the sparse requests, in order
(``sparse_token_loc``: request r's at ``loc[r] .. loc[r+1]``), so a dense-routed request lying
between two sparse ones is never scored.

* The host form sizes each piece to its requests (vLLM's rule, ``split_indexer_prefill_chunks``, within
  a row chunk): a piece packs the chunk's requests in order while (their tokens x their rows) stays
  within the scores budget; a request that alone breaks it is split along its queries into pieces of
  ``budget // its rows`` tokens. A piece's scores tile is ``piece_shapes[i] = (tokens, rows)``.
* The device form (static shapes) scores each row chunk's sparse tokens M = ``budget // W`` at a time in
  ``[M, W]`` tiles, in ``max_index_chunks`` slots; pieces past them are not scored and their requests are
  ``truncated`` (their attention comes out NaN, as the chunk loop's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .device_schedule import device_plan_tensors

# Scores (query tokens x key rows) one index chunk may hold: 2**26 float32 entries are 256 MiB, what
# vLLM's indexer budgets for its logits; at W = 65536 rows a chunk scores 1024 query tokens.
DEFAULT_INDEX_SCORES_BUDGET = 1 << 26


@dataclass(frozen=True)
class IndexSchedule:
    """The indexer's chunks of one step (module doc); a pytree whose static ints are ``rows``, ``tokens`` and
    ``piece_shapes``."""

    starts: torch.Tensor  # [C, B] int32: each request's first sequence position in the chunk
    seq_lens: torch.Tensor  # [C, B] int32: rows taken from each request (0: none)
    cu_seq_lens: torch.Tensor  # [C, B+1] int32: workspace row offsets
    token_start: torch.Tensor  # [C] int32: the chunk's first sparse token (``sparse_token_loc``)
    token_end: torch.Tensor  # [C] int32: the end of its sparse tokens
    truncated: torch.Tensor  # [B] bool: a request with pieces past the capacity C
    rows: int  # W: rows per chunk at most
    tokens: int  # M: query tokens per chunk at most
    # Host form: (tokens, rows) of each piece's scores tile, tokens x rows within the budget; empty in the
    # device form, where every tile is [tokens, rows].
    piece_shapes: tuple[tuple[int, int], ...] = ()

    @property
    def max_chunks(self) -> int:
        return self.starts.shape[0]

    def to(self, device: torch.device | str) -> IndexSchedule:
        tensors = {f: getattr(self, f).to(device, non_blocking=True)
                   for f in ("starts", "seq_lens", "cu_seq_lens", "token_start", "token_end", "truncated")}
        return IndexSchedule(**tensors, rows=self.rows, tokens=self.tokens, piece_shapes=self.piece_shapes)


def sequence_lens(query_start_loc: torch.Tensor, context_lens: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """[B] int32: c_r + q_r for the sparse requests with queries, 0 for the others (nothing to score)."""
    queries = query_start_loc[1:] - query_start_loc[:-1]
    return torch.where(sparse & (queries > 0), context_lens + queries, 0).to(torch.int32)


def sparse_token_loc(query_start_loc: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """[B+1] int64: where each request's tokens start among the step's sparse tokens (a dense request has none)."""
    queries = (query_start_loc[1:] - query_start_loc[:-1]).long()
    return torch.nn.functional.pad(torch.cumsum(torch.where(sparse, queries, 0), 0), (1, 0))


def sparse_requests(query_start_loc: torch.Tensor, context_lens: torch.Tensor, index_topk: int) -> torch.Tensor:
    """[B] bool: the requests whose sequence has more than ``index_topk`` keys (DESIGN §12 routing)."""
    return context_lens + (query_start_loc[1:] - query_start_loc[:-1]) > index_topk


class _RowChunks(NamedTuple):
    """The packed row chunks of a step (at most R), their sparse tokens and the pieces each needs."""

    starts: torch.Tensor  # [R, B]
    lens: torch.Tensor  # [R, B]
    cu: torch.Tensor  # [R, B+1]
    token_lo: torch.Tensor  # [R]
    token_hi: torch.Tensor  # [R]
    pieces: torch.Tensor  # [R]


def _row_chunks(seq_lens, context_lens, token_loc, rows: int, tokens: int, row_capacity: int) -> _RowChunks:
    starts, lens, cu, _ = device_plan_tensors(seq_lens, rows, row_capacity)
    batch = seq_lens.shape[0]
    has = lens > 0
    live = has.any(1)
    first = has.int().argmax(1)  # the chunk's first and last requests (0 where the chunk is empty)
    last = (batch - 1) - has.flip(1).int().argmax(1)
    # Causal: the first request's queries before the chunk's first position see none of its rows.
    blind = (starts.gather(1, first.unsqueeze(1)).squeeze(1) - context_lens.long()[first]).clamp(min=0)
    token_lo, token_hi = token_loc[first] + blind, token_loc[last + 1]
    pieces = torch.where(live, (token_hi - token_lo + tokens - 1) // tokens, 0)
    return _RowChunks(starts, lens, cu, token_lo, token_hi, pieces)


def _pieces(rc: _RowChunks, seq_lens, token_loc, rows: int, tokens: int, max_chunks: int):
    """The row chunks' pieces of M = ``tokens`` sparse tokens in ``max_chunks`` slots (the device form)."""
    row_capacity = rc.starts.shape[0]
    done = torch.cumsum(rc.pieces, 0)  # [R] pieces up to and including row chunk k
    chunk = torch.arange(max_chunks, device=seq_lens.device)
    row_chunk = torch.searchsorted(done, chunk, right=True)  # [C]; row_capacity past the last piece
    used = row_chunk < row_capacity
    k = row_chunk.clamp(max=row_capacity - 1)
    piece = chunk - (done[k] - rc.pieces[k])
    token_start = torch.where(used, rc.token_lo[k] + piece * tokens, 0)
    token_end = torch.where(used, torch.minimum(token_start + tokens, rc.token_hi[k]), 0)
    keep = used.unsqueeze(1)
    starts, lens, cu = (torch.where(keep, x.index_select(0, k), 0) for x in (rc.starts, rc.lens, rc.cu))
    # Truncated: a request with rows in a row chunk whose piece of its last token is past C, or with rows
    # past the row chunks planned.
    last_piece = (done - rc.pieces + 1).unsqueeze(1) \
        + (token_loc[1:].unsqueeze(0) - rc.token_lo.unsqueeze(1) - 1).div(tokens, rounding_mode="floor")
    dropped = ((last_piece > max_chunks) & (rc.lens > 0)).any(0)
    beyond = (torch.cumsum(seq_lens.long(), 0) > row_capacity * rows) & (seq_lens > 0)
    return starts.int(), lens.int(), cu.int(), token_start.int(), token_end.int(), dropped | beyond


def device_index_schedule(query_start_loc, context_lens, sparse, rows: int, tokens: int,
                          max_chunks: int) -> IndexSchedule:
    """The device form: W = ``rows``, M = ``tokens``, ``max_chunks`` slots, with tensor code only (no host
    read; each row chunk needs a piece, so ``max_chunks`` row chunks are planned)."""
    seq_lens = sequence_lens(query_start_loc, context_lens, sparse)
    token_loc = sparse_token_loc(query_start_loc, sparse)
    rc = _row_chunks(seq_lens, context_lens, token_loc, rows, tokens, max_chunks)
    return IndexSchedule(*_pieces(rc, seq_lens, token_loc, rows, tokens, max_chunks), rows=rows, tokens=tokens)


def _segments(seq_lens: np.ndarray, context_lens: np.ndarray, token_loc: np.ndarray, rows: int):
    """Each row chunk's segments (one request's rows in it), in order: lists of ``(request, first position,
    rows, first sparse token)``; a segment's tokens end at its request's last one (``token_loc[r + 1]``)."""
    chunks, current, room = [], [], rows
    for r in np.flatnonzero(seq_lens):
        length, context, first = int(seq_lens[r]), int(context_lens[r]), int(token_loc[r])
        position = 0
        while position < length:
            take = min(room, length - position)
            # Causal: the queries before the segment's first position see none of it.
            current.append((int(r), position, take, first + max(0, position - context)))
            position += take
            room -= take
            if room == 0:
                chunks.append(current)
                current, room = [], rows
    if current:
        chunks.append(current)
    return chunks


def _host_pieces(segments, token_loc: np.ndarray, budget: int):
    """One row chunk's pieces by vLLM's rule (module doc): lists of ``(segments, token_start, token_end)``."""
    pieces, i = [], 0
    while i < len(segments):
        rows = tokens = 0
        j = i
        while j < len(segments):
            r, _, n, lo = segments[j]
            more = int(token_loc[r + 1]) - lo
            if (tokens + more) * (rows + n) > budget:
                break
            rows, tokens, j = rows + n, tokens + more, j + 1
        if j > i:
            pieces.append((segments[i:j], segments[i][3], int(token_loc[segments[j - 1][0] + 1])))
        else:  # one request's queries alone break the budget: split them
            r, _, n, lo = segments[i]
            step, end = max(1, budget // n), int(token_loc[r + 1])
            pieces += [(segments[i:i + 1], start, min(start + step, end)) for start in range(lo, end, step)]
            j = i + 1
        i = j
    return pieces


def host_index_schedule(query_start_loc, context_lens, sparse, workspace_size: int,
                        scores_budget: int) -> IndexSchedule:
    """The host form, from CPU lengths: as many pieces as the step needs, each sized to its requests."""
    seq_lens = sequence_lens(query_start_loc, context_lens, sparse).numpy()
    token_loc = sparse_token_loc(query_start_loc, sparse).numpy()
    ctx = context_lens.numpy()
    pieces = [p for chunk in _segments(seq_lens, ctx, token_loc, workspace_size)
              for p in _host_pieces(chunk, token_loc, scores_budget)]
    count, batch = len(pieces), seq_lens.shape[0]
    starts = np.zeros((count, batch), np.int32)
    lens = np.zeros_like(starts)
    bounds = np.zeros((count, 2), np.int32)
    for i, (segments, token_start, token_end) in enumerate(pieces):
        for r, position, n, _ in segments:
            starts[i, r], lens[i, r] = position, n
        bounds[i] = token_start, token_end
    cu = np.zeros((count, batch + 1), np.int32)
    np.cumsum(lens, 1, out=cu[:, 1:])
    shapes = tuple((int(b - a), int(c)) for (a, b), c in zip(bounds, cu[:, -1]))
    return IndexSchedule(
        torch.from_numpy(starts), torch.from_numpy(lens), torch.from_numpy(cu),
        torch.from_numpy(bounds[:, 0].copy()), torch.from_numpy(bounds[:, 1].copy()),
        torch.zeros(batch, dtype=torch.bool), rows=max((r for _, r in shapes), default=1),
        tokens=max((t for t, _ in shapes), default=1), piece_shapes=shapes)


def pieces_needed(seq_lens, context_lens, query_start_loc, sparse, rows: int, tokens: int) -> int:
    """The device form's pieces for a step's CPU lengths at W = ``rows``, M = ``tokens`` (``PrefillGraphs``'
    index chunk bucket)."""
    row_chunks = max(1, -(-int(seq_lens.long().sum()) // rows))
    rc = _row_chunks(seq_lens, context_lens, sparse_token_loc(query_start_loc, sparse), rows, tokens, row_chunks)
    return int(rc.pieces.sum())
