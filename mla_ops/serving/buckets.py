"""Buckets and padding: the one contract by which a step becomes a fixed-size, replayable step.

A step of T tokens and B requests, whose chunked context needs ``ceil(chunked / workspace_size)``
chunks, runs in the smallest bucket ``(tokens, requests, chunks)`` that holds it (DESIGN §8). Its
length buffers are padded in this order:

* request rows ``0 .. B-1``: the real requests;
* rows ``B .. S-1`` (S = the bucket's request slots): zero-length sentinels (no tokens, no context);
* row ``S``: the padding request, which owns the spare tokens ``T .. bucket tokens - 1`` and has no
  context (its tokens' slots are -1: they write nothing).

``query_start_loc`` is then ``[S+2]`` and ``context_lens`` ``[S+1]`` for every step of the bucket.
"""

from __future__ import annotations

import bisect
import itertools
from typing import NamedTuple

import numpy as np

from .. import _checks as checks
import torch

from ..planning.index_schedule import pieces_needed, sequence_lens, sparse_requests
from ..planning.options import PlanOptions
from ..planning.routing import route_context


class Bucket(NamedTuple):
    """One bucket: padded token count, request slots, chunk capacity K."""

    tokens: int
    requests: int
    chunks: int

    def __str__(self) -> str:
        return f"T{self.tokens}-B{self.requests}-K{self.chunks}"


def powers_of_two_up_to(limit: int, first: int) -> tuple[int, ...]:
    """``first, 2*first, ...`` below ``limit``, then ``limit``."""
    sizes = []
    size = first
    while size < limit:
        sizes.append(size)
        size *= 2
    return (*sizes, limit)


def check_sizes(sizes, name: str, limit: int | None = None) -> tuple[int, ...]:
    """A bucket list: positive ints, sorted and unique, at most ``limit``."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"{name} must be a sequence of positive ints, got {type(sizes).__name__}")
    checked = tuple(sorted({checks.check_int32_size(b, name) for b in sizes}))  # int32 lengths and offsets
    if not checked:
        raise ValueError(f"{name} must hold at least one size")
    if limit is not None and checked[-1] > limit:
        raise ValueError(f"{name} must not exceed {limit} (the static buffers' size), got {checked[-1]}")
    return checked


def smallest_at_least(sizes: tuple[int, ...], n: int) -> int | None:
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class Buckets(NamedTuple):
    """The bucket lists of every dimension and the rule that picks one for a step."""

    tokens: tuple[int, ...]
    requests: tuple[int, ...]
    chunks: tuple[int, ...]

    @classmethod
    def build(cls, max_tokens: int, max_requests: int, chunks=(1, 2, 4, 8, 16), tokens=None,
              requests=None) -> Buckets:
        """Token and request buckets default to powers of two (from 16 and 1) up to the maxima."""
        max_tokens = checks.check_int32_size(max_tokens, "max_tokens")  # query_start_loc is int32
        max_requests = checks.check_int32_size(max_requests, "max_requests")
        return cls(
            tokens=powers_of_two_up_to(max_tokens, 16) if tokens is None else
            check_sizes(tokens, "token_buckets", max_tokens),
            requests=powers_of_two_up_to(max_requests, 1) if requests is None else
            check_sizes(requests, "request_buckets", max_requests),
            chunks=check_sizes(chunks, "chunk_buckets"),
        )

    def all(self) -> tuple[Bucket, ...]:
        """Every bucket, largest first."""
        return tuple(sorted((Bucket(*b) for b in itertools.product(self.tokens, self.requests, self.chunks)),
                            reverse=True))

    def choose(self, query_start_loc: np.ndarray, context_lens: np.ndarray, options: PlanOptions,
               stripe: int = 1) -> Bucket | None:
        """The smallest bucket that holds the step (host lengths); None beyond the largest.

        The chunk count follows the device plan's own routing (``options``): absorbed requests
        take no chunk. ``stripe``: context parallel's ``interleave * D``, chunks holding whole stripes.
        A DeepSeek Sparse Attention step (``options.index_topk``): sparse requests take no attention chunk,
        and K must also hold the indexer's chunks of the padded step (the padding request may be sparse).
        A sliding window chunks only the rows it covers.
        """
        tokens = smallest_at_least(self.tokens, int(query_start_loc[-1]))
        requests = smallest_at_least(self.requests, context_lens.size)
        if tokens is None or requests is None:
            return None
        index_chunks = 0
        if options.index_topk:
            padded = torch.from_numpy(padded_lengths(Bucket(tokens, requests, 0), query_start_loc, context_lens))
            qsl, ctx = padded[: requests + 2], padded[requests + 2 :]
            sparse = sparse_requests(qsl, ctx, options.index_topk)
            index_chunks = pieces_needed(sequence_lens(qsl, ctx, sparse), ctx, qsl, sparse, options.workspace_size,
                                         options.index_tokens)
            context_lens = np.where(sparse.numpy()[: context_lens.size], 0, context_lens)  # no attention chunk
        if options.sliding_window:  # a window's rows only (planning.plan.window_rows)
            context_lens = np.minimum(context_lens, options.sliding_window - 1)
        chunked, _ = route_context(context_lens, np.diff(query_start_loc), options.absorb_threshold,
                                   options.absorbed_capacity)
        stripes = -(-chunked.astype(np.int64) // stripe)
        chunks_needed = max(1, -(-int(stripes.sum()) // (options.workspace_size // stripe)), index_chunks)
        chunks = smallest_at_least(self.chunks, chunks_needed)
        return None if chunks is None else Bucket(tokens, requests, chunks)


def padded_lengths(bucket: Bucket, query_start_loc: np.ndarray, context_lens: np.ndarray) -> np.ndarray:
    """``[query_start_loc (S+2) | context_lens (S+1)]`` of the step padded to ``bucket`` (module doc)."""
    slots, requests = bucket.requests, context_lens.size
    lengths = np.zeros(2 * slots + 3, np.int32)
    lengths[: requests + 1] = query_start_loc
    lengths[requests + 1 : slots + 1] = query_start_loc[-1]  # sentinels: no tokens
    lengths[slots + 1] = bucket.tokens  # the padding request takes the spare tokens
    lengths[slots + 2 : slots + 2 + requests] = context_lens  # sentinel and padding contexts stay 0
    return lengths
