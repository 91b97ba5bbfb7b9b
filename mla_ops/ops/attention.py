"""Attention over up-projected MLA keys: the chunk's context partial and the causal suffix partial.

Both ops share one oracle, ``varlen_attention_reference`` (also the CPU path: requests of alike
sizes are padded into one batched attention, a request with many keys attends alone, in place; a
batch that fits runs ATen's fused CPU attention, the others a loop over key blocks):

q       [Tq, N, P+R]   queries of n requests, rows cu_q[i]:cu_q[i+1]
k_nope  [Tk, N, P]     per-head key part     k_pe [Tk, R] rotary key part, shared by all heads
v       [Tk, N, V]     values of n requests, rows cu_k[i]:cu_k[i+1]
-> out  [Tq, N, V] float32 (float64 for float64 q), lse [N, Tq] natural log; no keys: 0 / -inf

``causal`` aligns the mask bottom-right: query j of m sees keys ``0 .. s - m + j`` of s.

``context_attention``: context attention of one chunk, folded into the running context partial.

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

``suffix_attention``: causal attention of the new tokens over their own keys (the suffix partial).

q               [T, N, P+R]   rotated queries of the new tokens
k_nope          [T, N, P]     up-projected keys of the new tokens   k_pe [T, R]
v               [T, N, V]     up-projected values of the new tokens
query_start_loc [B+1] int32   request boundaries (keys share them)
out             [T, N, V]     (out=)
lse             [N, T]        float32 (float64 for float64 q), natural log (out=)
"""

from __future__ import annotations

import torch

from .._mla import KEY_BLOCK, lse_dtype
from .merge import merge_into, merge_states_reference


# Padding a request into a batch may cost this many multiply-adds for nothing: below it, one more
# batch (a dozen small ops) costs more than the padded work.
PAD_SLACK = 1 << 20
# Score entries (per head) of one key block of a padded batch; a lone request may exceed it.
SCORE_LIMIT = 1 << 20
# A request with more key and value elements than this attends alone, reading them in place:
# batching would copy them heads first, which costs more than the ops it saves.
ALONE_LIMIT = 1 << 16
# Gathered key (or value) elements up to which a batch runs ATen's fused CPU attention (one call, the
# causal half skipped) instead of the key-block loop below: 64 MB in float32.
FLASH_LIMIT = 1 << 24
_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def padded_batches(query_lens, key_lens, width, key_block, kv_width=0):
    """Requests with queries and keys, in batches (lists of request ids, ascending) padded to one shape each.

    Sorted by size, a request joins the previous batch while the padded work (score entries x
    ``width`` multiply-adds), its own and the batch's, stays within twice the real work plus
    ``PAD_SLACK`` and a key block's scores within ``SCORE_LIMIT``: one batch when sizes are alike,
    bounded waste when they are not.
    A request with more than ``ALONE_LIMIT`` keys x ``kv_width`` elements is a batch of its own.
    """
    order = sorted((r for r, (m, s) in enumerate(zip(query_lens, key_lens)) if m > 0 and s > 0),
                   key=lambda r: (query_lens[r], key_lens[r]), reverse=True)
    batches, work, max_m, max_s, alone = [], 0, 0, 0, True  # alone: the last batch takes no more
    for r in order:  # host scalars only: no tensor op per request
        m, s = query_lens[r], key_lens[r]
        n, padded_s = len(batches[-1]) + 1 if batches else 1, max(max_s, s)
        padded = max_m * padded_s * width  # each member's work once padded
        if (not alone and s * kv_width <= ALONE_LIMIT
                and padded <= 2 * m * s * width + PAD_SLACK
                and n * padded <= 2 * (work + m * s) * width + PAD_SLACK
                and n * max_m * min(padded_s, key_block) <= SCORE_LIMIT):
            batches[-1].append(r)
            work, max_s = work + m * s, padded_s
        else:  # sorted by query length: a batch's first request has its longest queries
            batches.append([r])
            work, max_m, max_s, alone = m * s, m, s, s * kv_width > ALONE_LIMIT
    return [sorted(batch) for batch in batches]  # request order: neighbours' rows stay one run (no index)


class PaddedRows:
    """Rows ``starts[i] + begin .. starts[i] + end`` of n requests with ``lens[i]`` rows each, [n, w].

    One run of rows is a slice (a view, no index); otherwise ``index`` [n, w] repeats a request's
    first row for its padding (a valid row) and ``valid`` [n, w] marks the real rows.
    """

    def __init__(self, starts, lens, begin, end, device):
        self.shape = (len(starts), end - begin)
        self.padded = min(lens) < end
        self.run = None
        if not self.padded and (len(starts) == 1 or begin == 0) and all(
                b - a == end - begin for a, b in zip(starts, starts[1:])):
            self.run = slice(starts[0] + begin, starts[0] + begin + len(starts) * (end - begin))
            return
        position = torch.arange(begin, end, device=device)
        self.valid = position < torch.tensor(lens, device=device)[:, None]
        self.index = torch.tensor(starts, device=device)[:, None] + torch.where(self.valid, position, 0)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """x's rows, [n, w, ...]."""
        if self.run is not None:
            return x[self.run].unflatten(0, self.shape)
        return x.index_select(0, self.index.flatten()).unflatten(0, self.shape)

    def put(self, dst: torch.Tensor, src: torch.Tensor, dim: int) -> None:
        """Write the real rows of ``src`` (n*w along ``dim``) to their rows of ``dst``."""
        src = src.to(dst.dtype)
        if self.run is not None:
            dst.narrow(dim, self.run.start, self.run.stop - self.run.start).copy_(src)
        elif self.padded:
            real = self.valid.flatten().nonzero().squeeze(1)
            dst.index_copy_(dim, self.index.flatten()[real], src.index_select(dim, real))
        else:
            dst.index_copy_(dim, self.index.flatten(), src)


def _attend(q, k_nope, k_pe, v, q_bounds, k_starts, key_lens, softmax_scale, causal, out, lse) -> None:
    """Request r's queries ``q_bounds[r]:q_bounds[r+1]`` over its ``key_lens[r]`` keys from row
    ``k_starts[r]`` (host lists), written to its rows of ``out``/``lse``; other rows are untouched."""
    acc = lse_dtype(q.dtype)
    num_heads, nope = q.shape[1], k_nope.shape[-1]
    query_lens = [b - a for a, b in zip(q_bounds, q_bounds[1:])]
    width, kv_width = num_heads * (q.shape[-1] + v.shape[-1]), num_heads * (nope + v.shape[-1])
    for batch in padded_batches(query_lens, key_lens, width, KEY_BLOCK, kv_width):
        # One attention per batch, its requests padded: queries [n, m, ...] over keys [n, s, ...].
        lens_q, lens_k = [query_lens[r] for r in batch], [key_lens[r] for r in batch]
        n, m, s = len(batch), max(lens_q), max(lens_k)
        rows_q = PaddedRows([q_bounds[r] for r in batch], lens_q, 0, m, q.device)
        if s == 1 and m == 1:  # one query over one key each (a decode step's suffix): the softmax is 1
            rows_k = PaddedRows([k_starts[r] for r in batch], lens_k, 0, 1, q.device)
            keys = torch.cat([rows_k.take(k_nope), rows_k.take(k_pe).unsqueeze(2).expand(-1, -1, num_heads, -1)], -1)
            scores = (rows_q.take(q).to(acc) * keys.to(acc)).sum(-1) * softmax_scale  # [n, 1, N]
            rows_q.put(out, rows_k.take(v).to(acc).flatten(0, 1), 0)
            rows_q.put(lse, scores.flatten(0, 1).t(), 1)
            continue
        if _flash_fits(q, n, s, max(q.shape[-1], v.shape[-1])) and (not causal or lens_q == lens_k):
            rows_k = PaddedRows([k_starts[r] for r in batch], lens_k, 0, s, q.device)
            o_i, lse_i = _flash_attend(q, k_nope, k_pe, v, rows_q, rows_k, softmax_scale, causal, acc)
            rows_q.put(out, o_i, 0)
            rows_q.put(lse, lse_i, 1)
            continue
        qi = rows_q.take(q).to(acc) * softmax_scale  # [n, m, N, P+R]
        q_nope = qi[..., :nope].permute(2, 0, 1, 3).reshape(num_heads * n, m, nope)  # heads first
        q_pe = qi[..., nope:].transpose(1, 2).reshape(n, num_heads * m, -1)  # [n, N*m, R]: k_pe is shared
        if causal and (m > 1 or min(lens_k) < s):  # bottom-right: query j of m_i sees keys 0 .. s_i - m_i + j
            last_key = torch.tensor([sk - mq for sk, mq in zip(lens_k, lens_q)], device=q.device)[:, None, None]
            last_key = last_key + torch.arange(m, device=q.device)[:, None]  # [n, m, 1]
        partial = None  # ([n*m, N, V], [N, n*m]): the rows of merge_states_reference
        for b0 in range(0, s, KEY_BLOCK):
            b1 = min(b0 + KEY_BLOCK, s)
            rows_k = PaddedRows([k_starts[r] for r in batch], lens_k, b0, b1, q.device)
            # Keys and values heads first, [N*n, s, ...]: a copy unless the batch is one request.
            keys = rows_k.take(k_nope).to(acc).permute(2, 0, 1, 3).reshape(num_heads * n, b1 - b0, nope)
            scores = torch.bmm(q_nope, keys.transpose(1, 2)).view(num_heads, n, m, -1)  # [N, n, m, s]
            rope = q_pe @ rows_k.take(k_pe).to(acc).transpose(1, 2)  # [n, N*m, s]
            scores += rope.view(n, num_heads, m, -1).transpose(0, 1)
            masked = rows_k.padded or (causal and m > 1)
            if masked:  # the causal mask also hides padding keys: they lie past every real query's last key
                hidden = torch.arange(b0, b1, device=q.device) > last_key if causal else ~rows_k.valid[:, None, :]
                scores.masked_fill_(hidden, float("-inf"))
            block_lse = torch.logsumexp(scores, dim=-1)  # [N, n, m]
            probs = torch.exp(scores - block_lse.unsqueeze(-1))
            if masked:
                probs.nan_to_num_(0.0)  # queries that see no key of this block
            values = rows_k.take(v).to(acc).permute(2, 0, 1, 3).reshape(num_heads * n, b1 - b0, -1)
            block_out = torch.bmm(probs.view(num_heads * n, m, -1), values).view(num_heads, n, m, -1)
            partial = merge_into(partial, (block_out.permute(1, 2, 0, 3).flatten(0, 1), block_lse.flatten(1)))
        o_i, lse_i = partial
        rows_q.put(out, o_i, 0)
        rows_q.put(lse, lse_i, 1)


def _flash_fits(q: torch.Tensor, n: int, s: int, width: int) -> bool:
    """Whether a batch takes ATen's fused CPU attention: CPU tensors, keys and values of at most
    ``FLASH_LIMIT`` elements once gathered (a larger batch keeps the key-block loop's memory bound)."""
    return q.device.type == "cpu" and _cpu_flash is not None and n * s * q.shape[1] * width <= FLASH_LIMIT


def _flash_attend(q, k_nope, k_pe, v, rows_q, rows_k, softmax_scale, causal, acc):
    """One padded batch through ATen's fused CPU attention (``_scaled_dot_product_flash_attention_for_cpu``:
    it returns the LSE and skips the blocks a causal mask hides) -> ``(out [n*m, N, V], lse [N, n*m])``.

    Causal only where every request has as many queries as keys, so that its top-left mask is the
    bottom-right one and a shorter request's real queries never reach its padding keys. The kernel
    takes one head width: the narrower of ``[k_nope | k_pe]`` and ``v`` is padded with zeros."""
    num_heads, value = q.shape[1], v.shape[-1]
    width = max(q.shape[-1], value)
    keys = torch.cat([rows_k.take(k_nope), rows_k.take(k_pe).unsqueeze(2).expand(-1, -1, num_heads, -1)], dim=-1)

    def heads_first(x):  # [n, w, N, d] -> [n, N, w, width] in acc
        return torch.nn.functional.pad(x.to(acc), (0, width - x.shape[-1])).transpose(1, 2)

    mask = None
    if rows_k.padded and not causal:  # padding keys: -inf (an additive mask, in the inputs' dtype)
        mask = torch.zeros(rows_k.valid.shape, dtype=acc, device=q.device).masked_fill_(~rows_k.valid, float("-inf"))
        mask = mask[:, None, None, :]
    o, lse = _cpu_flash(heads_first(rows_q.take(q)), heads_first(keys), heads_first(rows_k.take(v)), 0.0, causal,
                        attn_mask=mask, scale=softmax_scale)[:2]
    return o[..., :value].transpose(1, 2).flatten(0, 1), lse.transpose(0, 1).flatten(1)


def varlen_attention_reference(q, k_nope, k_pe, v, cu_q, cu_k, softmax_scale, causal):
    acc = lse_dtype(q.dtype)
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=acc)
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc)
    q_bounds, k_bounds = cu_q.tolist(), cu_k.tolist()  # host reads: CPU / oracle path only
    key_lens = [b - a for a, b in zip(k_bounds, k_bounds[1:])]
    _attend(q, k_nope, k_pe, v, q_bounds, k_bounds, key_lens, softmax_scale, causal, out, lse)
    return out, lse


def context_attention_reference(
    q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, softmax_scale, out, lse
) -> None:
    q_bounds, k_bounds = query_start_loc.tolist(), cu_seq_lens.tolist()  # host reads: CPU / oracle path
    key_lens = [b - a for a, b in zip(k_bounds, k_bounds[1:])]
    continues = [start > 0 for start in starts.tolist()]
    # A request starting here overwrites its rows (those without rows here are untouched) ...
    fresh = [0 if c else s for c, s in zip(continues, key_lens)]
    _attend(q, k_nope, k_pe, v, q_bounds, k_bounds, fresh, softmax_scale, False, out, lse)
    # ... one whose rows continue an earlier chunk folds its partial into what earlier chunks left.
    continuing = [s if c else 0 for c, s in zip(continues, key_lens)]
    if any(continuing):
        acc = lse_dtype(q.dtype)
        part_out = out.new_zeros(out.shape, dtype=acc)
        part_lse = lse.new_full(lse.shape, float("-inf"), dtype=acc)
        _attend(q, k_nope, k_pe, v, q_bounds, k_bounds, continuing, softmax_scale, False, part_out, part_lse)
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        rows = torch.repeat_interleave(torch.tensor(continuing, device=q.device) > 0, query_lens)
        rows = torch.cat([rows, rows.new_zeros(q.shape[0] - rows.shape[0])])  # tokens past query_start_loc[-1]
        out[rows], lse[:, rows] = merge_states_reference(out[rows], lse[:, rows], part_out[rows], part_lse[:, rows])


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


def suffix_attention_reference(q, k_nope, k_pe, v, query_start_loc, softmax_scale, out, lse) -> None:
    out.zero_()  # tokens without keys (and past query_start_loc[-1]) get the empty partial
    lse.fill_(float("-inf"))
    bounds = query_start_loc.tolist()  # host read: CPU / oracle path only
    key_lens = [b - a for a, b in zip(bounds, bounds[1:])]
    _attend(q, k_nope, k_pe, v, bounds, bounds, key_lens, softmax_scale, True, out, lse)


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
