"""The tests' shared batches: a dense float64 MLA reference written from DESIGN.md (independently
of the library), random paged batches (``make_batch``, ``paged_cache``), and model steps
(``model_step``, ``spread_weights``).

    q        [T, N, P+R]   rotated queries of the new tokens
    kv_c     [T, L]        latent of the new tokens          k_pe [T, R]
    kv_cache [num_blocks, block_size, L+R]   rows [kv_c (L) | k_pe (R)]
    block_table [B, max_blocks] int32   query_start_loc [B+1] int32   context_lens [B] int32
    kv_b_proj_weight [N*(P+V), L]
    -> out   [T, N, V]
"""

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

import mla_ops

FP8 = torch.float8_e4m3fn
NAN = float("nan")

# Tolerance on max |out - ref| / max(1, max |ref|), per output dtype.
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2}


def paged_block_table(blocks_per_request, generator, *, spare_blocks=3, pad_cols=0):
    """``(num_blocks, table [B, max blocks + pad_cols] int32)``: request r's blocks at shuffled
    places of a cache with ``spare_blocks`` never-referenced blocks; pad columns hold valid ids."""
    num_blocks = sum(blocks_per_request) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    cols = max(max(blocks_per_request, default=0) + pad_cols, 1)
    table = torch.randint(0, num_blocks, (len(blocks_per_request), cols), generator=generator, dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks_per_request):
        table[r, :n] = order[used : used + n]
        used += n
    return num_blocks, table


def paged_cache(context_lens, block_size, width, seed, dtype=torch.float32, pad_cols=2, spare_blocks=2):
    """``(kv_cache [num_blocks, block_size, width], block_table int32, context_lens int32)``: random
    rows, each request's context in shuffled blocks (``paged_block_table``)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, table = paged_block_table([-(-c // block_size) for c in context_lens], g,
                                          spare_blocks=spare_blocks, pad_cols=pad_cols)
    cache = torch.randn(num_blocks, block_size, width, generator=g).to(dtype)
    return cache, table, torch.tensor(context_lens, dtype=torch.int32)


# --------------------------------------------------------------------------------------------
# Dense reference (float64, unchunked, one softmax per request)
# --------------------------------------------------------------------------------------------


def _k_scale_value(k_scale):
    if k_scale is None:
        return None
    if isinstance(k_scale, torch.Tensor):
        return float(k_scale.reshape(-1)[0].item())
    return float(k_scale)


def _dims(q, k_pe, kv_cache, w):
    N = q.shape[1]
    R = k_pe.shape[1]
    P = q.shape[2] - R
    L = kv_cache.shape[2] - R
    V = w.shape[0] // N - P
    return N, L, P, R, V


def _request_keys(r, q, kv_c, k_pe, kv_cache, block_table, qsl, ctx, k_scale):
    """Latent rows [S, L], rope keys [S, R] and queries [q_r, N, P+R] of request r, float64.

    The S = c_r + q_r keys are the c_r context rows gathered from the paged cache followed by
    the request's q_r new tokens.
    """
    R = k_pe.shape[1]
    L = kv_cache.shape[2] - R
    bs = kv_cache.shape[1]
    s, e, c = qsl[r], qsl[r + 1], ctx[r]
    pos = torch.arange(c)
    blocks = block_table[r].long()[pos // bs]
    rows = kv_cache[blocks, pos % bs].double()  # [c, L+R]
    scale = _k_scale_value(k_scale)
    if scale is not None:
        rows = rows * scale
    latent = torch.cat([rows[:, :L], kv_c[s:e].double()])  # [S, L]
    rope = torch.cat([rows[:, L:], k_pe[s:e].double()])  # [S, R]
    return latent, rope, q[s:e].double()


def _mask(q_len, c, sliding_window=None):
    """[q_len, c + q_len] bool: all context keys, causal over the new keys; with a sliding window w, query
    i (position c + i) sees only keys at positions c + i - w + 1 .. c + i."""
    i = torch.arange(q_len)[:, None]
    j = torch.arange(c + q_len)[None, :]
    visible = (j < c) | (j - c <= i)
    if sliding_window is not None:
        visible &= j >= c + i - sliding_window + 1
    return visible


def dense_reference(q, kv_c, k_pe, kv_cache, block_table, query_start_loc, context_lens,
                    kv_b_proj_weight, softmax_scale, k_scale=None, *, return_lse=False, sliding_window=None,
                    sinks=None):
    """Float64 [T, N, V]: per request, all keys/values built at once, one masked softmax; with
    ``return_lse``, also the softmax's log-sum-exp [N, T] (natural log). The attention variants of DESIGN
    §11: ``sliding_window`` w masks keys before position c_r + j - w + 1; ``sinks`` [N] appends one more
    score per head, ``sinks[n]``, to every softmax, a key whose value is 0."""
    N, L, P, R, V = _dims(q, k_pe, kv_cache, kv_b_proj_weight)
    qsl = [int(x) for x in query_start_loc.tolist()]
    ctx = [int(x) for x in context_lens.tolist()]
    w = kv_b_proj_weight.double()
    out = torch.zeros(q.shape[0], N, V, dtype=torch.float64)
    lse = torch.full((N, q.shape[0]), float("-inf"), dtype=torch.float64)
    for r in range(len(ctx)):
        s, e, c = qsl[r], qsl[r + 1], ctx[r]
        if e == s:
            continue
        latent, rope, qr = _request_keys(r, q, kv_c, k_pe, kv_cache, block_table, qsl, ctx,
                                         k_scale)
        kv = (latent @ w.T).view(-1, N, P + V)  # [S, N, P+V]
        k = torch.cat([kv[..., :P], rope[:, None, :].expand(-1, N, R)], dim=-1)  # [S, N, P+R]
        v = kv[..., P:]  # [S, N, V]
        scores = torch.einsum("qnd,knd->nqk", qr, k) * softmax_scale  # [N, q_r, S]
        scores = scores.masked_fill(~_mask(e - s, c, sliding_window), float("-inf"))
        if sinks is not None:  # the sink: one more column of scores, with no value
            sink = sinks.double()[:, None, None].expand(N, e - s, 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        if sinks is not None:
            probs = probs[..., :-1]
        out[s:e] = torch.einsum("nqk,knd->qnd", probs, v)
        lse[:, s:e] = torch.logsumexp(scores, dim=-1)
    return (out, lse) if return_lse else out


def sdpa_reference(q, kv_c, k_pe, kv_cache, block_table, query_start_loc, context_lens,
                   kv_b_proj_weight, softmax_scale, k_scale=None):
    """Same as dense_reference, through F.scaled_dot_product_attention (self-check only)."""
    N, L, P, R, V = _dims(q, k_pe, kv_cache, kv_b_proj_weight)
    qsl, ctx = query_start_loc.tolist(), context_lens.tolist()
    w = kv_b_proj_weight.double()
    out = torch.zeros(q.shape[0], N, V, dtype=torch.float64)
    for r in range(len(ctx)):
        s, e, c = qsl[r], qsl[r + 1], ctx[r]
        latent, rope, qr = _request_keys(r, q, kv_c, k_pe, kv_cache, block_table, qsl, ctx,
                                         k_scale)
        kv = (latent @ w.T).view(-1, N, P + V)
        k = torch.cat([kv[..., :P], rope[:, None, :].expand(-1, N, R)], dim=-1)
        o = F.scaled_dot_product_attention(
            qr.transpose(0, 1)[None], k.transpose(0, 1)[None],
            kv[..., P:].transpose(0, 1)[None], attn_mask=_mask(e - s, c), scale=softmax_scale)
        out[s:e] = o[0].transpose(0, 1)
    return out


def absorbed_reference(q, kv_c, k_pe, kv_cache, block_table, query_start_loc, context_lens,
                       kv_b_proj_weight, softmax_scale, k_scale=None):
    """Same math in the absorbed ("MQA") form of DESIGN §1 (self-check only)."""
    N, L, P, R, V = _dims(q, k_pe, kv_cache, kv_b_proj_weight)
    qsl, ctx = query_start_loc.tolist(), context_lens.tolist()
    w = kv_b_proj_weight.double().view(N, P + V, L)
    w_uk, w_uv = w[:, :P], w[:, P:]  # [N, P, L], [N, V, L]
    out = torch.zeros(q.shape[0], N, V, dtype=torch.float64)
    for r in range(len(ctx)):
        s, e, c = qsl[r], qsl[r + 1], ctx[r]
        latent, rope, qr = _request_keys(r, q, kv_c, k_pe, kv_cache, block_table, qsl, ctx,
                                         k_scale)
        q_lat = torch.einsum("qnp,npl->qnl", qr[..., :P], w_uk)  # [q_r, N, L]
        scores = (torch.einsum("qnl,kl->nqk", q_lat, latent)
                  + torch.einsum("qnr,kr->nqk", qr[..., P:], rope)) * softmax_scale
        scores = scores.masked_fill(~_mask(e - s, c), float("-inf"))
        o_lat = torch.einsum("nqk,kl->qnl", torch.softmax(scores, -1), latent)  # [q_r, N, L]
        out[s:e] = torch.einsum("qnl,nvl->qnv", o_lat, w_uv)
    return out


# --------------------------------------------------------------------------------------------
# Dense float64 partials of the attention ops (with LSEs)
# --------------------------------------------------------------------------------------------


def dense_attention(q, k_nope, k_pe, v, scale, causal):
    """float64 softmax attention of one request: q [m, N, P+R], keys [s, ...] -> out, lse."""
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, k_nope.shape[1], -1)], dim=-1).double()
    s = torch.einsum("mnd,snd->nms", q.double(), k) * scale
    if causal:
        m, n = q.shape[0], k.shape[0]
        s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(m)[:, None] + (n - m), -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.einsum("nms,snv->mnv", torch.softmax(s, -1), v.double()), lse


def random_varlen(lens, num_heads=2, nope=8, rope=4, value=8, dtype=torch.float64, seed=0):
    """``(cu [B+1] int32, k_nope [S, N, P], k_pe [S, R], v [S, N, V], make)`` for requests of ``lens``
    keys; ``make(*shape)`` draws more from the same generator (the queries)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return cu, make(total, num_heads, nope), make(total, rope), make(total, num_heads, value), make


def dense_mha_partial(batch):
    """float64 (out [T, N, V], lse [N, T]) by the MHA formula: up-projected keys, one softmax per request."""
    q, cache, w = batch.q.double(), batch.kv_cache, batch.kv_b_proj_weight.double()
    num_heads, latent, nope, rope, value = _dims(batch.q, batch.k_pe, cache, batch.kv_b_proj_weight)
    out = torch.zeros(q.shape[0], num_heads, value, dtype=torch.float64)
    lse = torch.full((num_heads, q.shape[0]), -math.inf, dtype=torch.float64)
    qsl, ctx = batch.query_start_loc.tolist(), batch.context_lens.tolist()
    for r, c in enumerate(ctx):
        t0, t1 = qsl[r], qsl[r + 1]
        pos = torch.arange(c)
        rows = cache[batch.block_table[r].long()[pos // cache.shape[1]], pos % cache.shape[1]].double()
        if batch.k_scale is not None:
            rows = rows * batch.k_scale.double()
        kv = (rows[:, :latent] @ w.T).view(c, num_heads, nope + value)  # [c, N, P+V]
        k = torch.cat([kv[..., :nope], rows[:, None, latent:].expand(c, num_heads, rope)], dim=-1)
        scores = torch.einsum("mnd,cnd->nmc", q[t0:t1], k) * batch.softmax_scale  # [N, m, c]
        lse[:, t0:t1] = torch.logsumexp(scores, -1)
        out[t0:t1] = torch.einsum("nmc,cnv->mnv", torch.softmax(scores, -1), kv[..., nope:])
    return out, lse


# --------------------------------------------------------------------------------------------
# Random batches
# --------------------------------------------------------------------------------------------


@dataclass
class Batch:
    q: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    kv_b_proj_weight: torch.Tensor
    softmax_scale: float
    k_scale: object = None

    def args(self):
        return (self.q, self.kv_c, self.k_pe, self.kv_cache, self.block_table,
                self.query_start_loc, self.context_lens, self.kv_b_proj_weight,
                self.softmax_scale)

    def reference(self):
        return dense_reference(*self.args(), k_scale=self.k_scale)

    def run(self, **kwargs):
        kwargs.setdefault("backend", "torch")
        if "plan" not in kwargs:
            kwargs.setdefault("absorb_max_query_len", 0)  # the chunked path; tests/prefill/test_routing.py sweeps
        if self.k_scale is not None:
            kwargs.setdefault("k_scale", self.k_scale)
        return mla_ops.mla_prefill(*self.args(), **kwargs)

    def absorbed_args(self):
        """The absorbed op's arguments before ``out, lse``: (q, kv_cache, block_table,
        query_start_loc, context_lens, kv_b_proj_weight, softmax_scale, k_scale as a tensor or None)."""
        k_scale = self.k_scale
        if k_scale is not None and not isinstance(k_scale, torch.Tensor):
            k_scale = torch.tensor([float(k_scale)], dtype=torch.float32)
        return (self.q, self.kv_cache, self.block_table, self.query_start_loc, self.context_lens,
                self.kv_b_proj_weight, self.softmax_scale, k_scale)

    def sentinels(self, value_dim, dtype=None):
        """out [T, N, V] and lse [N, T] filled with NaN: rows left untouched stay NaN."""
        t, n = self.q.shape[:2]
        lse_dtype = torch.float64 if self.q.dtype == torch.float64 else torch.float32
        return (torch.full((t, n, value_dim), NAN, dtype=dtype or self.q.dtype),
                torch.full((n, t), NAN, dtype=lse_dtype))

    def to(self, device, dtype):
        """The batch on ``device``: q, kv_c, k_pe, the weight and a 16-64 bit cache in ``dtype``
        (an fp8 cache and k_scale keep theirs)."""
        cache = self.kv_cache if self.kv_cache.dtype == FP8 else self.kv_cache.to(dtype)
        k_scale = self.k_scale.to(device) if isinstance(self.k_scale, torch.Tensor) else self.k_scale
        return replace(self, q=self.q.to(device, dtype), kv_c=self.kv_c.to(device, dtype),
                       k_pe=self.k_pe.to(device, dtype), kv_cache=cache.to(device),
                       kv_b_proj_weight=self.kv_b_proj_weight.to(device, dtype),
                       block_table=self.block_table.to(device), query_start_loc=self.query_start_loc.to(device),
                       context_lens=self.context_lens.to(device), k_scale=k_scale)

    def tensors(self):
        ts = dict(q=self.q, kv_c=self.kv_c, k_pe=self.k_pe, kv_cache=self.kv_cache,
                  block_table=self.block_table, query_start_loc=self.query_start_loc,
                  context_lens=self.context_lens, kv_b_proj_weight=self.kv_b_proj_weight)
        if isinstance(self.k_scale, torch.Tensor):
            ts["k_scale"] = self.k_scale
        return ts


def make_batch(context_lens, query_lens, *, seed, block_size=16, N=2, L=16, P=8, R=4, V=8,
               dtype=torch.float64, pad_cols=2, garbage_blocks=3, noncontig=None, table_layout=None,
               nan_fill=False, fp8_scale=None, k_scale_as_tensor=False, q_mult=1.0):
    """A random batch with a shuffled paged cache.

    Blocks are handed out in a random permutation of the block ids; `garbage_blocks` blocks
    are never referenced and every unused slot holds random data (NaN with `nan_fill`, so that a
    load that is not masked out shows). Block table rows carry `pad_cols` extra columns of
    arbitrary (valid) block ids. `noncontig` in {None, "slice", "step", "colmajor"} makes
    block_table, q, kv_c and k_pe non-contiguous; `table_layout` (same values) sets the block
    table's layout alone. With `fp8_scale`, the cache is float8_e4m3fn:
    `(x / k_scale).to(float8_e4m3fn)`.
    """
    assert len(context_lens) == len(query_lens) and all(n >= 0 for n in query_lens)
    g = torch.Generator().manual_seed(seed)
    B, T = len(context_lens), sum(query_lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    num_blocks, table = paged_block_table([math.ceil(c / block_size) for c in context_lens], g,
                                          spare_blocks=garbage_blocks, pad_cols=pad_cols)

    layout = noncontig if table_layout is None else table_layout
    if layout == "slice":  # a column slice of a wider int32 tensor
        wide = torch.randint(0, num_blocks, (B, table.shape[1] + 5), generator=g,
                             dtype=torch.int32)
        wide[:, 3:3 + table.shape[1]] = table
        table = wide[:, 3:3 + table.shape[1]]
    elif layout == "step":  # every other column of a wider tensor
        wide = torch.zeros(B, 2 * table.shape[1], dtype=torch.int32)
        wide[:, ::2] = table
        table = wide[:, ::2]
    elif layout == "colmajor":
        table = table.t().contiguous().t()

    rows = rnd(num_blocks, block_size, L + R)
    if nan_fill:
        used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for r, c in enumerate(context_lens):
            pos = torch.arange(c)
            used[table[r].long()[pos // block_size], pos % block_size] = True
        rows[~used] = NAN
    if fp8_scale is None:
        cache = rows.to(dtype)
        k_scale = None
    else:
        cache = (rows * 1.5 / fp8_scale).to(FP8)
        k_scale = (torch.tensor([fp8_scale], dtype=torch.float32) if k_scale_as_tensor
                   else float(fp8_scale))

    if noncontig:
        q = (rnd(T, N + 1, P + R + 3) * q_mult).to(dtype)[:, 1:, 2:2 + P + R]
        lat = rnd(T, L + R + 2).to(dtype)  # a fused [kv_c | k_pe | pad] projection output
        kv_c, k_pe = lat[:, :L], lat[:, L:L + R]
    else:
        q = (rnd(T, N, P + R) * q_mult).to(dtype)
        kv_c, k_pe = rnd(T, L).to(dtype), rnd(T, R).to(dtype)
    w = (rnd(N * (P + V), L) / math.sqrt(L)).to(dtype)

    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(),
                       dtype=torch.int32)
    return Batch(q=q, kv_c=kv_c, k_pe=k_pe, kv_cache=cache, block_table=table,
                 query_start_loc=qsl,
                 context_lens=torch.tensor(context_lens, dtype=torch.int32),
                 kv_b_proj_weight=w, softmax_scale=1.0 / math.sqrt(P + R), k_scale=k_scale)


def context_batch(context_lens, query_lens, *, seed=0, **kwargs):
    """``make_batch`` as the context-partial tests (absorbed and latent attention) use it: the cache
    NaN outside the context rows, a block table with column stride 2, k_scale a tensor."""
    kwargs = {"nan_fill": True, "table_layout": "step", "k_scale_as_tensor": True, **kwargs}
    return make_batch(context_lens, query_lens, seed=seed, **kwargs)


def written_rows(batch):
    """bool [T]: tokens of requests with context (the rows a context partial must write)."""
    lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).long().cpu()
    return torch.repeat_interleave(batch.context_lens.cpu() > 0, lens)


def assert_partial(out, lse, expect_out, expect_lse, written, tol):
    """A context partial (out [T, N, V], lse [N, T]) equals the expected one on the written rows;
    the other rows are still NaN."""
    assert torch.isnan(out[~written]).all() and torch.isnan(lse[:, ~written]).all(), "zero-context rows touched"
    err = (out[written].double() - expect_out[written]).abs().max().item() if written.any() else 0.0
    lse_err = (lse[:, written].double() - expect_lse[:, written]).abs().max().item() if written.any() else 0.0
    assert err <= tol and lse_err <= tol, f"max abs diff out {err:.3e}, lse {lse_err:.3e} (tol {tol:.0e})"


def random_lens(g, B, max_ctx, max_q, zero_at=(0,)):
    """Random context lens (forced zero at the indices in `zero_at`) and query lens >= 1."""
    ctx = torch.randint(0, max_ctx + 1, (B,), generator=g).tolist()
    for i in zero_at:
        ctx[i] = 0
    ql = torch.randint(1, max_q + 1, (B,), generator=g).tolist()
    return ctx, ql


def assert_close_to_reference(out, ref, dtype, what=""):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == dtype, f"{what}: dtype {out.dtype} != {dtype}"
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    scale = max(1.0, ref.abs().max().item() if ref.numel() else 0.0)
    assert err <= TOL[dtype] * scale, (
        f"{what}: max abs diff {err:.3e} > {TOL[dtype]:.0e} * {scale:.3g} ({dtype})")


# Batches of one capacity bucket (<= 4 chunks of 16 rows): sizes, zero contexts first/middle/last,
# contexts longer than the workspace, no context at all.
BUCKET_4 = [
    ([5, 0, 13], [3, 2, 4]),
    ([7, 9, 0, 2, 11], [1, 2, 3, 4, 5]),
    ([0, 0], [3, 3]),
    ([20, 20, 9], [2, 5, 3]),
    ([0, 40, 0], [2, 6, 2]),
    ([63, 1], [4, 4]),
    ([1, 1, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2]),
    ([17, 0], [9, 2]),
    ([0, 3], [2, 2]),
    ([16, 16, 16, 16], [2, 3, 2, 3]),
    ([33, 2, 0, 0, 5, 8, 12], [3, 1, 2, 2, 3, 1, 4]),
    ([50, 0, 0, 14], [7, 3, 2, 5]),
]


# Query lens 1..40 so thresholds 0, 8 and 64 route none, some and all requests with context.
ROUTING_MIX = ([0, 37, 5, 0, 90, 12, 64, 1], [3, 1, 40, 2, 8, 17, 5, 30])


def model_step(config, context_lens, query_lens, seed, num_blocks=64, block_size=4, max_blocks=20):
    """Inputs of one prefill step whose new tokens go right after each request's context."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens)]
    _, table = paged_block_table(blocks, g, spare_blocks=num_blocks - sum(blocks), pad_cols=max_blocks - max(blocks))
    slots = [int(table[r, p // block_size]) * block_size + p % block_size
             for r, (c, q) in enumerate(zip(context_lens, query_lens)) for p in range(c, c + q)]
    return (
        torch.randint(0, config.vocab_size, (sum(query_lens),), generator=g),
        torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)]),
        torch.tensor(slots, dtype=torch.long),
        table,
        torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        torch.tensor(context_lens, dtype=torch.int32),
    )


def spread_weights(module, seed):
    """Re-draw weights at ~1/sqrt(fan_in) scale (and norm gains around 1) so attention is far from
    uniform; the default init (std 0.02) would make every softmax nearly flat."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * p.shape[1] ** -0.5 * 1.5)
            else:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return module


@torch.no_grad()
def tiny_model(seed: int = 0) -> mla_ops.MLAForCausalLM:
    """The "tiny" config with weights at ~1.5/sqrt(fan_in): greedy tokens vary (the default init's
    flat softmaxes would repeat one token)."""
    torch.manual_seed(seed)
    model = mla_ops.MLAForCausalLM(mla_ops.MLAConfig.from_name("tiny")).eval()
    for p in model.parameters():
        p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5 * 1.5 if p.dim() >= 2 else 1 + 0.3 * torch.randn(p.shape))
    return model


def map_caches(fn, caches):
    """``fn`` applied to each tensor of a model's caches (a ``KVCaches``, or a list per layer), in the same form."""
    if isinstance(caches, mla_ops.KVCaches):
        return replace(caches, latent=map_caches(fn, caches.latent),
                       index=None if caches.index is None else map_caches(fn, caches.index))
    return [fn(t) for t in caches]


def clone_caches(caches):
    return map_caches(torch.clone, caches)


def normal_caches(caches):
    """``caches`` filled with standard normal values in place (the global generator), returned."""
    map_caches(torch.nn.init.normal_, caches)
    return caches


def caches_equal(a, b) -> bool:
    flat = lambda c: list(c.tensors if isinstance(c, mla_ops.KVCaches) else c)  # noqa: E731
    return len(flat(a)) == len(flat(b)) and all(torch.equal(x, y) for x, y in zip(flat(a), flat(b)))


def cache_list(caches):
    """A model's caches as a list of tensors (a ``KVCaches``' latent then index caches), for ``assert_close``."""
    return list(caches.tensors) if isinstance(caches, mla_ops.KVCaches) else caches
