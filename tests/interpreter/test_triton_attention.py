"""Triton attention kernels (mla_ops/triton/attention.py) under the interpreter, against the torch references.

Shapes are tiny; the interpreter launch config (16 x 16 tiles) still gives multi-tile query and key
loops at 17 queries / 18+ keys. Every buffer is a strided view, and bytes around the views are
NaN sentinels that must survive.
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (make test does)", allow_module_level=True)
pytest.importorskip("triton")

from mla_ops.ops.attention import varlen_attention_reference  # noqa: E402
from mla_ops.ops.attention import context_attention_reference  # noqa: E402
from mla_ops.planning.device_schedule import device_plan_tensors  # noqa: E402
from mla_ops.ops.attention import suffix_attention_reference  # noqa: E402
from mla_ops.triton.attention import context_attention, suffix_attention  # noqa: E402

DIMS = {"pow2": (8, 4, 8), "odd": (6, 2, 5)}  # (P, R, V)
OUT_TOL = {torch.float32: 1e-5, torch.float16: 4e-3}  # max abs diff of out
LSE_TOL = {torch.float32: 1e-5, torch.float16: 1e-4}  # scores are fp32 dot products in both
NAN = float("nan")


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def randn(gen, *shape, dtype):
    return (torch.randn(*shape, generator=gen) * 0.7).to(dtype)


def make_qkv(q_lens, k_lens, heads, dims, dtype, seed):
    """q narrowed along tokens and heads-strided; k_nope / v views of one buffer; k_pe a workspace view."""
    gen = torch.Generator().manual_seed(seed)
    nope, rope, value = dims
    tokens, rows, latent = sum(q_lens), sum(k_lens), 7
    q = randn(gen, tokens + 3, heads, nope + rope + 1, dtype=dtype).narrow(0, 2, tokens)[:, :, : nope + rope]
    k_nope, v = randn(gen, rows, heads, nope + value, dtype=dtype).split([nope, value], dim=-1)
    k_pe = randn(gen, rows + 2, latent + rope, dtype=dtype)[:rows, latent:]  # row stride L+R
    return q, k_nope, k_pe, v


def out_buffers(tokens, heads, value, dtype):
    """NaN-filled out [T, N, V] / lse [N, T] as narrowed views of larger buffers."""
    out_full = torch.full((tokens + 4, heads, value), NAN, dtype=dtype)
    lse_full = torch.full((heads, tokens + 5), NAN, dtype=torch.float32)
    return out_full, lse_full, out_full.narrow(0, 1, tokens), lse_full.narrow(1, 3, tokens)


def assert_matches(got, want, tol, what):
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN sentinels differ (written or left wrongly)"
    both = ~want.isnan()
    assert torch.equal(got.isinf() & both, want.isinf() & both), f"{what}: infinities differ"
    finite = both & want.isfinite()
    err = (got[finite].double() - want[finite].double()).abs().max().item() if finite.any() else 0.0
    assert err <= tol, f"{what}: max abs diff {err:.3e} > {tol:.1e}"


CONTEXT_CASES = {
    # (query lens, key rows in the chunk, starts): starts > 0 merges into the running partial
    "one_token": ([1], [5], [0]),
    "one_token_continues": ([1], [1], [3]),
    # host schedule: the first request continues; request 1 has rows but no queries, request 2
    # queries but no rows (untouched); odd key counts, 17 queries = two query tiles
    "host_chunk": ([3, 0, 17, 2, 1], [18, 4, 0, 1, 33], [6, 0, 0, 0, 0]),
    # device schedule: the whole batch, one continuing request in the middle, the rest without rows
    "device_chunk": ([2, 17, 5, 3], [0, 17, 0, 0], [0, 9, 0, 0]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dims", list(DIMS))
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("case", list(CONTEXT_CASES))
def test_context_attention(case, heads, dims, dtype):
    q_lens, k_lens, starts = CONTEXT_CASES[case]
    value = DIMS[dims][2]
    q, k_nope, k_pe, v = make_qkv(q_lens, k_lens, heads, DIMS[dims], dtype, seed=len(q_lens) * 10 + heads)
    query_start_loc, cu_seq_lens = cu(q_lens), cu(k_lens)
    out_full, lse_full, out, lse = out_buffers(q.shape[0], heads, value, dtype)
    gen = torch.Generator().manual_seed(7)
    for i, (t0, t1) in enumerate(zip(query_start_loc[:-1].tolist(), query_start_loc[1:].tolist())):
        if starts[i] > 0 and k_lens[i] > 0:  # a previous partial to merge into, with empty rows
            out[t0:t1] = randn(gen, t1 - t0, heads, value, dtype=dtype)
            lse[:, t0:t1] = torch.randn(heads, t1 - t0, generator=gen) * 2
            lse[0, t0] = float("-inf")
            out[t0, 0] = 0.0
            lse[-1, t1 - 1] = float("inf")  # FA2 / FlashMLA's empty row
    ref_out_full, ref_lse_full = out_full.clone(), lse_full.clone()
    ref_out, ref_lse = ref_out_full.narrow(0, 1, q.shape[0]), ref_lse_full.narrow(1, 3, q.shape[0])
    starts = torch.tensor(starts, dtype=torch.int32)

    context_attention(q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, 0.4, out, lse)
    context_attention_reference(q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, 0.4, ref_out, ref_lse)
    assert_matches(out_full, ref_out_full, OUT_TOL[dtype], "out")
    assert_matches(lse_full, ref_lse_full, LSE_TOL[dtype], "lse")


SUFFIX_CASES = {"one_token": [1], "two_query_tiles": [17], "batch": [0, 5, 17, 1, 2]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dims", list(DIMS))
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("case", list(SUFFIX_CASES))
def test_suffix_attention(case, heads, dims, dtype):
    q_lens = SUFFIX_CASES[case]
    q, k_nope, k_pe, v = make_qkv(q_lens, q_lens, heads, DIMS[dims], dtype, seed=len(q_lens) + heads)
    query_start_loc = cu(q_lens)
    out_full, lse_full, out, lse = out_buffers(q.shape[0], heads, DIMS[dims][2], dtype)
    ref_out_full, ref_lse_full = out_full.clone(), lse_full.clone()
    ref_out, ref_lse = ref_out_full.narrow(0, 1, q.shape[0]), ref_lse_full.narrow(1, 3, q.shape[0])

    suffix_attention(q, k_nope, k_pe, v, query_start_loc, 0.4, out, lse)
    suffix_attention_reference(q, k_nope, k_pe, v, query_start_loc, 0.4, ref_out, ref_lse)
    assert_matches(out_full, ref_out_full, OUT_TOL[dtype], "out")
    assert_matches(lse_full, ref_lse_full, LSE_TOL[dtype], "lse")
    assert not out.isnan().any() and not lse.isnan().any(), "suffix_attention must write every token"


@pytest.mark.parametrize("scale", [0.0, -0.7])  # 0: uniform weights; < 0: masked keys must stay out
def test_zero_and_negative_scales(scale):
    q_lens, k_lens, starts = CONTEXT_CASES["host_chunk"]
    q, k_nope, k_pe, v = make_qkv(q_lens, k_lens, 3, DIMS["odd"], torch.float32, seed=8)
    query_start_loc, cu_seq_lens, starts = cu(q_lens), cu(k_lens), torch.tensor(starts, dtype=torch.int32)
    out, lse = torch.zeros(q.shape[0], 3, 5), torch.full((3, q.shape[0]), float("-inf"))
    ref_out, ref_lse = out.clone(), lse.clone()
    context_attention(q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, scale, out, lse)
    context_attention_reference(q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, scale, ref_out, ref_lse)
    assert_matches(out, ref_out, OUT_TOL[torch.float32], "context out")
    assert_matches(lse, ref_lse, LSE_TOL[torch.float32], "context lse")
    q_lens = SUFFIX_CASES["batch"]
    q, k_nope, k_pe, v = make_qkv(q_lens, q_lens, 3, DIMS["odd"], torch.float32, seed=9)
    out, lse = torch.empty(q.shape[0], 3, 5), torch.empty(3, q.shape[0])
    ref_out, ref_lse = out.clone(), lse.clone()
    suffix_attention(q, k_nope, k_pe, v, cu(q_lens), scale, out, lse)
    suffix_attention_reference(q, k_nope, k_pe, v, cu(q_lens), scale, ref_out, ref_lse)
    assert_matches(out, ref_out, OUT_TOL[torch.float32], "suffix out")
    assert_matches(lse, ref_lse, LSE_TOL[torch.float32], "suffix lse")


def test_context_fp16_inputs_into_fp32_out():
    q_lens, k_lens, starts = CONTEXT_CASES["host_chunk"]
    q, k_nope, k_pe, v = make_qkv(q_lens, k_lens, 3, DIMS["odd"], torch.float16, seed=5)
    query_start_loc, cu_seq_lens, starts = cu(q_lens), cu(k_lens), torch.tensor(starts, dtype=torch.int32)
    out = torch.zeros(q.shape[0], 3, 5)
    lse = torch.full((3, q.shape[0]), float("-inf"))
    ref_out, ref_lse = out.clone(), lse.clone()
    context_attention(q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, 0.4, out, lse)
    context_attention_reference(q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, 0.4, ref_out, ref_lse)
    assert_matches(out, ref_out, 1e-3, "out")  # only p is rounded to fp16
    assert_matches(lse, ref_lse, LSE_TOL[torch.float16], "lse")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_device_schedule_chunks_add_up_to_full_context(dtype):
    """Fixed-capacity chunk loop (spare chunks included) == one attention over each whole context."""
    context_lens, q_lens, workspace, capacity, heads = [7, 0, 20, 1], [3, 2, 17, 1], 6, 6, 3
    nope, rope, value = DIMS["odd"]
    q, ctx_k_nope, ctx_k_pe, ctx_v = make_qkv(q_lens, context_lens, heads, DIMS["odd"], dtype, seed=11)
    query_start_loc, ctx_cu = cu(q_lens), cu(context_lens)
    starts_k, seq_lens_k, cu_seq_lens_k, num_chunks = device_plan_tensors(
        torch.tensor(context_lens, dtype=torch.int32), workspace, capacity
    )
    assert int(num_chunks) < capacity  # spare chunks: every request has no rows there
    cu_seq_lens_k = cu_seq_lens_k.t().contiguous().t()  # column-major: select(0, k) has stride K
    out = torch.zeros(q.shape[0], heads, value, dtype=dtype)
    lse = torch.full((heads, q.shape[0]), float("-inf"))
    kv = torch.full((workspace, heads, nope + value), NAN, dtype=dtype)  # stale rows are never read
    k_nope, v = kv.split([nope, value], dim=-1)
    rope_ws = torch.full((workspace, 7 + rope), NAN, dtype=dtype)
    k_pe = rope_ws[:, 7:]
    for k in range(capacity):
        starts, cu_seq_lens = starts_k.select(0, k), cu_seq_lens_k.select(0, k)
        for r, (row, rows) in enumerate(zip(cu_seq_lens[:-1].tolist(), seq_lens_k[k].tolist())):
            src = slice(int(ctx_cu[r]) + int(starts[r]), int(ctx_cu[r]) + int(starts[r]) + rows)
            k_nope[row : row + rows], v[row : row + rows] = ctx_k_nope[src], ctx_v[src]
            k_pe[row : row + rows] = ctx_k_pe[src]
        context_attention(q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, 0.4, out, lse)
    want_out, want_lse = varlen_attention_reference(
        q, ctx_k_nope, ctx_k_pe, ctx_v, query_start_loc, ctx_cu, 0.4, causal=False
    )
    assert_matches(out.float(), want_out, 2 * OUT_TOL[dtype], "out")
    assert_matches(lse, want_lse, LSE_TOL[dtype], "lse")
    assert torch.equal(out[3:5], torch.zeros_like(out[3:5])), "the request without context keeps 0"
    assert lse[:, 3:5].eq(float("-inf")).all(), "the request without context keeps -inf"


def test_float64_is_refused():
    q, k_nope, k_pe, v = make_qkv([2], [3], 1, DIMS["pow2"], torch.float64, seed=0)
    out, lse = torch.zeros(2, 1, 8, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        suffix_attention(q, k_nope[:2], k_pe[:2], v[:2], cu([2]), 0.4, out, lse)
    with pytest.raises(TypeError, match="float64"):
        context_attention(q, k_nope, k_pe, v, cu([2]), cu([3]), torch.zeros(1, dtype=torch.int32), 0.4, out, lse)


def test_bfloat16_upcast_in_the_interpreter():
    """bf16 has no interpreter arithmetic: the launcher upcasts it to fp32 there (on CUDA it stays bf16)."""
    q_lens, k_lens, starts = CONTEXT_CASES["host_chunk"]
    q, k_nope, k_pe, v = make_qkv(q_lens, k_lens, 3, DIMS["odd"], torch.bfloat16, seed=3)
    query_start_loc, cu_seq_lens, starts = cu(q_lens), cu(k_lens), torch.tensor(starts, dtype=torch.int32)
    out, lse = torch.zeros(q.shape[0], 3, 5, dtype=torch.bfloat16), torch.full((3, q.shape[0]), float("-inf"))
    ref_out, ref_lse = out.clone(), lse.clone()
    context_attention(q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, 0.4, out, lse)
    context_attention_reference(q, k_nope, k_pe, v, query_start_loc, cu_seq_lens, starts, 0.4, ref_out, ref_lse)
    assert_matches(out, ref_out, 1.6e-2, "out")  # one bf16 rounding of values below 2
    assert_matches(lse, ref_lse, 1e-5, "lse")
    suffix_attention(q, k_nope[: q.shape[0]], k_pe[: q.shape[0]], v[: q.shape[0]], query_start_loc, 0.4, out, lse)
    suffix_attention_reference(
        q, k_nope[: q.shape[0]], k_pe[: q.shape[0]], v[: q.shape[0]], query_start_loc, 0.4, ref_out, ref_lse
    )
    assert_matches(out, ref_out, 1.6e-2, "out")
    assert_matches(lse, ref_lse, 1e-5, "lse")
