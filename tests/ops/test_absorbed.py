"""The absorbed ("MQA") context attention op and the latent attention op (context parallel's local
attention), on CPU against float64 computations, and their Triton kernels on a GPU.

q [T, N, P+R]   kv_cache [num_blocks, block_size, L+R]   kv_b_proj_weight [N*(P+V), L]
block_table [B, max_blocks] int32   query_start_loc [B+1] int32   context_lens [B] int32
-> out [T, N, V], lse [N, T]; rows of requests without context stay untouched (NaN sentinels here).
latent attention: q [T, H, L+R] folded queries -> out [T, H, L], lse [H, T].

The reference is checked against the MHA path's context partial (gather -> up-project -> attend,
the library's own ops) and a dense float64 computation (tests/support/batches.py). The FlashMLA adapter:
tests/ops/test_flashmla.py.
"""

import pytest
import torch

import mla_ops  # noqa: F401  (registers the other ops)
from mla_ops import _mla
from mla_ops._mla import MLADims
from mla_ops.ops import absorbed
from mla_ops.ops.absorbed import latent_attention_reference
from tests.support.batches import (FP8, NAN, assert_partial, context_batch, dense_mha_partial, make_batch, paged_cache,
                                   written_rows)
from tests.support.gpu import DEVICE, absorbed_batch, check_absorbed, needs_cuda

ops = torch.ops.mla_ops
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")

# Small dims for the reference; the FlashMLA stand-in needs L=512, R=64 (its kernel's only shape).
SMALL = dict(N=3, L=32, R=8, P=8, V=8)


def mha_path_partial(batch, value_dim: int):
    """The library's MHA context partial over all of each request's context (one chunk)."""
    num_heads, latent, nope, _, _ = MLADims.from_shapes(batch.q, batch.kv_cache, batch.kv_b_proj_weight)
    ctx = batch.context_lens
    cu = torch.cat([ctx.new_zeros(1), ctx.cumsum(0).to(torch.int32)])
    starts = torch.zeros_like(ctx)
    workspace = batch.q.new_zeros(int(cu[-1]), batch.kv_cache.shape[2])
    ops.gather_context(batch.kv_cache, batch.block_table, cu, starts, batch.k_scale, workspace)
    kv = (workspace[:, :latent] @ batch.kv_b_proj_weight.T).view(-1, num_heads, nope + value_dim)
    out, lse = batch.sentinels(value_dim)
    ops.context_attention(batch.q, kv[..., :nope], workspace[:, latent:], kv[..., nope:], batch.query_start_loc,
                          cu, starts, batch.softmax_scale, out, lse)
    return out, lse


# ---- the torch reference / the op ----------------------------------------------------------------

# T = 1 and 17 queries, zero context with and without queries, context without queries, a long one.
CONTEXTS, QUERIES = [5, 0, 130, 3, 0, 70, 1], [1, 3, 17, 0, 2, 4, 1]


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_reference_equals_mha_partial_and_dense(block_size, dtype, tol):
    batch = context_batch(CONTEXTS, QUERIES, block_size=block_size, dtype=dtype, seed=block_size, **SMALL)
    out, lse = batch.sentinels(SMALL["V"])
    ops.absorbed_context_attention(*batch.absorbed_args(), out, lse)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    written = written_rows(batch)
    assert_partial(out, lse, *dense_mha_partial(batch), written, tol)
    mha_out, mha_lse = mha_path_partial(batch, SMALL["V"])
    assert_partial(out, lse, mha_out.double(), mha_lse.double(), written, tol)


def test_oracle_equals_dense():
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, **SMALL)
    out, lse = batch.sentinels(SMALL["V"])
    absorbed.absorbed_reference(*batch.absorbed_args(), out, lse)
    assert_partial(out, lse, *dense_mha_partial(batch), written_rows(batch), 1e-12)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_reference_fp8_cache(out_dtype):
    batch = context_batch(CONTEXTS, QUERIES, block_size=16, dtype=torch.float32, fp8_scale=0.25, **SMALL)
    out, lse = batch.sentinels(SMALL["V"], dtype=out_dtype)
    ops.absorbed_context_attention(*batch.absorbed_args(), out, lse)
    tol = 2e-5 if out_dtype == torch.float32 else 2e-2
    assert_partial(out, lse, *dense_mha_partial(batch), written_rows(batch), tol)


def test_no_context_writes_nothing():
    batch = context_batch([0, 0], [3, 2], block_size=4, **SMALL)
    out, lse = batch.sentinels(SMALL["V"])
    ops.absorbed_context_attention(*batch.absorbed_args(), out, lse)
    assert torch.isnan(out).all() and torch.isnan(lse).all()


def test_opcheck():
    batch = context_batch([4, 0, 9], [2, 1, 3], block_size=4, dtype=torch.float32, **SMALL)
    out, lse = torch.randn(6, 3, 8), torch.randn(3, 6)
    torch.library.opcheck(ops.absorbed_context_attention, (*batch.absorbed_args(), out, lse), test_utils=OPCHECK_UTILS)
    # A static bound of the tokens of requests with context (5 here), as a plan passes it.
    torch.library.opcheck(ops.absorbed_context_attention, (*batch.absorbed_args(), out, lse, 5),
                          test_utils=OPCHECK_UTILS)
    # ... and the packed token offsets the plan makes once per step.
    loc = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    torch.library.opcheck(ops.absorbed_context_attention, (*batch.absorbed_args(), out, lse, 5, loc),
                          test_utils=OPCHECK_UTILS)
    # SchemaCheckMode compares inputs with arithmetic that CPU float8 lacks: skip test_schema there.
    batch = context_batch([4, 0, 9], [2, 1, 3], block_size=4, dtype=torch.float32, fp8_scale=0.5, **SMALL)
    torch.library.opcheck(ops.absorbed_context_attention, (*batch.absorbed_args(), out, lse),
                          test_utils=OPCHECK_UTILS[1:])


# ---- the latent attention op --------------------------------------------------------------------

LATENT_DIMS = dict(N=3, L=16, R=8, P=8, V=8)


def latent_batch(fp8_scale=None, seed=0):
    """Contexts [5, 0, 40, 3] in blocks of 4, queries [2, 3, 5, 0] (T = 10)."""
    return make_batch([5, 0, 40, 3], [2, 3, 5, 0], seed=seed, block_size=4, dtype=torch.float64,
                      fp8_scale=fp8_scale, k_scale_as_tensor=True, **LATENT_DIMS)


@pytest.mark.parametrize("fp8_scale", [None, 0.5])
def test_latent_attention_is_the_absorbed_op_without_fold_and_unfold(fp8_scale):
    q, cache, table, qsl, ctx, weight, scale, k_scale = latent_batch(fp8_scale).absorbed_args()
    heads, latent, nope, value = (LATENT_DIMS[k] for k in "NLPV")
    out = torch.full((10, heads, value), NAN, dtype=torch.float64)
    lse = torch.full((heads, 10), NAN, dtype=torch.float64)
    torch.ops.mla_ops.absorbed_context_attention(q, cache, table, qsl, ctx, weight, scale, k_scale, out, lse)

    w_uk, w_uv = _mla.split_kv_b_proj(weight, heads, nope)
    q_abs = torch.cat([_mla.fold_queries(q, w_uk, q.dtype).transpose(0, 1), q[..., nope:]], dim=-1)
    o_lat = torch.full((10, heads, latent), NAN, dtype=torch.float64)
    lat_lse = torch.full((heads, 10), NAN, dtype=torch.float64)
    torch.ops.mla_ops.latent_context_attention(q_abs, cache, table, qsl, ctx, scale, k_scale, o_lat, lat_lse)
    written = torch.repeat_interleave(ctx > 0, (qsl[1:] - qsl[:-1]).long())
    assert torch.isnan(o_lat[~written]).all() and torch.isnan(lat_lse[:, ~written]).all(), "rows without context"
    unfolded = _mla.unfold_outputs(o_lat.transpose(0, 1), w_uv).transpose(0, 1)
    torch.testing.assert_close(unfolded[written], out[written], rtol=0, atol=1e-12)
    torch.testing.assert_close(lat_lse[:, written], lse[:, written], rtol=0, atol=1e-12)


def test_latent_op_equals_its_oracle():
    _, cache, table, qsl, ctx, _, scale, _ = latent_batch().absorbed_args()
    heads, latent = LATENT_DIMS["N"], LATENT_DIMS["L"]
    q_abs = torch.randn(10, heads, cache.shape[2], dtype=torch.float64)
    got = [torch.full((10, heads, latent), NAN, dtype=torch.float64), torch.full((heads, 10), NAN, dtype=torch.float64)]
    want = [torch.full_like(got[0], NAN), torch.full_like(got[1], NAN)]
    torch.ops.mla_ops.latent_context_attention(q_abs, cache, table, qsl, ctx, scale, None, *got)
    latent_attention_reference(q_abs, cache, table, qsl, ctx, scale, None, *want)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12, equal_nan=True)


def test_latent_attention_opcheck():
    _, cache, table, qsl, ctx, _, scale, _ = latent_batch().absorbed_args()
    heads, latent = LATENT_DIMS["N"], LATENT_DIMS["L"]
    q_abs = torch.randn(10, heads, cache.shape[2])
    out, lse = torch.zeros(10, heads, latent), torch.zeros(heads, 10)
    torch.library.opcheck(torch.ops.mla_ops.latent_context_attention,
                          (q_abs, cache.float(), table, qsl, ctx, scale, None, out, lse), test_utils=OPCHECK_UTILS)
    _, cache8, table, qsl, ctx, _, scale, k_scale = latent_batch(fp8_scale=0.5).absorbed_args()
    torch.library.opcheck(torch.ops.mla_ops.latent_context_attention,  # CPU float8 lacks SchemaCheckMode's math
                          (q_abs, cache8, table, qsl, ctx, scale, k_scale, out, lse), test_utils=OPCHECK_UTILS[1:])


# ---- GPU: the Triton kernels against the torch references --------------------------------------


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype,fp8", [(torch.bfloat16, False), (torch.float16, False), (torch.float32, False),
                                       (torch.bfloat16, True)])
def test_absorbed_kernel(dtype, fp8):
    check_absorbed(absorbed_batch(dtype, fp8), torch.ops.mla_ops.absorbed_context_attention, dtype)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("num_programs", [3, None])  # forced tiny grids, then the SM count
def test_absorbed_kernel_on_packed_routed_tokens(num_programs, monkeypatch):
    """A scratch of exactly the routed tokens (fold, attention and unfold stride over it); a batch
    that routes nothing leaves out and lse untouched."""
    from mla_ops.triton import _common

    monkeypatch.setattr(_common, "PROGRAMS_OVERRIDE", num_programs)
    batch = absorbed_batch(torch.bfloat16, False)
    rows = int(written_rows(batch).sum())
    op = torch.ops.mla_ops.absorbed_context_attention
    check_absorbed(batch, lambda *args: op(*args, rows), torch.bfloat16)
    batch.context_lens = torch.zeros_like(batch.context_lens)
    out, lse = (t.to(DEVICE) for t in batch.sentinels(128, dtype=torch.bfloat16))
    op(*batch.absorbed_args(), out, lse, 4)
    assert out.isnan().all() and lse.isnan().all()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype,fp8", [(torch.bfloat16, False), (torch.float16, False), (torch.float32, False),
                                       (torch.bfloat16, True)])
@pytest.mark.parametrize("heads", [16, 128])
def test_cuda_latent_attention_kernel(dtype, fp8, heads):
    latent, rope = 512, 64  # DeepSeek's
    cache, table, ctx = paged_cache([700, 0, 33, 1], 64, latent + rope, seed=heads)
    qsl = torch.tensor([0, 3, 5, 22, 23], dtype=torch.int32)
    q = torch.randn(23, heads, latent + rope) / 8
    k_scale = None
    if fp8:
        cache, k_scale = (cache / 0.5).to(FP8), torch.tensor([0.5])
    args = [x.cuda() if isinstance(x, torch.Tensor) else x
            for x in (q.to(dtype), cache if fp8 else cache.to(dtype), table, qsl, ctx, 0.05, k_scale)]
    got = torch.full((23, heads, latent), NAN, device="cuda")
    got_lse = torch.full((heads, 23), NAN, device="cuda")
    want, want_lse = torch.full_like(got, NAN), torch.full_like(got_lse, NAN)
    torch.ops.mla_ops.latent_context_attention(*args, got, got_lse)  # the Triton kernel on CUDA
    latent_attention_reference(*args, want, want_lse)
    written = torch.repeat_interleave(ctx > 0, (qsl[1:] - qsl[:-1]).long()).cuda()
    assert torch.isnan(got[~written]).all(), "rows without context touched"
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    torch.testing.assert_close(got[written], want[written], rtol=tol, atol=tol)
    torch.testing.assert_close(got_lse[:, written], want_lse[:, written], rtol=tol, atol=tol)
