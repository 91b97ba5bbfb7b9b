"""End-to-end correctness of ``mla_ops.mla_prefill`` against a dense, unchunked reference.

Written from DESIGN.md (§1 math, §2 conventions, §4 API, §6 testing), independently of the
library code. Shapes (every dim is read from tensor shapes by the library):

    q        [T, N, P+R]   rotated queries of the new tokens
    kv_c     [T, L]        latent of the new tokens          k_pe [T, R]
    kv_cache [num_blocks, block_size, L+R]   rows [kv_c (L) | k_pe (R)]
    block_table [B, max_blocks] int32   query_start_loc [B+1] int32   context_lens [B] int32
    kv_b_proj_weight [N*(P+V), L]
    -> out   [T, N, V]

Request r's queries see its c_r context keys (non-causal) and, causally, its own new keys.
"""

import math
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla_ops

FP8 = torch.float8_e4m3fn

# Tolerance on max |out - ref| / max(1, max |ref|), per output dtype.
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2}


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


def _mask(q_len, c):
    """[q_len, c + q_len] bool: all context keys, causal over the new keys."""
    i = torch.arange(q_len)[:, None]
    j = torch.arange(c + q_len)[None, :]
    return (j < c) | (j - c <= i)


def dense_reference(q, kv_c, k_pe, kv_cache, block_table, query_start_loc, context_lens,
                    kv_b_proj_weight, softmax_scale, k_scale=None):
    """Float64 [T, N, V]: per request, all keys/values built at once, one masked softmax."""
    N, L, P, R, V = _dims(q, k_pe, kv_cache, kv_b_proj_weight)
    qsl = [int(x) for x in query_start_loc.tolist()]
    ctx = [int(x) for x in context_lens.tolist()]
    w = kv_b_proj_weight.double()
    out = torch.zeros(q.shape[0], N, V, dtype=torch.float64)
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
        scores = scores.masked_fill(~_mask(e - s, c), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("nqk,knd->qnd", probs, v)
    return out


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
            kwargs.setdefault("absorb_max_query_len", 0)  # the chunked path; tests/test_routing.py sweeps
        if self.k_scale is not None:
            kwargs.setdefault("k_scale", self.k_scale)
        return mla_ops.mla_prefill(*self.args(), **kwargs)

    def tensors(self):
        ts = dict(q=self.q, kv_c=self.kv_c, k_pe=self.k_pe, kv_cache=self.kv_cache,
                  block_table=self.block_table, query_start_loc=self.query_start_loc,
                  context_lens=self.context_lens, kv_b_proj_weight=self.kv_b_proj_weight)
        if isinstance(self.k_scale, torch.Tensor):
            ts["k_scale"] = self.k_scale
        return ts


def make_batch(context_lens, query_lens, *, seed, block_size=16, N=2, L=16, P=8, R=4, V=8,
               dtype=torch.float64, pad_cols=2, garbage_blocks=3, noncontig=None,
               fp8_scale=None, k_scale_as_tensor=False, q_mult=1.0):
    """A random batch with a shuffled paged cache.

    Blocks are handed out in a random permutation of the block ids; `garbage_blocks` blocks
    are never referenced and every unused slot holds random data. Block table rows carry
    `pad_cols` extra columns of arbitrary (valid) block ids. `noncontig` in
    {None, "slice", "step", "colmajor"} makes block_table, q, kv_c and k_pe non-contiguous.
    With `fp8_scale`, the cache is float8_e4m3fn: `(x / k_scale).to(float8_e4m3fn)`.
    """
    assert len(context_lens) == len(query_lens) and all(n >= 0 for n in query_lens)
    g = torch.Generator().manual_seed(seed)
    B, T = len(context_lens), sum(query_lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    n_blocks = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(n_blocks) + garbage_blocks
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    cols = max(n_blocks + [0]) + pad_cols
    table = torch.randint(0, num_blocks, (B, max(cols, 1)), generator=g, dtype=torch.int32)
    nxt = 0
    for r, n in enumerate(n_blocks):
        table[r, :n] = perm[nxt:nxt + n]
        nxt += n

    if noncontig == "slice":  # a column slice of a wider int32 tensor
        wide = torch.randint(0, num_blocks, (B, table.shape[1] + 5), generator=g,
                             dtype=torch.int32)
        wide[:, 3:3 + table.shape[1]] = table
        table = wide[:, 3:3 + table.shape[1]]
    elif noncontig == "step":  # every other column of a wider tensor
        wide = torch.zeros(B, 2 * table.shape[1], dtype=torch.int32)
        wide[:, ::2] = table
        table = wide[:, ::2]
    elif noncontig == "colmajor":
        table = table.t().contiguous().t()

    if fp8_scale is None:
        cache = rnd(num_blocks, block_size, L + R).to(dtype)
        k_scale = None
    else:
        stored = (rnd(num_blocks, block_size, L + R) * 1.5 / fp8_scale).to(FP8)
        cache = stored
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


# --------------------------------------------------------------------------------------------
# Self-checks of the reference (no library involved)
# --------------------------------------------------------------------------------------------


def test_reference_single_token_is_its_own_value():
    # One request, no context, one token: the only key is its own, so out = v = kv_c @ W_UV^T.
    b = make_batch([0], [1], seed=0, N=3)
    N, P, V = 3, 8, 8
    ref = b.reference()
    v = (b.kv_c.double() @ b.kv_b_proj_weight.double().T).view(1, N, P + V)[..., P:]
    torch.testing.assert_close(ref, v, rtol=0, atol=1e-12)


def test_reference_hand_computed_two_keys():
    # N = 1, P = R = V = L = 1, block_size 1; one context key and one new token.
    # key_j = [w_k * lat_j | pe_j], v_j = w_v * lat_j, score_j = q . key_j * scale.
    q = torch.tensor([[[0.5, -1.0]]], dtype=torch.float64)  # [1, 1, 2]
    kv_c, k_pe = torch.tensor([[2.0]], dtype=torch.float64), torch.tensor([[0.25]],
                                                                            dtype=torch.float64)
    cache = torch.tensor([[[-1.0, 3.0]]], dtype=torch.float64)  # one block, one slot
    w = torch.tensor([[1.5], [0.5]], dtype=torch.float64)  # [N*(P+V), L] = [2, 1]
    scale = 0.7
    s_ctx = (0.5 * 1.5 * -1.0 + -1.0 * 3.0) * scale
    s_new = (0.5 * 1.5 * 2.0 + -1.0 * 0.25) * scale
    p_ctx = math.exp(s_ctx) / (math.exp(s_ctx) + math.exp(s_new))
    expect = p_ctx * (0.5 * -1.0) + (1 - p_ctx) * (0.5 * 2.0)
    ref = dense_reference(q, kv_c, k_pe, cache, torch.tensor([[0]], dtype=torch.int32),
                          torch.tensor([0, 1], dtype=torch.int32),
                          torch.tensor([1], dtype=torch.int32), w, scale)
    assert abs(ref.item() - expect) < 1e-14


@pytest.mark.parametrize("block_size", [1, 16])
def test_reference_matches_sdpa_and_absorbed_forms(block_size):
    g = torch.Generator().manual_seed(1)
    ctx, ql = random_lens(g, 5, 40, 6, zero_at=(0, 2))
    b = make_batch(ctx, ql, seed=2, block_size=block_size, N=3, noncontig="slice")
    ref = b.reference()
    torch.testing.assert_close(ref, sdpa_reference(*b.args()), rtol=0, atol=1e-12)
    torch.testing.assert_close(ref, absorbed_reference(*b.args()), rtol=0, atol=1e-12)


def test_reference_fp8_dequantizes():
    b = make_batch([9, 0, 4], [2, 3, 1], seed=3, block_size=4, dtype=torch.float32,
                   fp8_scale=0.05)
    deq = replace(b, kv_cache=b.kv_cache.double() * 0.05, k_scale=None)
    torch.testing.assert_close(b.reference(), deq.reference(), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# mla_prefill vs the reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=["f64", "f32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_random_batches(policy, block_size, dtype):
    torch.manual_seed(10)
    g = torch.Generator().manual_seed(100 + block_size)
    # Zero-context requests first, in the middle and last; some contexts > the workspace.
    ctx, ql = random_lens(g, 7, 90, 5, zero_at=(0, 3, 6))
    ctx[1], ctx[4] = 77, 33  # longer than the workspace (24)
    noncontig = {1: "slice", 16: "step", 64: "colmajor"}[block_size]
    for nc in (None, noncontig):
        b = make_batch(ctx, ql, seed=block_size, block_size=block_size, dtype=dtype,
                       noncontig=nc)
        out = b.run(workspace_size=24, policy=policy)
        assert_close_to_reference(out, b.reference(), dtype,
                                  f"policy={policy} bs={block_size} noncontig={nc}")


@pytest.mark.parametrize("workspace_size", [1, 3, 7, 16])
@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_tiny_workspaces(policy, workspace_size):
    torch.manual_seed(11)
    # Contexts that straddle many chunks, and zero-context requests between them.
    ctx, ql = [0, 23, 5, 0, 0, 16, 1, 40, 0], [2, 3, 1, 4, 1, 2, 5, 1, 3]
    b = make_batch(ctx, ql, seed=11, block_size=4, noncontig="slice")
    out = b.run(workspace_size=workspace_size, policy=policy)
    assert_close_to_reference(out, b.reference(), torch.float64, f"ws={workspace_size}")


@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_default_workspace_and_long_contexts(policy):
    # One chunk holds everything, including a context of several thousand rows.
    torch.manual_seed(12)
    b = make_batch([300, 0, 4500, 130], [3, 2, 3, 70], seed=12, block_size=64,
                   dtype=torch.float32)
    out = b.run(policy=policy)  # workspace_size=65536
    assert_close_to_reference(out, b.reference(), torch.float32)


@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_no_request_has_context(policy):
    torch.manual_seed(13)
    b = make_batch([0, 0, 0, 0], [1, 5, 3, 2], seed=13, block_size=16, garbage_blocks=2)
    for ws in (1, 65536):
        out = b.run(workspace_size=ws, policy=policy)
        assert_close_to_reference(out, b.reference(), torch.float64, f"ws={ws}")


@pytest.mark.parametrize("ctx,ql", [(0, 1), (0, 9), (1, 1), (50, 1), (50, 7)])
@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_single_request(policy, ctx, ql):
    torch.manual_seed(14)
    b = make_batch([ctx], [ql], seed=14 + ctx + ql, block_size=16, N=1)
    out = b.run(workspace_size=16, policy=policy)
    assert_close_to_reference(out, b.reference(), torch.float64)


@pytest.mark.parametrize("N", [1, 4])
def test_head_counts(N):
    torch.manual_seed(15)
    b = make_batch([20, 0, 7], [3, 2, 4], seed=15, N=N, block_size=16)
    out = b.run(workspace_size=8)
    assert_close_to_reference(out, b.reference(), torch.float64, f"N={N}")


@pytest.mark.parametrize("scale_as_tensor", [False, True], ids=["float", "tensor"])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_fp8_cache(policy, q_dtype, scale_as_tensor):
    torch.manual_seed(16)
    for fp8_scale in (0.0625, 0.05):
        b = make_batch([0, 37, 0, 12, 64], [2, 3, 1, 4, 2], seed=16, block_size=16,
                       dtype=q_dtype, fp8_scale=fp8_scale, k_scale_as_tensor=scale_as_tensor,
                       noncontig="slice")
        assert b.kv_cache.dtype == FP8
        out = b.run(workspace_size=20, policy=policy)
        assert_close_to_reference(out, b.reference(), q_dtype, f"k_scale={fp8_scale}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_packed_and_whole_requests_agree(dtype):
    torch.manual_seed(17)
    g = torch.Generator().manual_seed(17)
    ctx, ql = random_lens(g, 8, 60, 4, zero_at=(0, 4, 7))
    b = make_batch(ctx, ql, seed=17, block_size=16, dtype=dtype)
    for ws in (5, 32):
        a = b.run(workspace_size=ws, policy="packed")
        w = b.run(workspace_size=ws, policy="whole_requests")
        err = (a.double() - w.double()).abs().max().item()
        assert err <= TOL[dtype], f"ws={ws}: packed vs whole_requests differ by {err:.3e}"


def test_large_scores_are_stable():
    # Scores in the hundreds: a softmax without max subtraction overflows in float32.
    torch.manual_seed(18)
    b = make_batch([30, 0, 45], [3, 2, 4], seed=18, block_size=16, dtype=torch.float32,
                   q_mult=40.0)
    ref = b.reference()
    out = b.run(workspace_size=8)
    # Near-one-hot softmax: compare relative to the output scale with a float32 tolerance.
    assert_close_to_reference(out, ref, torch.float32)


def test_valid_call_leaves_inputs_untouched():
    torch.manual_seed(19)
    b = make_batch([0, 37, 0, 12], [2, 3, 1, 4], seed=19, block_size=16, dtype=torch.float32,
                   fp8_scale=0.05, k_scale_as_tensor=True)
    before = {k: v.clone() for k, v in b.tensors().items()}
    b.run(workspace_size=7)
    for k, v in b.tensors().items():
        a, c = (v.view(torch.uint8), before[k].view(torch.uint8)) if v.dtype == FP8 else (
            v, before[k])
        assert torch.equal(a, c), f"mla_prefill modified {k}"


def test_backend_auto_on_cpu():
    torch.manual_seed(20)
    b = make_batch([0, 19, 3], [2, 3, 1], seed=20, block_size=16)
    out = b.run(workspace_size=8, backend="auto")
    assert_close_to_reference(out, b.reference(), torch.float64)


@st.composite
def batches(draw):
    B = draw(st.integers(1, 5))
    ctx = draw(st.lists(st.integers(0, 40), min_size=B, max_size=B))
    ql = draw(st.lists(st.integers(1, 6), min_size=B, max_size=B))
    dims = dict(N=draw(st.integers(1, 3)), L=draw(st.sampled_from([4, 8])),
                P=draw(st.sampled_from([2, 4])), R=draw(st.sampled_from([1, 2])),
                V=draw(st.sampled_from([2, 4, 6])))
    return dict(ctx=ctx, ql=ql, dims=dims,
                block_size=draw(st.sampled_from([1, 2, 5, 16])),
                workspace_size=draw(st.integers(1, 48)),
                policy=draw(st.sampled_from(["packed", "whole_requests"])),
                noncontig=draw(st.sampled_from([None, "slice", "step", "colmajor"])),
                seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_hypothesis_random_batches(case):
    torch.manual_seed(21)
    b = make_batch(case["ctx"], case["ql"], seed=case["seed"], block_size=case["block_size"],
                   noncontig=case["noncontig"], **case["dims"])
    out = b.run(workspace_size=case["workspace_size"], policy=case["policy"])
    assert_close_to_reference(out, b.reference(), torch.float64, str(case))


# --------------------------------------------------------------------------------------------
# Edge cases the contract implies
# --------------------------------------------------------------------------------------------


def _poison_unused_cache_slots(b):
    """NaN in every cache slot no request's context refers to (fp8: its NaN byte 0x7F)."""
    cache = b.kv_cache.clone()
    used = torch.zeros(cache.shape[:2], dtype=torch.bool)
    bs = cache.shape[1]
    for r, c in enumerate(b.context_lens.tolist()):
        pos = torch.arange(c)
        used[b.block_table[r].long()[pos // bs], pos % bs] = True
    if cache.dtype == FP8:
        cache.view(torch.uint8)[~used] = 0x7F
    else:
        cache[~used] = float("nan")
    return replace(b, kv_cache=cache)


@pytest.mark.parametrize("fp8", [False, True], ids=["f32", "fp8"])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_unused_cache_slots_are_never_read(policy, block_size, fp8):
    # Tails of partial blocks and unreferenced blocks may hold anything, NaN included.
    torch.manual_seed(22)
    b = make_batch([0, 37, 0, 12, 64, 0], [2, 3, 1, 4, 2, 1], seed=22, block_size=block_size,
                   dtype=torch.float32, fp8_scale=0.05 if fp8 else None)
    b = _poison_unused_cache_slots(b)
    ref = b.reference()
    assert torch.isfinite(ref).all()
    assert_close_to_reference(b.run(workspace_size=20, policy=policy), ref, torch.float32)


@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_requests_without_queries(policy):
    # query_start_loc is non-decreasing: a request may have context but no new tokens.
    torch.manual_seed(23)
    for ctx, ql in (([5, 20, 7], [2, 0, 3]), ([5, 20, 7, 0], [0, 2, 0, 1])):
        b = make_batch(ctx, ql, seed=23, block_size=4)
        out = b.run(workspace_size=6, policy=policy)
        assert_close_to_reference(out, b.reference(), torch.float64, f"ctx={ctx} ql={ql}")
    b = make_batch([5, 20], [0, 0], seed=23, block_size=4)  # T = 0
    assert b.run(workspace_size=6, policy=policy).shape == (0, 2, 8)


def test_float16():
    torch.manual_seed(24)
    b = make_batch([5, 20, 0, 40], [2, 3, 1, 2], seed=24, block_size=16, dtype=torch.float16)
    out = b.run(workspace_size=6)
    assert out.dtype == torch.float16
    err = (out.double() - b.reference()).abs().max().item()
    assert err <= 1e-2 * max(1.0, b.reference().abs().max().item()), f"max abs diff {err:.3e}"


def test_k_scale_zero_dim_tensor_and_int_softmax_scale():
    torch.manual_seed(25)
    b = make_batch([5, 20, 7], [2, 1, 3], seed=25, block_size=4, dtype=torch.float32,
                   fp8_scale=0.05)
    b = replace(b, k_scale=torch.tensor(0.05, dtype=torch.float32))
    assert_close_to_reference(b.run(workspace_size=6), b.reference(), torch.float32)
    b = replace(make_batch([5, 20, 7], [2, 1, 3], seed=25, block_size=4), softmax_scale=1)
    assert_close_to_reference(b.run(workspace_size=6), b.reference(), torch.float64)


def test_noncontiguous_cache_and_weight():
    torch.manual_seed(26)
    b = make_batch([5, 20, 0, 7], [2, 1, 2, 3], seed=26, block_size=4, noncontig="step")
    wide = torch.cat([b.kv_cache, b.kv_cache], dim=-1)
    b = replace(b, kv_cache=wide[..., 3:3 + b.kv_cache.shape[-1]],
                kv_b_proj_weight=b.kv_b_proj_weight.t().contiguous().t())
    assert not b.kv_cache.is_contiguous() and not b.kv_b_proj_weight.is_contiguous()
    assert_close_to_reference(b.run(workspace_size=6), b.reference(), torch.float64)


def test_deepseek_v2_lite_dims():
    # N = 16, L = 512, P = 128, R = 64, V = 128: nothing may depend on the toy sizes above.
    torch.manual_seed(27)
    b = make_batch([300, 0, 129], [3, 2, 5], seed=27, block_size=64, N=16, L=512, P=128, R=64,
                   V=128, dtype=torch.float32)
    assert_close_to_reference(b.run(workspace_size=128), b.reference(), torch.float32)
