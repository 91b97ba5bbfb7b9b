"""Triton gather, up-projection and merge kernels against their torch oracles, under Triton's
CPU interpreter (TRITON_INTERPRET=1 must be set before the kernels are defined: this directory
is its own pytest run). Shapes are tiny: the interpreter runs each program in Python.

kv_cache [num_blocks, block_size, D]   workspace [W, D]   latent [W, L]   out [W, Nout]
merge: out [T, N, V], lse [N, T]
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 set before import", allow_module_level=True)
pytest.importorskip("triton")

import torch  # noqa: E402

from mla_ops.planning.device_schedule import device_plan_tensors  # noqa: E402
from mla_ops.ops.gather import gather_reference  # noqa: E402
from mla_ops.ops.merge import merge_states_reference  # noqa: E402
from mla_ops.triton.gather import gather_context  # noqa: E402
from mla_ops.triton.merge import merge_attn_states  # noqa: E402
from mla_ops.triton.rows_gemm import up_project  # noqa: E402
from mla_ops.ops.up_projection import up_project_reference  # noqa: E402
from tests.support.batches import paged_block_table  # noqa: E402

WIDTH = 24  # L + R stand-in: not a power of two, so column tiles are masked
NAN = float("nan")
EXACT = dict(atol=0.0, rtol=0.0, equal_nan=True)


def int32(values):
    return torch.tensor(values, dtype=torch.int32)


def paged_batch(block_size, context_lens, *, seed=0, extra_blocks=3):
    """A cache holding every request's context in shuffled blocks, and a table with column stride 2."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_request = max(-(-c // block_size) for c in context_lens) + 1
    num_blocks, table = paged_block_table([blocks_per_request] * len(context_lens), gen, spare_blocks=extra_blocks)
    cache = torch.randn(num_blocks, block_size, WIDTH, generator=gen)
    wide = torch.zeros(len(context_lens), 2 * table.shape[1], dtype=torch.int32)
    wide[:, ::2] = table
    return cache, wide[:, ::2]  # column stride 2


def run_gather(cache, table, cu, starts, k_scale, dtype, capacity):
    got = torch.full((capacity, WIDTH), NAN, dtype=dtype)
    want = got.clone()
    gather_context(cache, table, cu, starts, k_scale, got)
    gather_reference(cache, table, cu, starts, k_scale, want)
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_gather_matches_reference(block_size, dtype):
    cache, table = paged_batch(block_size, [9, 0, 13, 6])
    cache = cache.to(dtype)
    starts = int32([3, 0, 2, 0])  # request 1 takes 0 rows; starts > 0 cross block boundaries
    cu = int32([0, 6, 6, 17, 23])
    got, want = run_gather(cache, table, cu, starts, None, dtype, capacity=70)  # 3 row tiles of 32
    torch.testing.assert_close(got, want, **EXACT)
    assert got[23:].isnan().all(), "rows past cu_seq_lens[-1] must stay untouched"


def test_gather_single_request_and_strided_cache_and_workspace():
    wide, table = paged_batch(4, [11], seed=1)
    cache = wide.transpose(0, 1).contiguous().transpose(0, 1)  # block stride != block_size * D
    cu, starts = int32([0, 8]), int32([3])
    base = torch.full((40, WIDTH + 5), NAN)
    got, want = base[:, 2 : 2 + WIDTH], base.clone()[:, 2 : 2 + WIDTH]
    gather_context(cache, table, cu, starts, None, got)
    gather_reference(cache, table, cu, starts, None, want)
    torch.testing.assert_close(got, want, **EXACT)
    assert base[:, :2].isnan().all() and base[:, 2 + WIDTH :].isnan().all() and got[8:].isnan().all()


def test_gather_bf16_cache_into_fp32_workspace():
    cache, table = paged_batch(4, [7, 5])
    cu, starts = int32([0, 5, 9]), int32([2, 1])
    got, want = run_gather(cache.bfloat16(), table, cu, starts, None, torch.float32, capacity=12)
    torch.testing.assert_close(got, want, **EXACT)


def test_gather_zero_rows_writes_nothing():
    cache, table = paged_batch(4, [5, 3])
    got, want = run_gather(cache, table, int32([0, 0, 0]), int32([5, 0]), None, torch.float32, capacity=40)
    assert got.isnan().all() and want.isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gather_fp8_cache_dequantizes_every_code(dtype):
    """All 256 e4m3fn codes (subnormals, ±0, NaN 0x7f / 0xff) land in the workspace."""
    block_size, num_blocks = 4, 3
    codes = torch.arange(256, dtype=torch.uint8)[torch.randperm(256, generator=torch.Generator().manual_seed(2))]
    bits = torch.cat([codes, codes[: num_blocks * block_size * WIDTH - 256]])
    cache = bits.view(num_blocks, block_size, WIDTH).view(torch.float8_e4m3fn)
    table = int32([[2, 0, 1]]).t().contiguous().t()  # [1, 3], column stride 1 via a transposed copy
    cu, starts = int32([0, 11]), int32([1])
    k_scale = torch.tensor([0.375])
    got, want = run_gather(cache, table, cu, starts, k_scale, dtype, capacity=33)
    torch.testing.assert_close(got, want, **EXACT)
    assert got[:11].isnan().sum() > 0 and got[11:].isnan().all()


def test_gather_over_a_fixed_capacity_device_schedule():
    context_lens = int32([5, 0, 14, 3])
    cache, table = paged_batch(4, context_lens.tolist(), seed=3)
    capacity, max_chunks = 8, 5  # needs 3 chunks; chunks 3 and 4 are empty
    starts, _, cu_seq_lens, _ = device_plan_tensors(context_lens, capacity, max_chunks)
    for k in range(max_chunks):
        got, want = run_gather(cache, table, cu_seq_lens[k], starts[k], None, torch.float32, capacity)
        torch.testing.assert_close(got, want, **EXACT, msg=lambda m: f"chunk {k}: {m}")


UP_TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "capacity, latent_rank, num_out, rows",
    [(70, 40, 50, 37), (20, 16, 16, 0), (20, 16, 16, 20), (130, 72, 200, 129)],
)
def test_up_project_matches_reference(capacity, latent_rank, num_out, rows, dtype):
    gen = torch.Generator().manual_seed(capacity + rows)
    workspace = (0.5 * torch.randn(capacity, latent_rank + 8, generator=gen)).to(dtype)
    latent = workspace[:, :latent_rank]  # row stride L+R, as the workspace view is
    weight = (torch.randn(num_out, latent_rank, generator=gen) / latent_rank**0.5).to(dtype)
    cu = int32([0, rows // 3, rows])
    got = torch.full((capacity, num_out), NAN, dtype=dtype)
    want = torch.full((capacity, num_out), NAN, dtype=torch.float64)
    up_project(latent, weight, cu, got)
    up_project_reference(latent.double(), weight.double(), cu, want)
    torch.testing.assert_close(got[:rows].double(), want[:rows], **UP_TOLERANCE[dtype])
    assert got[rows:].isnan().all(), "rows past cu_seq_lens[-1] must stay untouched"


MERGE_TOLERANCE = {
    torch.float32: dict(atol=1e-6, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.float64: dict(atol=1e-12, rtol=1e-12),
}
INF = float("inf")
EMPTY_PAIRS = [(INF, -INF), (-INF, INF), (INF, INF), (-INF, -INF), (INF, 2.0), (-INF, -3.0), (1.5, INF)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("tokens, heads, head_dim", [(7, 3, 20), (3, 11, 130)])
def test_merge_matches_reference(tokens, heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(tokens * heads)
    prefix_out = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    suffix_out = torch.randn(heads, tokens, head_dim, generator=gen).to(dtype).transpose(0, 1)  # strided
    prefix_lse = 3 * torch.randn(heads, tokens, generator=gen)
    suffix_lse = (3 * torch.randn(tokens, heads, generator=gen)).t()  # strided [N, T]
    for i, (a, b) in enumerate(EMPTY_PAIRS):
        prefix_lse[i % heads, i % tokens], suffix_lse[i % heads, i % tokens] = a, b
    got_out, got_lse = merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse)
    want_out, want_lse = merge_states_reference(prefix_out, prefix_lse, suffix_out, suffix_lse)
    assert got_out.dtype == want_out.dtype and got_lse.dtype == want_lse.dtype
    assert not got_out.isnan().any() and not got_lse.isnan().any()
    torch.testing.assert_close(got_lse, want_lse, **MERGE_TOLERANCE[dtype if dtype == torch.float64 else torch.float32])
    torch.testing.assert_close(got_out, want_out, **MERGE_TOLERANCE[dtype])


def test_merge_two_empty_partials_give_zero_and_minus_inf():
    out = torch.randn(2, 3, 8)
    lse_a = torch.tensor([[INF, -INF], [INF, INF], [-INF, -INF]])
    got_out, got_lse = merge_attn_states(out, lse_a, out.clone(), lse_a.flip(1).contiguous())
    assert torch.equal(got_out, torch.zeros_like(out))
    assert torch.equal(got_lse, torch.full((3, 2), -INF))
