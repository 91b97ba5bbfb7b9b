"""Each operator against an obvious per-row implementation, plus opcheck."""

import math

import pytest
import torch

import mla_ops  # noqa: F401  (registers torch.ops.mla_ops)

ops = torch.ops.mla_ops
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


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
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return cu, make(total, num_heads, nope), make(total, rope), make(total, num_heads, value), make


# ---- merge_attn_states -------------------------------------------------------------------------


def test_merge_matches_concatenated_softmax():
    torch.manual_seed(0)
    q_lens, n, v = 5, 3, 4
    sa, sb = torch.randn(n, q_lens, 6, dtype=torch.float64), torch.randn(n, q_lens, 9, dtype=torch.float64)
    va, vb = torch.randn(6, n, v, dtype=torch.float64), torch.randn(9, n, v, dtype=torch.float64)
    part = lambda s, vals: (torch.einsum("nms,snv->mnv", s.softmax(-1), vals), s.logsumexp(-1))  # noqa: E731
    (oa, la), (ob, lb) = part(sa, va), part(sb, vb)
    out, lse = mla_ops.merge_attn_states(oa, la, ob, lb)
    expect_out, expect_lse = part(torch.cat([sa, sb], -1), torch.cat([va, vb]))
    torch.testing.assert_close(out, expect_out, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, expect_lse, rtol=0, atol=1e-13)


@pytest.mark.parametrize("empty_lse", [float("-inf"), float("inf")])
def test_merge_is_empty_safe(empty_lse):
    t, n, v = 4, 2, 3
    out_a = torch.randn(t, n, v)
    lse_a = torch.randn(n, t)
    empty_out = torch.full((t, n, v), 7.0)  # garbage in an empty partial must not leak
    empty_lse_t = torch.full((n, t), empty_lse)
    out, lse = mla_ops.merge_attn_states(out_a, lse_a, empty_out, empty_lse_t)
    torch.testing.assert_close(out, out_a)
    torch.testing.assert_close(lse, lse_a)
    out, lse = mla_ops.merge_attn_states(empty_out, empty_lse_t, empty_out, empty_lse_t)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.all(lse == float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_low_precision(dtype):
    torch.manual_seed(1)
    oa, ob = torch.randn(17, 4, 8), torch.randn(17, 4, 8)
    la, lb = torch.randn(4, 17) * 3, torch.randn(4, 17) * 3
    expect, expect_lse = mla_ops.merge_attn_states(oa.double(), la.double(), ob.double(), lb.double())
    out, lse = mla_ops.merge_attn_states(oa.to(dtype), la, ob.to(dtype), lb)
    assert out.dtype == dtype and lse.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expect, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), expect_lse, atol=1e-5, rtol=1e-5)


def test_merge_rejects_mismatched_layout():
    o = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match="prefix_lse"):
        mla_ops.merge_attn_states(o, torch.randn(3, 2), o, torch.randn(2, 3))


def test_merge_opcheck():
    o, l = torch.randn(5, 2, 4), torch.randn(2, 5)
    l[0, 1] = float("-inf")
    torch.library.opcheck(ops.merge_attn_states, (o, l, torch.randn(5, 2, 4), torch.randn(2, 5)),
                          test_utils=OPCHECK_UTILS)
    # Permuted-dense inputs (heads-first outputs, tokens-first LSEs seen as [N, T]): the fake's
    # contiguous strides must be what the real op returns.
    o_p, l_p = torch.randn(2, 5, 4).transpose(0, 1), torch.randn(5, 2).t()
    torch.library.opcheck(ops.merge_attn_states, (o_p, l_p, torch.randn(4, 5, 2).permute(1, 2, 0), l_p),
                          test_utils=OPCHECK_UTILS)


# ---- gather_context ----------------------------------------------------------------------------


def make_cache(block_size, num_blocks=24, width=6, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, block_size, width, generator=g).to(dtype)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_gather_rows_from_any_start(block_size):
    cache = make_cache(block_size, num_blocks=64)
    g = torch.Generator().manual_seed(block_size)
    table = torch.randperm(64, generator=g).to(torch.int32).view(4, 16)
    starts = torch.tensor([3, 0, 0, 5], dtype=torch.int32)
    seq_lens = [6, 1, 0, 9]
    cu = torch.tensor([0, 6, 7, 7, 16], dtype=torch.int32)
    workspace = torch.full((20, 6), float("nan"))
    ops.gather_context(cache, table, cu, starts, None, workspace)
    expect = [cache[table[i, p // block_size], p % block_size]
              for i in range(4) for p in range(int(starts[i]), int(starts[i]) + seq_lens[i])]
    assert torch.equal(workspace[:16], torch.stack(expect))
    assert torch.isnan(workspace[16:]).all(), "rows past cu_seq_lens[-1] must stay untouched"


def test_gather_dequantizes_fp8():
    cache = make_cache(4)
    k_scale = torch.tensor([0.25])
    fp8 = (cache / k_scale).to(torch.float8_e4m3fn)
    table = torch.arange(24, dtype=torch.int32).view(2, 12)
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    starts = torch.tensor([2, 0], dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        workspace = torch.empty(11, 6, dtype=dtype)
        ops.gather_context(fp8, table, cu, starts, k_scale, workspace)
        flat = fp8.view(-1, 6).float() * 0.25
        rows = torch.cat([torch.arange(2, 7), 48 + torch.arange(0, 6)])
        assert torch.equal(workspace, flat[rows].to(dtype))


def test_gather_opcheck():
    cache = make_cache(4)
    table = torch.arange(24, dtype=torch.int32).view(2, 12)
    args = (cache, table, torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([4, 0], dtype=torch.int32))
    torch.library.opcheck(ops.gather_context, args + (None, torch.zeros(10, 6)), test_utils=OPCHECK_UTILS)
    # SchemaCheckMode compares inputs with arithmetic that CPU float8 lacks: skip test_schema there.
    fp8 = cache.to(torch.float8_e4m3fn)
    torch.library.opcheck(ops.gather_context, (fp8,) + args[1:] + (torch.tensor([0.5]), torch.zeros(10, 6)),
                          test_utils=OPCHECK_UTILS[1:])


# ---- context_attention and suffix_attention ----------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_context_attention_writes_and_continues(dtype, tol):
    # T=1 and 17, a request with no rows (left untouched), one without queries
    q_lens, k_lens = [1, 17, 0, 4], [5, 0, 3, 11]
    cu_q, _, _, _, make = random_varlen(q_lens, dtype=dtype)
    cu_k, k_nope, k_pe, v, _ = random_varlen(k_lens, dtype=dtype, seed=1)
    q = make(sum(q_lens), 2, 12)
    scale = 0.3
    starts = torch.tensor([7, 0, 0, 0], dtype=torch.int32)  # request 0 continues an earlier chunk
    # What an earlier chunk left for request 0: its partial over 5 other keys.
    _, prev_nope, prev_pe, prev_v, _ = random_varlen([5], dtype=dtype, seed=2)
    prev_out, prev_lse = dense_attention(q[:1], prev_nope, prev_pe, prev_v, scale, False)
    out = torch.full((sum(q_lens), 2, 8), float("nan"), dtype=dtype)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    lse = torch.full((2, sum(q_lens)), float("nan"), dtype=lse_dtype)
    out[:1], lse[:, :1] = prev_out.to(dtype), prev_lse.to(lse_dtype)
    ops.context_attention(q, k_nope, k_pe, v, cu_q, cu_k, starts, scale, out, lse)

    for i in range(4):
        t0, t1, s0, s1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if i == 0:  # merged: equal to attending over both key sets at once
            keys = (torch.cat([prev_nope, k_nope[s0:s1]]), torch.cat([prev_pe, k_pe[s0:s1]]),
                    torch.cat([prev_v, v[s0:s1]]))
        else:
            keys = (k_nope[s0:s1], k_pe[s0:s1], v[s0:s1])
        if s1 == s0:  # no rows in this chunk: left untouched
            assert torch.isnan(out[t0:t1]).all() and torch.isnan(lse[:, t0:t1]).all()
            continue
        expect, expect_lse = dense_attention(q[t0:t1], *keys, scale, False)
        torch.testing.assert_close(out[t0:t1].double(), expect, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[:, t0:t1].double(), expect_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_heads", [1, 16])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.float16, 1e-2)])
def test_suffix_attention_is_causal_per_request(num_heads, dtype, tol):
    lens = [1, 17, 3]
    cu, k_nope, k_pe, v, make = random_varlen(lens, num_heads=num_heads, dtype=dtype)
    q = make(sum(lens), num_heads, 12)
    out = torch.empty(sum(lens), num_heads, 8, dtype=dtype)
    lse = torch.empty(num_heads, sum(lens))
    ops.suffix_attention(q, k_nope, k_pe, v, cu, 0.25, out, lse)
    for t0, t1 in zip(cu[:-1].tolist(), cu[1:].tolist()):
        expect, expect_lse = dense_attention(q[t0:t1], k_nope[t0:t1], k_pe[t0:t1], v[t0:t1], 0.25, True)
        torch.testing.assert_close(out[t0:t1].double(), expect, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[:, t0:t1].double(), expect_lse, atol=1e-5, rtol=1e-5)


def test_attention_opcheck():
    cu_q, _, _, _, make = random_varlen([3, 2], dtype=torch.float32)
    cu_k, k_nope, k_pe, v, _ = random_varlen([4, 0], dtype=torch.float32, seed=3)
    q = make(5, 2, 12)
    starts = torch.tensor([2, 0], dtype=torch.int32)
    out, lse = torch.randn(5, 2, 8), torch.randn(2, 5)
    torch.library.opcheck(ops.context_attention, (q, k_nope, k_pe, v, cu_q, cu_k, starts, 0.5, out, lse),
                          test_utils=OPCHECK_UTILS)
    cu, k_nope, k_pe, v, make = random_varlen([3, 2], dtype=torch.float32)
    torch.library.opcheck(ops.suffix_attention,
                          (make(5, 2, 12), k_nope, k_pe, v, cu, 0.5, torch.empty(5, 2, 8), torch.empty(2, 5)),
                          test_utils=OPCHECK_UTILS)
