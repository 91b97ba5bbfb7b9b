"""The fast CPU attention: what ``torch.ops.mla_ops`` attention ops run on CPU tensors.

It computes what the oracles compute (``ops/attention.py``, ``ops/absorbed.py``: one softmax per
request, shapes and conventions there), shaped for a CPU, where an op per request costs more than
its math:

* ``padded_batches``: requests of alike sizes are padded into one batched attention; a request
  with many keys attends alone, reading its rows in place (``PaddedRows``: a view where it can);
* a batch of one query over one key each (a decode step's suffix) needs no softmax;
* an MHA batch that fits runs ATen's fused CPU attention (one call, causal blocks skipped);
* the other MHA batches, and every latent batch, loop over blocks of ``KEY_BLOCK`` keys and merge.

Non-finite scores: a query that sees a NaN or inf score (a non-finite input, an overflow) gets NaN, out and
lse, as in the oracles; one that sees no key, the empty partial ``0 / -inf``. ATen's fused kernel turns a NaN
or overflowing score into a finite row, so it runs only where a bound on the batch's scores proves them
finite.

Every branch is checked against float64 softmaxes in ``tests/ops/test_cpu_attention.py``.
"""

from __future__ import annotations

import torch

from .._mla import lse_dtype
from .cache_formats import ds_mla_values
from .merge import merge_into, merge_states_reference, poisoned_rows, scores_nan_for_neg_inf_

# Keys per block of the key-block loops: bounds a score matrix at N x n x m x KEY_BLOCK.
KEY_BLOCK = 4096
# Padding a request into a batch may cost this many multiply-adds for nothing: below it, one more
# batch (a dozen small ops) costs more than the padded work.
PAD_SLACK = 1 << 20
# Score entries (per head) of one key block of a padded batch; a lone request may exceed it.
SCORE_LIMIT = 1 << 20
# A request with more key and value elements than this attends alone, reading them in place:
# batching would copy them heads first, which costs more than the ops it saves.
ALONE_LIMIT = 1 << 16
# Gathered key (or value) elements up to which a batch runs ATen's fused CPU attention (one call, the
# causal half skipped) instead of the key-block loop: 64 MB in float32.
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


# ---- MHA: context_attention and suffix_attention ------------------------------------------------


def attend(q, k_nope, k_pe, v, q_bounds, k_starts, key_lens, softmax_scale, causal, out, lse,
           window_offsets=None) -> None:
    """Request r's queries ``q_bounds[r]:q_bounds[r+1]`` over its ``key_lens[r]`` keys from row
    ``k_starts[r]`` (host lists), written to its rows of ``out``/``lse``; other rows are untouched.
    ``window_offsets`` (a sliding window): per request d_r >= 0, its query j sees only keys k >= j - d_r."""
    acc = lse_dtype(q.dtype)
    num_heads, nope = q.shape[1], k_nope.shape[-1]
    query_lens = [b - a for a, b in zip(q_bounds, q_bounds[1:])]
    width, kv_width = num_heads * (q.shape[-1] + v.shape[-1]), num_heads * (nope + v.shape[-1])
    for batch in padded_batches(query_lens, key_lens, width, KEY_BLOCK, kv_width):
        # One attention per batch, its requests padded: queries [n, m, ...] over keys [n, s, ...].
        lens_q, lens_k = [query_lens[r] for r in batch], [key_lens[r] for r in batch]
        n, m, s = len(batch), max(lens_q), max(lens_k)
        rows_q = PaddedRows([q_bounds[r] for r in batch], lens_q, 0, m, q.device)
        k_rows = [k_starts[r] for r in batch]
        floor = None if window_offsets is None else [window_offsets[r] for r in batch]
        partial = None
        if s == 1 and m == 1:  # one query over one key each (a decode step's suffix; d_r >= 0: in any window)
            partial = _one_key(q, k_nope, k_pe, v, rows_q, PaddedRows(k_rows, lens_k, 0, 1, q.device),
                               softmax_scale, acc)
        elif floor is None and _flash_fits(q, n, s, max(q.shape[-1], v.shape[-1])) and (not causal or lens_q == lens_k):
            partial = _flash_attend(q, k_nope, k_pe, v, rows_q, PaddedRows(k_rows, lens_k, 0, s, q.device),
                                    softmax_scale, causal, acc)  # None: scores that may not be finite
        if partial is None:
            partial = _key_blocks(q, k_nope, k_pe, v, rows_q, k_rows, lens_q, lens_k, softmax_scale, causal, acc,
                                  floor)
        o_i, lse_i = partial
        rows_q.put(out, o_i, 0)
        rows_q.put(lse, lse_i, 1)


def _one_key(q, k_nope, k_pe, v, rows_q, rows_k, softmax_scale, acc):
    """One query over one key per request: the softmax is 1, the output the key's value, the LSE its score."""
    num_heads = q.shape[1]
    keys = torch.cat([rows_k.take(k_nope), rows_k.take(k_pe).unsqueeze(2).expand(-1, -1, num_heads, -1)], -1)
    scores = (rows_q.take(q).to(acc) * keys.to(acc)).sum(-1) * softmax_scale  # [n, 1, N]
    bad = poisoned_rows(scores)  # a non-finite score: NaN out and lse
    values = rows_k.take(v).to(acc).masked_fill(bad.unsqueeze(-1), float("nan"))
    return values.flatten(0, 1), scores.masked_fill(bad, float("nan")).flatten(0, 1).t()


def _key_blocks(q, k_nope, k_pe, v, rows_q, k_rows, lens_q, lens_k, softmax_scale, causal, acc, window_offsets=None):
    """A padded batch over blocks of ``KEY_BLOCK`` keys, merged: scores stay N x n x m x KEY_BLOCK.
    ``window_offsets``: per request d (a sliding window: query j sees keys k >= j - d)."""
    num_heads, nope = q.shape[1], k_nope.shape[-1]
    n, m, s = len(lens_q), max(lens_q), max(lens_k)
    qi = rows_q.take(q).to(acc) * softmax_scale  # [n, m, N, P+R]
    q_nope = qi[..., :nope].permute(2, 0, 1, 3).reshape(num_heads * n, m, nope)  # heads first
    q_pe = qi[..., nope:].transpose(1, 2).reshape(n, num_heads * m, -1)  # [n, N*m, R]: k_pe is shared
    if causal and (m > 1 or min(lens_k) < s):  # bottom-right: query j of m_i sees keys 0 .. s_i - m_i + j
        last_key = torch.tensor([sk - mq for sk, mq in zip(lens_k, lens_q)], device=q.device)[:, None, None]
        last_key = last_key + torch.arange(m, device=q.device)[:, None]  # [n, m, 1]
    if window_offsets is not None:  # query j of request i sees keys from j - d_i on
        first_key = torch.arange(m, device=q.device)[:, None] - torch.tensor(window_offsets, device=q.device)[:, None,
                                                                                                             None]
    partial = None  # ([n*m, N, V], [N, n*m]): the rows of merge_states_reference
    for b0 in range(0, s, KEY_BLOCK):
        b1 = min(b0 + KEY_BLOCK, s)
        rows_k = PaddedRows(k_rows, lens_k, b0, b1, q.device)
        # Keys and values heads first, [N*n, s, ...]: a copy unless the batch is one request.
        keys = rows_k.take(k_nope).to(acc).permute(2, 0, 1, 3).reshape(num_heads * n, b1 - b0, nope)
        scores = torch.bmm(q_nope, keys.transpose(1, 2)).view(num_heads, n, m, -1)  # [N, n, m, s]
        rope = q_pe @ rows_k.take(k_pe).to(acc).transpose(1, 2)  # [n, N*m, s]
        scores += rope.view(n, num_heads, m, -1).transpose(0, 1)
        scores_nan_for_neg_inf_(scores)
        masked = rows_k.padded or (causal and m > 1) or window_offsets is not None
        empty = None
        if masked:  # the causal mask also hides padding keys: they lie past every real query's last key
            hidden = (torch.arange(b0, b1, device=q.device) > last_key if causal and (m > 1 or min(lens_k) < s)
                      else ~rows_k.valid[:, None, :] if rows_k.padded else torch.zeros((), dtype=torch.bool))
            if window_offsets is not None:
                hidden = hidden | (torch.arange(b0, b1, device=q.device) < first_key)
            scores.masked_fill_(hidden, float("-inf"))
            empty = hidden.all(-1)  # [n, m] or [n, 1]: queries that see no key of this block
        block_lse = torch.logsumexp(scores, dim=-1)  # [N, n, m]
        block_lse.masked_fill_(poisoned_rows(block_lse, empty), float("nan"))  # a non-finite score: NaN
        probs = torch.exp(scores - block_lse.unsqueeze(-1))
        if masked:
            probs.masked_fill_(empty.unsqueeze(-1), 0.0)  # the empty partial
        values = rows_k.take(v).to(acc).permute(2, 0, 1, 3).reshape(num_heads * n, b1 - b0, -1)
        block_out = torch.bmm(probs.view(num_heads * n, m, -1), values).view(num_heads, n, m, -1)
        partial = merge_into(partial, (block_out.permute(1, 2, 0, 3).flatten(0, 1), block_lse.flatten(1)))
    return partial


def _flash_fits(q: torch.Tensor, n: int, s: int, width: int) -> bool:
    """Whether a batch takes ATen's fused CPU attention: CPU tensors, keys and values of at most
    ``FLASH_LIMIT`` elements once gathered (a larger batch keeps the key-block loop's memory bound)."""
    return q.device.type == "cpu" and _cpu_flash is not None and n * s * q.shape[1] * width <= FLASH_LIMIT


def _flash_attend(q, k_nope, k_pe, v, rows_q, rows_k, softmax_scale, causal, acc):
    """One padded batch through ATen's fused CPU attention (``_scaled_dot_product_flash_attention_for_cpu``:
    it returns the LSE and skips the blocks a causal mask hides) -> ``(out [n*m, N, V], lse [N, n*m])``, or
    None where the batch's scores may not be finite: the kernel gives a row with a NaN or overflowing score a
    finite output (0, LSE 0), so it runs only where ``max |q * scale| * max |k| * width`` is far inside the
    accumulation dtype (False for any NaN or inf), one pass over the gathered rows; the key-block loop takes
    the others and keeps them NaN.

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
    # The kernel masks before it scales: a scale of 0 would make a masked score -inf * 0 = NaN, a
    # negative one +inf. Scaling q in acc first (one rounding of acc's precision) takes any scale.
    q_scaled = rows_q.take(q).to(acc) * softmax_scale
    bound = float(q_scaled.abs().amax()) * float(keys.abs().amax()) * keys.shape[-1]  # host reads: CPU tensors
    if not bound < torch.finfo(acc).max / 16:
        return None
    o, lse = _cpu_flash(heads_first(q_scaled), heads_first(keys), heads_first(rows_k.take(v)), 0.0, causal,
                        attn_mask=mask, scale=1.0)[:2]
    return o[..., :value].transpose(1, 2).flatten(0, 1), lse.transpose(0, 1).flatten(1)


def window_starts(starts, context_lens, sliding_window: int):
    """A chunk's sliding window on the host (CPU / oracle path): ``(first, offsets)`` per request, the position
    its window's rows begin at (``max(0, c - w + 1)``; 0 without a window) and d with query j seeing the chunk's
    rows k >= j - d (``starts + w - 1 - c``; None without a window)."""
    if not sliding_window:
        return [0] * starts.shape[0], None
    if context_lens is None:
        raise ValueError("context_attention with a sliding_window needs context_lens (the chunk's requests' [n])")
    pairs = list(zip(starts.tolist(), context_lens.tolist()))  # host reads
    return ([max(0, c - sliding_window + 1) for _, c in pairs],
            [start + sliding_window - 1 - c for start, c in pairs])


def context_attention(q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, softmax_scale, out, lse,
                      context_lens=None, sliding_window=0) -> None:
    """``mla_ops::context_attention`` on CPU (arguments: ``ops/attention.py``)."""
    q_bounds, k_bounds = query_start_loc.tolist(), cu_seq_lens.tolist()  # host reads: CPU path
    key_lens = [b - a for a, b in zip(k_bounds, k_bounds[1:])]
    first, offsets = window_starts(starts, context_lens, sliding_window)
    continues = [start > f for start, f in zip(starts.tolist(), first)]
    # A request starting here overwrites its rows (those without rows here are untouched) ...
    fresh = [0 if c else s for c, s in zip(continues, key_lens)]
    attend(q, k_nope, k_pe, v, q_bounds, k_bounds, fresh, softmax_scale, False, out, lse, offsets)
    # ... one whose rows continue an earlier chunk folds its partial into what earlier chunks left.
    continuing = [s if c else 0 for c, s in zip(continues, key_lens)]
    if any(continuing):
        acc = lse_dtype(q.dtype)
        part_out = out.new_zeros(out.shape, dtype=acc)
        part_lse = lse.new_full(lse.shape, float("-inf"), dtype=acc)
        attend(q, k_nope, k_pe, v, q_bounds, k_bounds, continuing, softmax_scale, False, part_out, part_lse, offsets)
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        rows = torch.repeat_interleave(torch.tensor(continuing, device=q.device) > 0, query_lens)
        rows = torch.cat([rows, rows.new_zeros(q.shape[0] - rows.shape[0])])  # tokens past query_start_loc[-1]
        out[rows], lse[:, rows] = merge_states_reference(out[rows], lse[:, rows], part_out[rows], part_lse[:, rows])


def suffix_attention(q, k_nope, k_pe, v, query_start_loc, softmax_scale, out, lse, sliding_window=0) -> None:
    """``mla_ops::suffix_attention`` on CPU (arguments: ``ops/attention.py``)."""
    out.zero_()  # tokens without keys (and past query_start_loc[-1]) get the empty partial
    lse.fill_(float("-inf"))
    bounds = query_start_loc.tolist()  # host read: CPU path
    key_lens = [b - a for a, b in zip(bounds, bounds[1:])]
    offsets = [sliding_window - 1] * len(key_lens) if sliding_window else None
    attend(q, k_nope, k_pe, v, bounds, bounds, key_lens, softmax_scale, True, out, lse, offsets)


# ---- latent: latent_context_attention (and through it absorbed_context_attention) ---------------


def _context_rows(kv_cache, tables, context_lens, begin: int, end: int, k_scale, acc, first=None):
    """Context rows ``begin:end`` of each request (``tables`` [n, max_blocks] its block table rows),
    dequantized, in ``acc``: ``(rows [n, end - begin, L+R], valid [n, end - begin])``; rows past a
    request's context repeat its first row (a valid block) and are not valid (None: no padding).
    ``first``: per request, the context position its row 0 is (a sliding window's; None: 0), with
    ``context_lens`` its rows from there."""
    position, valid = torch.arange(begin, end, device=kv_cache.device).expand(len(context_lens), -1), None
    if min(context_lens) < end:
        valid = position < torch.tensor(context_lens, device=kv_cache.device)[:, None]
        position = torch.where(valid, position, 0)
    if first is not None:
        position = position + torch.tensor(first, device=kv_cache.device)[:, None]
    block_size = kv_cache.shape[1]
    slots = tables.gather(1, position // block_size) * block_size + position % block_size
    # One gather of whole rows (flatten is a view for any cache whose blocks are evenly strided).
    rows = kv_cache.flatten(0, 1).index_select(0, slots.flatten()).unflatten(0, slots.shape)
    if kv_cache.dtype == torch.uint8:  # fp8_ds_mla rows
        return ds_mla_values(rows, acc), valid
    if kv_cache.dtype == torch.float8_e4m3fn:
        rows = rows.float().to(acc) * k_scale.to(acc)
    return rows.to(acc), valid


def _latent_partial(qr, rows, valid, latent: int, hidden=None):
    """Non-causal attention of a padded batch over one key block in the latent space.

    qr [n, m, H, L+R]: scaled queries ``[q_lat | q_pe]``; rows [n, s, L+R], valid [n, s] or None; hidden
    [n, m, s] or None: keys a query may not see (a sliding window)
    -> ``(o_lat [n*m, H, L], lse [H, n*m])``, the layout of ``merge_states_reference``.
    """
    n, m, heads, _ = qr.shape
    scores = torch.bmm(qr.flatten(1, 2), rows.transpose(1, 2))  # [n, m*H, s]: q_lat . kv_c + q_pe . k_pe
    scores_nan_for_neg_inf_(scores)
    empty = None
    if hidden is not None:  # padding rows too
        valid = ~hidden if valid is None else valid[:, None, :] & ~hidden  # [n, m, s]
        scores.view(n, m, heads, -1).masked_fill_(~valid[:, :, None, :], float("-inf"))
        empty = (~valid.any(-1)).repeat_interleave(heads, 1)  # [n, m*H]: queries that see no key of the block
    elif valid is not None:  # padding rows
        scores.masked_fill_(~valid[:, None, :], float("-inf"))
        empty = ~valid.any(1, keepdim=True)  # [n, 1]: a block past a short context
    block_lse = torch.logsumexp(scores, dim=-1)  # [n, m*H]
    block_lse.masked_fill_(poisoned_rows(block_lse, empty), float("nan"))  # a non-finite score: NaN
    probs = torch.exp(scores - block_lse.unsqueeze(-1))
    if empty is not None:
        probs.masked_fill_(empty.unsqueeze(-1), 0.0)  # the empty partial
    return torch.bmm(probs, rows[..., :latent]).view(n * m, heads, latent), block_lse.view(n * m, heads).t()


def latent_context_attention(q, kv_cache, block_table, query_start_loc, context_lens, softmax_scale, k_scale,
                             out, lse, sliding_window=0) -> None:
    """``mla_ops::latent_context_attention`` on CPU (arguments: ``ops/absorbed.py``); ``sliding_window`` w: query
    j of a request with c context rows reads only positions ``c + j - w + 1 ..`` (the rows from ``c - w + 1``)."""
    acc = lse_dtype(q.dtype)
    latent = out.shape[2]
    bounds, contexts = query_start_loc.tolist(), context_lens.tolist()  # host reads: CPU path
    query_lens = [b - a for a, b in zip(bounds, bounds[1:])]
    first = None
    if sliding_window:  # each request's window rows: its last min(c, w - 1), from position `first` on
        first = [max(0, c - sliding_window + 1) for c in contexts]
        contexts = [c - f for c, f in zip(contexts, first)]
    for batch in padded_batches(query_lens, contexts, q.shape[1] * (q.shape[2] + latent), KEY_BLOCK):
        # One attention per batch of requests padded to [n, m] queries and [n, s] context rows.
        lens_q, lens_k = [query_lens[r] for r in batch], [contexts[r] for r in batch]
        s = max(lens_k)
        rows_q = PaddedRows([bounds[r] for r in batch], lens_q, 0, max(lens_q), q.device)
        qr = rows_q.take(q).to(acc) * softmax_scale  # [n, m, H, L+R]
        tables = block_table if batch == list(range(len(contexts))) else block_table.index_select(
            0, torch.tensor(batch, device=block_table.device))
        firsts = None if first is None else [first[r] for r in batch]
        if firsts is not None:  # query j sees row k iff k >= j - d, d = w - 1 - rows (positions c + j - w + 1 ..)
            d = torch.tensor([sliding_window - 1 - n for n in lens_k], device=q.device)[:, None, None]
            first_key = torch.arange(qr.shape[1], device=q.device)[:, None] - d  # [n, m, 1]
        partial = None
        for k0 in range(0, s, KEY_BLOCK):
            k1 = min(k0 + KEY_BLOCK, s)
            rows, valid = _context_rows(kv_cache, tables, lens_k, k0, k1, k_scale, acc, firsts)
            hidden = None if firsts is None else torch.arange(k0, k1, device=q.device) < first_key
            partial = merge_into(partial, _latent_partial(qr, rows, valid, latent, hidden))
        o_lat, lse_lat = partial
        rows_q.put(out, o_lat, 0)
        rows_q.put(lse, lse_lat, 1)
