"""DESIGN §11's attention variants in the ops: a sliding window in context_attention, suffix_attention,
absorbed_context_attention and sparse_attention (each against a float64 softmax with the window's mask, and
opcheck with the window's arguments), and the sinks' merge (``ops/sinks.py``) against a softmax with the sink
appended as one more score.

A window of w: the query at position p sees keys at positions p - w + 1 .. p.
"""

import math

import pytest
import torch

import mla_ops  # noqa: F401  (registers torch.ops.mla_ops)
from mla_ops.ops import attention
from mla_ops.ops.absorbed import absorbed_reference
from mla_ops.ops.sinks import add_sinks
from tests.support.batches import make_batch, random_varlen

ops = torch.ops.mla_ops
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
NAN = float("nan")


def windowed_attention(q, k_nope, k_pe, v, scale, query_pos, key_pos, window):
    """float64 (out [m, N, V], lse [N, m]) of one request: query at ``query_pos[j]`` sees key ``key_pos[k]``
    iff ``query_pos[j] - window < key_pos[k] <= query_pos[j]``; 0 / -inf where it sees none."""
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, k_nope.shape[1], -1)], dim=-1).double()
    s = torch.einsum("mnd,snd->nms", q.double(), k) * scale
    visible = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] > query_pos[:, None] - window)
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, -1)
    probs = torch.where(visible.any(-1)[None, :, None], torch.softmax(s, -1), 0.0)
    return torch.einsum("nms,snv->mnv", probs, v.double()), lse


@pytest.fixture(params=["op", "oracle"])
def impl(request):
    if request.param == "op":
        return ops.context_attention, ops.suffix_attention
    return attention.context_attention_reference, attention.suffix_attention_reference


@pytest.mark.parametrize("window", [1, 3, 6, 40])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_suffix_attention_in_a_window(window, dtype, tol, impl):
    lens = [1, 17, 5]
    cu, k_nope, k_pe, v, make = random_varlen(lens, dtype=dtype)
    q = make(sum(lens), 2, 12)
    out, lse = torch.empty(sum(lens), 2, 8, dtype=dtype), torch.empty(2, sum(lens), dtype=torch.float64
                                                                       if dtype == torch.float64 else torch.float32)
    impl[1](q, k_nope, k_pe, v, cu, 0.25, out, lse, window)
    for t0, t1 in zip(cu[:-1].tolist(), cu[1:].tolist()):
        pos = torch.arange(t1 - t0)
        want, want_lse = windowed_attention(q[t0:t1], k_nope[t0:t1], k_pe[t0:t1], v[t0:t1], 0.25, pos, pos, window)
        torch.testing.assert_close(out[t0:t1].double(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[:, t0:t1].double(), want_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [4, 6, 9])
def test_context_attention_in_a_window_writes_and_continues(window, impl):
    """A chunk of three requests' windowed rows: request 0 continues an earlier chunk (its starts past its
    window's first position), request 1 begins its window here, request 2 has no rows (untouched). Rows are
    context positions ``starts + k``; query j is position ``c + j``."""
    contexts, q_lens, k_lens = [20, 7, 4], [4, 6, 2], [3, min(7, window - 1), 0]
    first = [max(0, c - window + 1) for c in contexts]
    starts = torch.tensor([first[0] + 1, first[1], 0], dtype=torch.int32)  # request 0: 1 row in an earlier chunk
    k_lens[0] = min(k_lens[0], contexts[0] - int(starts[0]))
    cu_q, _, _, _, make = random_varlen(q_lens)
    cu_k, k_nope, k_pe, v, _ = random_varlen(k_lens, seed=1)
    q = make(sum(q_lens), 2, 12)
    # What the earlier chunk left for request 0: its partial over its window's first row.
    _, prev_nope, prev_pe, prev_v, _ = random_varlen([1], seed=2)
    prev_pos = torch.tensor([first[0]])
    q_pos = [contexts[r] + torch.arange(q_lens[r]) for r in range(3)]
    prev = windowed_attention(q[:q_lens[0]], prev_nope, prev_pe, prev_v, 0.3, q_pos[0], prev_pos, window)
    out = torch.full((sum(q_lens), 2, 8), NAN, dtype=torch.float64)
    lse = torch.full((2, sum(q_lens)), NAN, dtype=torch.float64)
    out[:q_lens[0]], lse[:, :q_lens[0]] = prev
    impl[0](q, k_nope, k_pe, v, cu_q, cu_k, starts, 0.3, out, lse, torch.tensor(contexts, dtype=torch.int32),
            window)
    for r in range(3):
        t0, t1, s0, s1 = int(cu_q[r]), int(cu_q[r + 1]), int(cu_k[r]), int(cu_k[r + 1])
        if s1 == s0:
            assert torch.isnan(out[t0:t1]).all() and torch.isnan(lse[:, t0:t1]).all()
            continue
        keys = k_nope[s0:s1], k_pe[s0:s1], v[s0:s1]
        key_pos = int(starts[r]) + torch.arange(s1 - s0)
        if r == 0:  # merged with the earlier chunk: one softmax over both
            keys = tuple(torch.cat(pair) for pair in zip((prev_nope, prev_pe, prev_v), keys))
            key_pos = torch.cat([prev_pos, key_pos])
        want, want_lse = windowed_attention(q[t0:t1], *keys, 0.3, q_pos[r], key_pos, window)
        torch.testing.assert_close(out[t0:t1], want, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse[:, t0:t1], want_lse, atol=1e-12, rtol=1e-12)
    if window == 4:  # request 0's last query sees no context row, in either chunk: 0 / -inf, merged as empty
        assert torch.isinf(lse[:, q_lens[0] - 1]).all() and (out[q_lens[0] - 1] == 0).all()


def test_context_attention_window_needs_context_lens():
    cu, k_nope, k_pe, v, make = random_varlen([3])
    with pytest.raises(ValueError, match="context_lens"):
        ops.context_attention(make(3, 2, 12), k_nope, k_pe, v, cu, cu, torch.zeros(1, dtype=torch.int32), 0.5,
                              torch.empty(3, 2, 8, dtype=torch.float64), torch.empty(2, 3, dtype=torch.float64),
                              None, 4)


@pytest.mark.parametrize("window", [1, 2, 5, 13, 100])
@pytest.mark.parametrize("fn", ["op", "oracle"])
def test_absorbed_attention_in_a_window(window, fn):
    """The absorbed op reads each request's window itself (context_lens: the whole c_r): equal to the MHA
    partial with the window's mask, 0 / -inf for queries that see no context key."""
    batch = make_batch([9, 0, 13, 3], [4, 2, 7, 1], seed=3, block_size=4, N=3)
    t = batch.q.shape[0]
    out, lse = batch.sentinels(8)
    call = ops.absorbed_context_attention if fn == "op" else absorbed_reference
    call(*batch.absorbed_args(), out, lse, -1, None, window)
    qsl, ctx = batch.query_start_loc.tolist(), batch.context_lens.tolist()
    latent, nope, bs = 16, 8, batch.kv_cache.shape[1]
    for r, c in enumerate(ctx):
        t0, t1 = qsl[r], qsl[r + 1]
        if c == 0:  # untouched
            assert torch.isnan(out[t0:t1]).all()
            continue
        pos = torch.arange(c)
        rows = batch.kv_cache[batch.block_table[r].long()[pos // bs], pos % bs].double()  # [c, L+R]
        kv = (rows[:, :latent] @ batch.kv_b_proj_weight.double().T).view(c, 3, -1)  # [c, N, P+V]
        want, want_lse = windowed_attention(batch.q[t0:t1], kv[..., :nope], rows[:, latent:], kv[..., nope:],
                                            batch.softmax_scale, c + torch.arange(t1 - t0), pos, window)
        torch.testing.assert_close(out[t0:t1], want, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(lse[:, t0:t1], want_lse, atol=1e-10, rtol=1e-10)
    assert t == out.shape[0] and (window > 1 or torch.isinf(lse).sum() > 0)


def test_window_opchecks():
    """Every op whose schema gained the window passes opcheck with it (and with the new context_lens)."""
    cu_q, _, _, _, make = random_varlen([3, 2], dtype=torch.float32)
    cu_k, k_nope, k_pe, v, _ = random_varlen([4, 0], dtype=torch.float32, seed=3)
    q = make(5, 2, 12)
    starts, contexts = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([9, 0], dtype=torch.int32)
    out, lse = torch.randn(5, 2, 8), torch.randn(2, 5)
    torch.library.opcheck(ops.context_attention, (q, k_nope, k_pe, v, cu_q, cu_k, starts, 0.5, out, lse, contexts, 5),
                          test_utils=OPCHECK_UTILS)
    cu, k_nope, k_pe, v, make = random_varlen([3, 2], dtype=torch.float32)
    torch.library.opcheck(ops.suffix_attention,
                          (make(5, 2, 12), k_nope, k_pe, v, cu, 0.5, torch.empty(5, 2, 8), torch.empty(2, 5), 2),
                          test_utils=OPCHECK_UTILS)
    batch = make_batch([4, 0, 9], [2, 1, 3], seed=4, block_size=4, dtype=torch.float32, N=3)
    out, lse = torch.randn(6, 3, 8), torch.randn(3, 6)
    loc = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    torch.library.opcheck(ops.absorbed_context_attention, (*batch.absorbed_args(), out, lse, 5, loc, 3),
                          test_utils=OPCHECK_UTILS)


# ---- sinks ------------------------------------------------------------------------------------


def test_sinks_equal_one_more_score_without_a_value():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 4, 6, generator=g, dtype=torch.float64)  # [N, T, keys]
    scores[:, 1, :] = -math.inf  # token 1 sees no key
    values = torch.randn(6, 3, 5, generator=g, dtype=torch.float64)  # [keys, N, V]
    sinks = torch.tensor([0.5, -2.0, 3.0])
    lse = torch.logsumexp(scores, -1)  # [N, T]
    probs = torch.where(torch.isinf(lse)[..., None], 0.0, torch.softmax(scores, -1))
    out = torch.einsum("ntk,knv->tnv", probs, values)
    got, got_lse = add_sinks(out, lse, sinks)
    with_sink = torch.cat([scores, sinks.double()[:, None, None].expand(3, 4, 1)], -1)
    want = torch.einsum("ntk,knv->tnv", torch.softmax(with_sink, -1)[..., :-1], values)
    torch.testing.assert_close(got, want, atol=1e-14, rtol=0)
    torch.testing.assert_close(got_lse, torch.logsumexp(with_sink, -1), atol=1e-14, rtol=0)
    assert (got[1] == 0).all() and torch.equal(got_lse[:, 1], sinks.double())  # no key: (0, s_h)


def test_sinks_edges():
    out = torch.tensor([[[1.0], [2.0], [NAN]]])  # [T=1, N=3, V=1]
    lse = torch.tensor([[0.5], [-math.inf], [NAN]])
    got, got_lse = add_sinks(out, lse, torch.tensor([-math.inf, -math.inf, 0.0]))
    assert got[0, 0, 0] == 1.0 and got_lse[0, 0] == 0.5  # a -inf sink changes nothing
    assert got[0, 1, 0] == 0.0 and got_lse[1, 0] == -math.inf  # nor for a token without keys: 0 / -inf, not NaN
    assert torch.isnan(got[0, 2, 0]) and torch.isnan(got_lse[2, 0])  # NaN stays NaN
    half, half_lse = add_sinks(torch.full((2, 1, 4), 3.0, dtype=torch.bfloat16), torch.zeros(1, 2),
                               torch.zeros(1))
    assert half.dtype == torch.bfloat16 and (half == 1.5).all()  # sigmoid(0) = 1/2, in out's dtype
    torch.testing.assert_close(half_lse, torch.full((1, 2), math.log(2.0)))


# ---- sparse attention in a window ----------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 4, 30])
def test_sparse_attention_in_a_window(window):
    """The op and the public function: a selected key outside the query's window is not attended; opcheck
    with the window."""
    from mla_ops.ops.sparse import sparse_attention
    from tests.ops.test_sparse import CONTEXTS, QUERIES, SMALL, SPARSE, batch_args
    from tests.support.batches import context_batch
    from tests.support.sparse import masked_reference, random_topk

    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float64, seed=2, **SMALL)
    topk = random_topk(CONTEXTS, QUERIES, 12, seed=3, sparse=SPARSE, empty=0.0)
    out, lse = batch.sentinels(SMALL["V"])
    ops.sparse_attention(*batch_args(batch, SPARSE, topk), out, lse, window)
    want, want_lse, rows = masked_reference(batch, topk, SPARSE, sliding_window=window)
    assert torch.isnan(out[~rows]).all()
    torch.testing.assert_close(out[rows], want[rows], rtol=0, atol=1e-12)
    torch.testing.assert_close(lse[:, rows], want_lse[:, rows], rtol=0, atol=1e-12)
    args = batch_args(batch, SPARSE, topk)
    got, got_lse = sparse_attention(*args[:-1], args[-1], sliding_window=window)
    torch.testing.assert_close(got[rows], want[rows], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="sliding_window"):
        sparse_attention(*args[:-1], args[-1], sliding_window=0)
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, **SMALL)
    t = batch.q.shape[0]
    torch.library.opcheck(ops.sparse_attention, (*batch_args(batch, SPARSE, topk), torch.randn(t, 3, 8),
                                                 torch.randn(3, t), window), test_utils=OPCHECK_UTILS)
