"""The lightning indexer's chunks (DSA, DESIGN §12): which key rows each chunk scores, against which queries.

seq_lens [B] int32   each sparse request's whole sequence, c_r + q_r keys (0: a dense-routed request)
context_lens [B] int32   query_start_loc [B+1] int32    rows W, tokens M, chunk capacity C: static ints
-> starts [C, B], seq_lens [C, B], cu_seq_lens [C, B+1], token_start [C], token_end [C] (int32),
   truncated [B] bool

The keys of sparse request r are its sequence positions ``0 .. c_r + q_r - 1``: context positions
``p < c_r`` live in the paged index cache, the step's new keys ``p >= c_r`` in ``k_index`` (token
``query_start_loc[r] + p - c_r``). Concatenate the sparse requests' sequences into one stream and cut
it into row chunks of W rows (the packed schedule, ``device_schedule``); the scores of a row chunk
against its requests' query tokens would be up to (tokens x W), so each row chunk is split along its
query tokens (less the first request's queries that precede all of the chunk's rows, causally) into
pieces of at most M tokens (``M = scores_budget // W``). Index chunk i is one piece: the rows
``cu_seq_lens[i]`` (request r's rows ``starts[i, r] ..`` in workspace rows ``cu_seq_lens[i, r] ..``)
scored by the query tokens ``token_start[i] .. token_end[i]`` (each token against its own request's
rows, causally). Top-k partials of the pieces merge like LSE partials.

Both plan forms use the same tensors: the host form sizes C, W and M to what the step needs (no empty
chunk: ``host_index_schedule``), the device form takes ``max_chunks`` as C; pieces past C are not
scored and their requests are ``truncated`` (their attention comes out NaN, as the chunk loop's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .device_schedule import device_plan_tensors

# Scores (query tokens x key rows) one index chunk may hold: 2**26 float32 entries are 256 MiB, what
# vLLM's indexer budgets for its logits; at W = 65536 rows a chunk scores 1024 query tokens.
DEFAULT_INDEX_SCORES_BUDGET = 1 << 26


@dataclass(frozen=True)
class IndexSchedule:
    """The indexer's chunks of one step (module doc); a pytree whose static ints are ``rows`` and
    ``tokens``."""

    starts: torch.Tensor  # [C, B] int32: each request's first sequence position in the chunk
    seq_lens: torch.Tensor  # [C, B] int32: rows taken from each request (0: none)
    cu_seq_lens: torch.Tensor  # [C, B+1] int32: workspace row offsets
    token_start: torch.Tensor  # [C] int32: the chunk's first query token (absolute)
    token_end: torch.Tensor  # [C] int32: the end of its query tokens, at most ``tokens`` after the start
    truncated: torch.Tensor  # [B] bool: a request with pieces past the capacity C
    rows: int  # W: rows per chunk at most
    tokens: int  # M: query tokens per chunk at most

    @property
    def max_chunks(self) -> int:
        return self.starts.shape[0]

    def to(self, device: torch.device | str) -> IndexSchedule:
        tensors = {f: getattr(self, f).to(device, non_blocking=True)
                   for f in ("starts", "seq_lens", "cu_seq_lens", "token_start", "token_end", "truncated")}
        return IndexSchedule(**tensors, rows=self.rows, tokens=self.tokens)


def sequence_lens(query_start_loc: torch.Tensor, context_lens: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """[B] int32: c_r + q_r for the sparse requests with queries, 0 for the others (nothing to score)."""
    queries = query_start_loc[1:] - query_start_loc[:-1]
    return torch.where(sparse & (queries > 0), context_lens + queries, 0).to(torch.int32)


def sparse_requests(query_start_loc: torch.Tensor, context_lens: torch.Tensor, index_topk: int) -> torch.Tensor:
    """[B] bool: the requests whose sequence has more than ``index_topk`` keys (DESIGN §12 routing)."""
    return context_lens + (query_start_loc[1:] - query_start_loc[:-1]) > index_topk


class _RowChunks(NamedTuple):
    """The packed row chunks of a step (at most R), their query tokens and the pieces each needs."""

    starts: torch.Tensor  # [R, B]
    lens: torch.Tensor  # [R, B]
    cu: torch.Tensor  # [R, B+1]
    token_lo: torch.Tensor  # [R]
    token_hi: torch.Tensor  # [R]
    pieces: torch.Tensor  # [R]


def _row_chunks(seq_lens, context_lens, query_start_loc, rows: int, tokens: int, row_capacity: int) -> _RowChunks:
    starts, lens, cu, _ = device_plan_tensors(seq_lens, rows, row_capacity)
    batch = seq_lens.shape[0]
    has = lens > 0
    live = has.any(1)
    first = has.int().argmax(1)  # the chunk's first and last requests (0 where the chunk is empty)
    last = (batch - 1) - has.flip(1).int().argmax(1)
    qsl = query_start_loc.long()
    # Causal: the first request's queries before the chunk's first position see none of its rows.
    blind = (starts.gather(1, first.unsqueeze(1)).squeeze(1) - context_lens.long()[first]).clamp(min=0)
    token_lo, token_hi = qsl[first] + blind, qsl[last + 1]
    pieces = torch.where(live, (token_hi - token_lo + tokens - 1) // tokens, 0)
    return _RowChunks(starts, lens, cu, token_lo, token_hi, pieces)


def _pieces(rc: _RowChunks, seq_lens, query_start_loc, rows: int, tokens: int, max_chunks: int):
    """The row chunks' pieces in ``max_chunks`` slots: the schedule's tensors (module doc)."""
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
        + (query_start_loc.long()[1:].unsqueeze(0) - rc.token_lo.unsqueeze(1) - 1).div(tokens, rounding_mode="floor")
    dropped = ((last_piece > max_chunks) & (rc.lens > 0)).any(0)
    beyond = (torch.cumsum(seq_lens.long(), 0) > row_capacity * rows) & (seq_lens > 0)
    return starts.int(), lens.int(), cu.int(), token_start.int(), token_end.int(), dropped | beyond


def device_index_schedule(query_start_loc, context_lens, sparse, rows: int, tokens: int,
                          max_chunks: int) -> IndexSchedule:
    """The device form: W = ``rows``, M = ``tokens``, ``max_chunks`` slots, with tensor code only (no host
    read; each row chunk needs a piece, so ``max_chunks`` row chunks are planned)."""
    seq_lens = sequence_lens(query_start_loc, context_lens, sparse)
    rc = _row_chunks(seq_lens, context_lens, query_start_loc, rows, tokens, max_chunks)
    return IndexSchedule(*_pieces(rc, seq_lens, query_start_loc, rows, tokens, max_chunks), rows=rows, tokens=tokens)


def _host_row_chunks(seq_lens, context_lens, query_start_loc, rows: int, tokens: int) -> _RowChunks:
    row_chunks = max(1, -(-int(seq_lens.long().sum()) // rows))
    return _row_chunks(seq_lens, context_lens, query_start_loc, rows, tokens, row_chunks)


def host_index_schedule(query_start_loc, context_lens, sparse, workspace_size: int,
                        scores_budget: int) -> IndexSchedule:
    """The host form, from CPU lengths: as many pieces as the step needs. A step with fewer sparse keys than the
    workspace takes them in one chunk of just those rows, scored by proportionally more queries at a time (at
    most the step's: a piece's scores buffer is never larger than the step needs)."""
    seq_lens = sequence_lens(query_start_loc, context_lens, sparse)
    rows = max(1, min(workspace_size, int(seq_lens.long().sum())))
    tokens = max(1, min(scores_budget // rows, int(query_start_loc[-1])))
    rc = _host_row_chunks(seq_lens, context_lens, query_start_loc, rows, tokens)
    count = int(rc.pieces.sum())
    return IndexSchedule(*_pieces(rc, seq_lens, query_start_loc, rows, tokens, count), rows=rows, tokens=tokens)


def pieces_needed(seq_lens, context_lens, query_start_loc, rows: int, tokens: int) -> int:
    """The pieces a step's CPU lengths need at W = ``rows``, M = ``tokens`` (``PrefillGraphs``' chunk bucket)."""
    return int(_host_row_chunks(seq_lens, context_lens, query_start_loc, rows, tokens).pieces.sum())
