"""The Triton absorbed context attention launcher against its torch oracle, under Triton's CPU
interpreter (this directory is its own pytest run, with TRITON_INTERPRET=1 set before import).

q [T, N, P+R]   kv_cache [num_blocks, block_size, L+R]   kv_b_proj_weight [N*(P+V), L]
-> out [T, N, V], lse [N, T]; rows of requests without context stay untouched (NaN sentinels).

Tiny dims (N=3, L=32, R=8, P=V=8): the interpreter's tiles (16 rows, 16 keys, 16-wide value
slices) still cover several key tiles, masked remainders, two value slices and packed heads.
The cache is NaN outside the context rows, so a load that is not masked out shows.
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 set before import", allow_module_level=True)
pytest.importorskip("triton")

import torch  # noqa: E402

from mla_ops.ops.absorbed import absorbed_reference  # noqa: E402
from mla_ops.triton import _common  # noqa: E402
from mla_ops.triton.absorbed import absorbed_context_attention  # noqa: E402
from tests.support.batches import context_batch, written_rows  # noqa: E402

NAN = float("nan")
SMALL = dict(N=3, L=32, R=8, P=8, V=8)
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}  # bf16: upcast to fp32 here
# T = 17 and 1 queries, zero context with queries, context without queries, > 2 key tiles.
CONTEXTS, QUERIES = [5, 0, 19, 3, 40, 1], [1, 3, 17, 0, 2, 1]


def check(batch, dtype, value_dim=SMALL["V"], strided_outputs=False, max_absorbed_tokens=-1):
    got, got_lse = batch.sentinels(value_dim, dtype=dtype)
    if strided_outputs:  # out a head slice of a wider buffer, lse a token slice of one
        got = torch.cat([got, got], dim=1)[:, 1::2]
        got_lse = torch.cat([got_lse, got_lse], dim=1)[:, got_lse.shape[1] :]
    want, want_lse = batch.sentinels(value_dim, dtype=torch.float32)
    absorbed_context_attention(*batch.absorbed_args(), got, got_lse, max_absorbed_tokens)
    absorbed_reference(*batch.absorbed_args(), want, want_lse)
    written = written_rows(batch)
    assert torch.isnan(got[~written]).all() and torch.isnan(got_lse[:, ~written]).all(), "zero-context rows touched"
    assert not torch.isnan(got[written]).any() and not torch.isnan(got_lse[:, written]).any()
    err = (got[written].float() - want[written]).abs().max().item()
    lse_err = (got_lse[:, written] - want_lse[:, written]).abs().max().item()
    scale = max(1.0, want[written].abs().max().item())
    assert err <= TOL[dtype] * scale and lse_err <= TOL[dtype] * 4, f"max abs diff out {err:.3e}, lse {lse_err:.3e}"
    return got, got_lse


@pytest.mark.parametrize("num_programs", [1, 2])
def test_packed_routed_tokens_with_strided_programs(num_programs, monkeypatch):
    # A scratch of exactly the routed tokens' rows; 1 or 2 programs stride over every fold,
    # attention and unfold tile, and give the bits of one program per tile.
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, seed=4, **SMALL)
    routed = int(written_rows(batch).sum())
    monkeypatch.setattr(_common, "PROGRAMS_OVERRIDE", num_programs)
    got = check(batch, torch.float32, max_absorbed_tokens=routed)
    monkeypatch.setattr(_common, "PROGRAMS_OVERRIDE", 10_000)
    one_per_tile = check(batch, torch.float32, max_absorbed_tokens=routed)
    for a, b in zip(got, one_per_tile):
        torch.testing.assert_close(a, b, atol=0.0, rtol=0.0, equal_nan=True)


def test_tokens_past_the_capacity_get_no_partial():
    # A caller's error (the plan never does it): the rows past the scratch are neither read nor written.
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, seed=5, **SMALL)
    out, lse = batch.sentinels(SMALL["V"])
    absorbed_context_attention(*batch.absorbed_args(), out, lse, 3)  # token 0 (request 0), tokens 4, 5 (request 2)
    want, want_lse = batch.sentinels(SMALL["V"])
    absorbed_reference(*batch.absorbed_args(), want, want_lse)
    packed = torch.zeros(out.shape[0], dtype=torch.bool)
    packed[[0, 4, 5]] = True
    assert torch.isnan(out[~packed]).all() and torch.isnan(lse[:, ~packed]).all()
    torch.testing.assert_close(out[packed], want[packed], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse[:, packed], want_lse[:, packed], atol=1e-4, rtol=1e-4)


def test_nothing_routed_writes_nothing():
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, seed=6, **SMALL)
    batch.context_lens = torch.zeros_like(batch.context_lens)  # no request takes the absorbed path
    out, lse = batch.sentinels(SMALL["V"])
    absorbed_context_attention(*batch.absorbed_args(), out, lse, 4)
    assert torch.isnan(out).all() and torch.isnan(lse).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_matches_reference(block_size, dtype):
    check(context_batch(CONTEXTS, QUERIES, block_size=block_size, dtype=dtype, seed=block_size, **SMALL), dtype)


@pytest.mark.parametrize("scale", [0.0, -0.7])  # 0: uniform weights; < 0: masked keys must stay out
def test_zero_and_negative_scales(scale):
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, seed=7, **SMALL)
    batch.softmax_scale = scale
    check(batch, torch.float32)


def test_single_query_and_many_head_groups():
    dims = dict(SMALL, N=20)  # 16 heads per tile: two head groups, the second mostly masked
    check(context_batch([7], [1], block_size=4, dtype=torch.float32, **dims), torch.float32)
    check(context_batch([33, 0, 2], [17, 1, 5], block_size=16, dtype=torch.float32, seed=1, **dims), torch.float32)


def test_fp8_cache():
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, fp8_scale=0.25, **SMALL)
    check(batch, torch.float32)


def test_fp8_nan_codes_stay_inside_their_rows():
    # A NaN code (0x7f) in request 0's context poisons only request 0; the NaN codes the cache
    # holds outside context rows (partial blocks, unused blocks) must never be read.
    batch = context_batch([6, 9], [2, 3], block_size=4, dtype=torch.float32, fp8_scale=0.5, **SMALL)
    bits = batch.kv_cache.view(torch.uint8)
    assert (bits == 0x7F).any(), "the cache holds NaN codes outside the context rows"
    bits[batch.block_table[0, 1], 1, 3] = 0x7F  # request 0, context position 5
    out, lse = batch.sentinels(SMALL["V"])
    absorbed_context_attention(*batch.absorbed_args(), out, lse)
    assert torch.isnan(out[:2]).all() and not torch.isnan(out[2:]).any()
    want, want_lse = batch.sentinels(SMALL["V"])
    absorbed_reference(*batch.absorbed_args(), want, want_lse)
    torch.testing.assert_close(out[2:], want[2:], atol=1e-4, rtol=1e-4)


def test_bfloat16():
    check(context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.bfloat16, seed=2, **SMALL), torch.bfloat16)


def test_strided_inputs_and_outputs():
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, seed=3, **SMALL)
    width = batch.kv_cache.shape[2]
    wide = torch.full((*batch.kv_cache.shape[:2], width + 5), float("nan"))
    wide[..., 2 : 2 + width] = batch.kv_cache
    batch.kv_cache = wide[..., 2 : 2 + width]  # block and row strides != block_size * (L+R), L+R
    batch.q = torch.cat([batch.q, batch.q], dim=-1)[..., 3 : 3 + batch.q.shape[-1]].copy_(batch.q)
    check(batch, torch.float32, strided_outputs=True)
