"""Lightning-indexer batches (DSA, DESIGN §12) and their dense float64 top-k oracle, written from the
design (independently of mla_ops/ops/indexer.py).

    q_index [T + pad, H_I, D_I]   index_weights [T + pad, H_I]   k_index [T + pad, D_I]
    index_cache [num_blocks, block_size, D_I]   (fp8: dequantized = stored * k_scale)
    block_table [B, max_blocks] int32   query_start_loc [B+1] int32   context_lens [B] int32
    -> expected[t]: sorted positions of token t's top-K candidates (all of them when at most K)

Free of near-ties by construction: wherever a token has more than K candidates, its query and
weights are redrawn until its K-th and (K+1)-th scores (float64, from the values as stored) differ
by more than ``gap`` of its largest score, far beyond float32 rounding. Cache slots no context uses
and padding tokens' rows are NaN, so a read of them shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import mla_ops
from tests.support.batches import paged_block_table

FP8 = torch.float8_e4m3fn
NAN = float("nan")


@dataclass
class IndexerBatch:
    q_index: torch.Tensor
    index_weights: torch.Tensor
    k_index: torch.Tensor
    index_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    k_scale: float | None
    expected: list[list[int]]  # per token (padding: empty)

    @property
    def args(self):
        return self.q_index, self.index_weights, self.k_index, self.index_cache

    def plan(self, topk, workspace_size, budget, max_chunks=None):
        return mla_ops.plan_prefill(self.query_start_loc, self.context_lens, self.block_table,
                                    block_size=self.index_cache.shape[1], workspace_size=workspace_size,
                                    max_chunks=max_chunks, index_topk=topk, index_scores_budget=budget)

    def to(self, device):
        moved = {f: getattr(self, f).to(device) for f in ("q_index", "index_weights", "k_index", "index_cache",
                                                            "block_table", "query_start_loc", "context_lens")}
        return IndexerBatch(**moved, k_scale=self.k_scale, expected=self.expected)


def _scores(q, w, keys):
    """[n] float64: sum_h w[h] * relu(q[h] . keys[s])."""
    return (w.unsqueeze(1) * torch.relu(q @ keys.T)).sum(0)


def indexer_batch(context_lens, query_lens, topk, *, block_size, heads=4, width=16, dtype=torch.float32,
                  weights_dtype=torch.float32, fp8_scale=None, pad_tokens=0, seed=0, gap=1e-3,
                  stored=None) -> IndexerBatch:
    """``stored``: the cache's values as a packed format reads them back (a function of the float cache),
    which the oracle then scores."""
    g = torch.Generator().manual_seed(seed)
    num_tokens = sum(query_lens)
    num_blocks, table = paged_block_table([-(-c // block_size) for c in context_lens], g, spare_blocks=2,
                                          pad_cols=1)
    cache = torch.full((num_blocks, block_size, width), NAN)
    for r, c in enumerate(context_lens):
        for p in range(c):
            cache[table[r, p // block_size], p % block_size] = torch.randn(width, generator=g)
    cache = cache.to(FP8 if fp8_scale else dtype)
    keys_cache = cache.double() * (fp8_scale or 1.0) if stored is None else stored(cache).double()  # what is read
    total = num_tokens + pad_tokens
    q = torch.randn(total, heads, width, generator=g).to(dtype)
    w = torch.randn(total, heads, generator=g).to(weights_dtype)
    k = torch.randn(total, width, generator=g).to(dtype)
    for x in (q, w, k):
        x[num_tokens:] = NAN
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    expected = []
    for r, (c, n) in enumerate(zip(context_lens, query_lens)):
        context = [keys_cache[table[r, p // block_size], p % block_size] for p in range(c)]
        keys = torch.stack(context) if c else keys_cache.new_zeros(0, width)
        keys = torch.cat([keys, k[qsl[r] : qsl[r] + n].double()])
        for j in range(n):
            t, candidates = qsl[r] + j, c + j + 1
            if candidates <= topk:
                expected.append(list(range(candidates)))
                continue
            for _ in range(200):
                s = _scores(q[t].double(), w[t].double(), keys[:candidates]).sort(descending=True)
                if s.values[topk - 1] - s.values[topk] > gap * s.values.abs().max():
                    break
                q[t] = torch.randn(heads, width, generator=g).to(dtype)
                w[t] = torch.randn(heads, generator=g).to(weights_dtype)
            else:
                raise AssertionError(f"no tie-free query for token {t} in 200 draws")
            expected.append(sorted(s.indices[:topk].tolist()))
    expected += [[] for _ in range(pad_tokens)]
    return IndexerBatch(q, w, k, cache, table, torch.tensor(qsl, dtype=torch.int32),
                        torch.tensor(context_lens, dtype=torch.int32), fp8_scale, expected)


def check_topk(got: torch.Tensor, expected: list[list[int]], topk: int, tokens=None) -> None:
    """Each row of ``got`` [T, K]: the expected positions first, as a set, then -1 (``tokens``: only these)."""
    assert got.dtype == torch.int32 and tuple(got.shape) == (len(expected), topk), (got.dtype, got.shape)
    rows = got.cpu().tolist()
    for t in range(len(expected)) if tokens is None else tokens:
        want, row = expected[t], rows[t]
        assert sorted(row[: len(want)]) == want and row[len(want):] == [-1] * (topk - len(want)), (t, row, want)


POISONS = ("q_index nan", "weight +inf", "weight nan", "cache key nan", "new key nan")


def poison(batch: IndexerBatch, kind: str, request: int, j: int = 1) -> set[int]:
    """Puts one non-finite value (``kind``, one of ``POISONS``) into request ``request``'s indexer inputs, in
    place: its query token ``j``'s query or weights, its context's first cache key, or new token ``j``'s key.
    Returns the tokens whose scores it reaches (the token, or, for a key, every token that sees it)."""
    first, last = batch.query_start_loc[request].item(), batch.query_start_loc[request + 1].item()
    if kind == "q_index nan":
        batch.q_index[first + j, 1, 2] = NAN
        return {first + j}
    if kind in ("weight +inf", "weight nan"):
        batch.index_weights[first + j, 0] = float("inf") if kind == "weight +inf" else NAN
        return {first + j}
    if kind == "cache key nan":
        assert batch.context_lens[request] > 0
        batch.index_cache[batch.block_table[request, 0], 0, 3] = NAN
        return set(range(first, last))
    if kind == "new key nan":
        batch.k_index[first + j, 3] = NAN
        return set(range(first + j, last))  # causal: the tokens before it never see it
    raise ValueError(kind)


def check_poisoned_topk(got: torch.Tensor, batch: IndexerBatch, topk: int, sparse: list[bool], reached: set[int],
                        request: int) -> None:
    """The tokens ``reached`` of a sparse request: a row of -2 (no finite selection); every other row as
    expected (valid positions first, then -1): a dense-routed request's tokens take every candidate anyway."""
    rows = got.cpu().tolist()
    marked = reached if sparse[request] else set()
    for t in marked:
        assert rows[t] == [-2] * topk, (t, rows[t])
    check_topk(got, batch.expected, topk, tokens=[t for t in range(len(rows)) if t not in marked])


def plan_chunks(args, plan, k_scale):
    """Per piece of ``plan`` (``ops.indexer.index_pieces``): ``(i, M, W, chunk)``, ``chunk`` the scorers' arguments
    before their ``scores`` [M, W] (``args``: q_index, index_weights, k_index, index_cache)."""
    from mla_ops.ops.indexer import index_pieces

    s = plan.index_schedule
    for i, slot_token, m, w in index_pieces(plan.query_start_loc, plan.sparse, s.token_start, s.token_end,
                                            s.max_chunks, s.rows, s.tokens, [m for m, _ in s.piece_shapes],
                                            [w for _, w in s.piece_shapes], args[0].shape[0]):
        yield i, m, w, (*args, plan.block_table, plan.query_start_loc, plan.context_lens, s.starts[i],
                        s.cu_seq_lens[i], slot_token, k_scale)
