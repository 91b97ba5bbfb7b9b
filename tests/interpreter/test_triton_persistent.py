"""Persistent launches: gather, up-projection and attention with grids far smaller than their
work (1 or 2 programs, so every program strides over many tiles), on every chunk of a device
schedule, the empty ones past the chunk count included, against the torch oracles and against
the same kernel with one program per tile. Under Triton's CPU interpreter (this folder's run).
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (make test does)", allow_module_level=True)
pytest.importorskip("triton")

import torch  # noqa: E402

from mla_ops.ops.attention import context_attention_reference  # noqa: E402
from mla_ops.planning.device_schedule import device_plan_tensors  # noqa: E402
from mla_ops.ops.gather import gather_reference  # noqa: E402
from mla_ops.ops.attention import suffix_attention_reference  # noqa: E402
from mla_ops.triton import _common, attention, gather, rows_gemm  # noqa: E402
from mla_ops.ops.up_projection import up_project_reference  # noqa: E402

NAN = float("nan")
EXACT = dict(atol=0.0, rtol=0.0, equal_nan=True)
MANY = 10_000  # one program per tile: the grid functions cap at the tile capacity


def int32(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.fixture
def programs(monkeypatch):
    def set_programs(n):
        monkeypatch.setattr(_common, "PROGRAMS_OVERRIDE", n)

    return set_programs


def device_schedule(context_lens, capacity, max_chunks):
    starts, seq_lens, cu_seq_lens, num_chunks = device_plan_tensors(int32(context_lens), capacity, max_chunks)
    assert int(num_chunks) < max_chunks, "the test needs chunks past the count"
    return starts, seq_lens, cu_seq_lens


def test_grids_are_capped_by_programs_and_tiles():
    assert gather.grid(65536, 576, 264) == (264,)
    assert gather.grid(32, 576, 264) == (9,)  # one row tile of 9 column tiles
    assert rows_gemm.grid(65536, 32768, 128, 128, 264) == (264,)
    assert rows_gemm.grid(100, 200, 64, 64, 264) == (2 * 4,)
    assert rows_gemm.grid(100, 200, 64, 64, 264, num_batch=3) == (2 * 4 * 3,)
    assert attention.grid(16, 3, 2, 16, 5) == (5,)
    assert attention.grid(16, 3, 2, 16, 100) == ((16 // 16 + 3) * 2,)


@pytest.mark.parametrize("num_programs", [1, 2])
def test_gather_strides_over_every_chunk(num_programs, programs):
    context_lens, block_size, width, capacity, max_chunks = [5, 0, 40, 3], 4, 24, 36, 5
    gen = torch.Generator().manual_seed(0)
    num_blocks = 44
    cache = torch.randn(num_blocks, block_size, width, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[: 4 * 10].int().view(4, 10)  # 10 blocks: 40 tokens
    starts_k, _, cu_k = device_schedule(context_lens, capacity, max_chunks)
    for k in range(max_chunks):
        results = []
        for n in (num_programs, MANY):
            programs(n)
            got = torch.full((capacity, width), NAN)
            gather.gather_context(cache, table, cu_k[k], starts_k[k], None, got)
            results.append(got)
        want = torch.full((capacity, width), NAN)
        gather_reference(cache, table, cu_k[k], starts_k[k], None, want)
        torch.testing.assert_close(results[0], want, **EXACT, msg=lambda m: f"chunk {k}: {m}")
        torch.testing.assert_close(results[0], results[1], **EXACT)


@pytest.mark.parametrize("num_programs", [1, 3])
@pytest.mark.parametrize("rows", [0, 5, 70])
def test_up_project_strides_over_live_tiles(rows, num_programs, programs):
    capacity, latent_rank, num_out = 80, 16, 40  # 64 x 64 tiles here: up to 2 x 1 tiles
    gen = torch.Generator().manual_seed(rows)
    latent = torch.randn(capacity, latent_rank, generator=gen)
    weight = torch.randn(num_out, latent_rank, generator=gen) / 4
    cu = int32([0, rows // 2, rows])
    programs(num_programs)
    got = torch.full((capacity, num_out), NAN)
    rows_gemm.up_project(latent, weight, cu, got)
    want = torch.full((capacity, num_out), NAN, dtype=torch.float64)
    up_project_reference(latent.double(), weight.double(), cu, want)
    torch.testing.assert_close(got[:rows].double(), want[:rows], atol=1e-5, rtol=1e-5)
    assert got[rows:].isnan().all(), "rows past cu_seq_lens[-1] must stay untouched"


def attention_inputs(q_lens, rows, heads, seed, dims=(6, 2, 5)):
    gen = torch.Generator().manual_seed(seed)
    nope, rope, value = dims
    q = torch.randn(sum(q_lens), heads, nope + rope, generator=gen)
    k_nope = torch.randn(rows, heads, nope, generator=gen)
    k_pe = torch.randn(rows, rope, generator=gen)
    v = torch.randn(rows, heads, value, generator=gen)
    return q, k_nope, k_pe, v


@pytest.mark.parametrize("num_programs", [1, 2])
def test_context_attention_strides_over_the_live_requests_of_every_chunk(num_programs, programs):
    """Only the live run of requests is written; earlier chunks' partials are merged, the rest kept."""
    context_lens, q_lens, capacity, max_chunks, heads = [0, 7, 20, 0, 4, 0], [3, 18, 2, 5, 1, 2], 9, 6, 2
    starts_k, _, cu_k = device_schedule(context_lens, capacity, max_chunks)
    query_start_loc = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q, k_nope, k_pe, v = attention_inputs(q_lens, capacity, heads, seed=1)
    tokens, value = q.shape[0], v.shape[-1]
    gen = torch.Generator().manual_seed(2)
    base_out = torch.randn(tokens, heads, value, generator=gen)  # a stand-in running partial
    base_lse = torch.randn(heads, tokens, generator=gen)
    for k in range(max_chunks):
        results = []
        for n in (num_programs, MANY):
            programs(n)
            out, lse = base_out.clone(), base_lse.clone()
            attention.context_attention(q, k_nope, k_pe, v, query_start_loc, cu_k[k], starts_k[k], 0.3, out, lse)
            results.append((out, lse))
        want_out, want_lse = base_out.clone(), base_lse.clone()
        context_attention_reference(q, k_nope, k_pe, v, query_start_loc, cu_k[k], starts_k[k], 0.3, want_out, want_lse)
        torch.testing.assert_close(results[0][0], want_out, atol=1e-5, rtol=1e-5, msg=lambda m: f"chunk {k}: {m}")
        torch.testing.assert_close(results[0][1], want_lse, atol=1e-5, rtol=1e-5, msg=lambda m: f"chunk {k}: {m}")
        torch.testing.assert_close(results[0], results[1], **EXACT)


@pytest.mark.parametrize("num_programs", [1, 2])
def test_suffix_attention_strides_over_every_tile(num_programs, programs):
    q_lens, heads = [0, 17, 3, 0, 20], 2
    query_start_loc = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q, k_nope, k_pe, v = attention_inputs(q_lens, sum(q_lens), heads, seed=3)
    programs(num_programs)
    out, lse = torch.full((q.shape[0], heads, v.shape[-1]), NAN), torch.full((heads, q.shape[0]), NAN)
    attention.suffix_attention(q, k_nope, k_pe, v, query_start_loc, 0.3, out, lse)
    want_out, want_lse = out.clone(), lse.clone()
    suffix_attention_reference(q, k_nope, k_pe, v, query_start_loc, 0.3, want_out, want_lse)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_programs", [1, 2])
@pytest.mark.parametrize("mapped", ["a", "c"])
def test_rows_gemm_maps_packed_rows_to_token_rows(mapped, num_programs, programs):
    # Per head: c[row(i)] = a[row(i)] @ w.T over the packed rows of requests 0, 2, 3 (request 1
    # and the padding token have none); token rows outside them stay untouched.
    tokens = int32([0, 3, 5, 10, 11, 12])  # 5 requests over 12 tokens
    loc = int32([0, 3, 3, 8, 9, 9])  # packed: request 1 and 4 absent
    token_of = torch.cat([torch.arange(0, 3), torch.arange(5, 10), torch.arange(10, 11)])
    heads, k, num_out, capacity = 3, 20, 18, 11  # 2 spare packed rows
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(heads, num_out, k + 2, generator=gen)[..., :k]  # strided
    programs(num_programs)
    if mapped == "a":
        a = torch.randn(12, heads, k + 4, generator=gen)  # the first k columns are read
        c = torch.full((capacity, heads, num_out), NAN)
        rows_gemm.rows_gemm(a, w, c, loc, tokens, map_a=True)
        want = torch.einsum("thk,hok->tho", a[token_of, :, :k], w)
        torch.testing.assert_close(c[:9], want, atol=1e-5, rtol=1e-5)
        assert torch.isnan(c[9:]).all()
    else:
        a = torch.randn(capacity, heads, k, generator=gen)
        c = torch.full((12, heads, num_out), NAN)
        rows_gemm.rows_gemm(a, w, c, loc, tokens, map_c=True)
        want = torch.einsum("thk,hok->tho", a[:9], w)
        torch.testing.assert_close(c[token_of], want, atol=1e-5, rtol=1e-5)
        untouched = torch.ones(12, dtype=torch.bool)
        untouched[token_of] = False
        assert torch.isnan(c[untouched]).all()
    programs(MANY)
    again = torch.full_like(c, NAN)
    rows_gemm.rows_gemm(a, w, again, loc, tokens, map_a=mapped == "a", map_c=mapped == "c")
    torch.testing.assert_close(again, c, **EXACT)
