"""The Triton kernels read vLLM's packed caches in place (DESIGN §12 "Production cache formats"), under
Triton's CPU interpreter, against the torch references: fp8_ds_mla latent rows (the chunk loop's gather,
the absorbed path, sparse attention) and fp8_per_token index keys (the indexer's scorer).

fp8_ds_mla fixes L = 512 and R = 64 (656-byte rows), so these use few tokens and heads.
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 set before import", allow_module_level=True)
pytest.importorskip("triton")

import torch  # noqa: E402

from mla_ops.ops.cache_formats import ds_mla_rows, ds_mla_values, per_token_quantize  # noqa: E402
from mla_ops.ops.gather import gather_reference  # noqa: E402
from mla_ops.triton.gather import gather_context  # noqa: E402


def packed_latent_cache(num_blocks, block_size, seed, nan_rows=()):
    """``(packed [num_blocks, block_size, 656] uint8, values [.., .., 576] float32)``: random rows with tiles
    of very different magnitudes; ``nan_rows`` (flat slots) hold NaN codes, so a read of them shows."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_blocks * block_size, 576, generator=g)
    rows[:, :512] *= torch.exp2(torch.randint(-6, 6, (num_blocks * block_size, 4, 1), generator=g)).repeat_interleave(
        128, 1).squeeze(-1)
    rows = rows.to(torch.bfloat16)
    packed = ds_mla_rows(rows[:, :512], rows[:, 512:])
    for slot in nan_rows:
        packed[slot, :512] = 0x7F  # e4m3fn NaN
    packed = packed.view(num_blocks, block_size, 656)
    return packed, ds_mla_values(packed)


@pytest.mark.parametrize("block_size", [1, 4])
def test_gather_dequantizes_fp8_ds_mla_rows(block_size):
    packed, _ = packed_latent_cache(12, block_size, seed=block_size, nan_rows=(0,))
    table = torch.tensor([[3, 5, 1, 7], [2, 9, 4, 6]], dtype=torch.int32)
    cu, starts = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)
    got, want = (torch.full((9, 576), 7.0) for _ in range(2))
    gather_context(packed, table, cu, starts, None, got)
    gather_reference(packed, table, cu, starts, None, want)
    assert torch.equal(got, want)
    assert torch.equal(got[7:], torch.full((2, 576), 7.0))  # rows past the count untouched


@pytest.mark.parametrize("width", [128, 256])  # D_I: one scale a key (after the dot), two (before it)
def test_index_scores_read_fp8_per_token_keys(width):
    from mla_ops.ops.indexer import chunk_scores_reference, index_topk_chunked
    from mla_ops.triton.indexer import chunk_scores
    from tests.support.indexer import check_topk, indexer_batch, plan_chunks

    topk, block = 6, 4
    batch = indexer_batch([21, 0, 3, 9], [3, 7, 2, 1], topk, block_size=block, width=width, dtype=torch.float16,
                          seed=1, stored=per_token_round_trip)
    packed = pack_per_token(batch.index_cache.float())
    args = (batch.q_index, batch.index_weights, batch.k_index, packed)
    plan = batch.plan(topk, 16, 32)
    for i, m, w, chunk in plan_chunks(args, plan, None):
        got, want = (torch.full((m, w), 7.0) for _ in range(2))
        chunk_scores(*chunk, got)
        chunk_scores_reference(*chunk, want)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), i
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for max_chunks in (None, 24):
        plan = batch.plan(topk, 16, 32, max_chunks=max_chunks)
        s = plan.index_schedule
        top = index_topk_chunked(chunk_scores, *args, plan.block_table, plan.query_start_loc, plan.context_lens,
                                 plan.sparse, s.starts, s.cu_seq_lens, s.token_start, s.token_end, None,
                                 plan.index_topk, s.rows, s.tokens, [m for m, _ in s.piece_shapes],
                                 [w for _, w in s.piece_shapes])
        check_topk(top, batch.expected, topk)


def per_token_round_trip(cache):
    codes, scale = per_token_quantize(cache.flatten(0, 1))  # [n, D] codes, [n, D/128] scales: one per 128 values
    values = codes.view(torch.float8_e4m3fn).float().unflatten(-1, (-1, 128)) * scale.unsqueeze(-1)
    return values.flatten(-2).view(cache.shape)


def pack_per_token(cache):
    import mla_ops

    num_blocks, block_size, width = cache.shape
    packed = torch.zeros(num_blocks, block_size, width + width // 32, dtype=torch.uint8)  # a float32 per 128
    mla_ops.write_index_cache(cache.flatten(0, 1), torch.arange(num_blocks * block_size), packed,
                              index_cache_format="fp8_per_token")
    return packed


# Few heads and tokens: fp8_ds_mla fixes L = 512 and R = 64.
DS_DIMS = dict(N=2, L=512, R=64, P=8, V=8)
DS_CONTEXTS, DS_QUERIES = [5, 0, 20, 3], [1, 3, 2, 2]


def ds_mla_context_batch(dtype, seed):
    """A batch (queries in ``dtype``) whose cache is packed fp8_ds_mla (NaN codes outside the contexts)."""
    from dataclasses import replace

    from tests.support.batches import context_batch

    batch = context_batch(DS_CONTEXTS, DS_QUERIES, seed=seed, block_size=4, dtype=torch.float32, **DS_DIMS)
    rows = batch.kv_cache.flatten(0, 1)
    packed = ds_mla_rows(rows[:, :512], rows[:, 512:]).view(*batch.kv_cache.shape[:2], 656)
    cast = {name: getattr(batch, name).to(dtype) for name in ("q", "kv_c", "k_pe", "kv_b_proj_weight")}
    return replace(batch, kv_cache=packed, k_scale=None, **cast)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_attention_reads_fp8_ds_mla_rows(dtype):
    from mla_ops.ops.sparse import sparse_reference
    from mla_ops.triton.sparse import sparse_attention
    from tests.support.sparse import random_topk

    batch = ds_mla_context_batch(dtype, seed=3)
    sparse = torch.tensor([True, True, True, False])
    topk = random_topk(DS_CONTEXTS, DS_QUERIES, 20, seed=1, sparse=sparse.tolist(), future=True)
    args = (batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.block_table, batch.query_start_loc,
            batch.context_lens, sparse, topk, batch.kv_b_proj_weight, batch.softmax_scale, None)
    got, got_lse = batch.sentinels(8, dtype=dtype)
    want, want_lse = batch.sentinels(8, dtype=torch.float32)
    sparse_attention(*args, got, got_lse)
    reference_args = [a.float() if isinstance(a, torch.Tensor) and a.dtype == dtype else a for a in args]
    sparse_reference(*reference_args, want, want_lse)
    rows = torch.repeat_interleave(sparse, (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).long())
    assert torch.isnan(got[~rows]).all() and not torch.isnan(got[rows]).any()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[rows].float(), want[rows], atol=tol, rtol=tol)
    torch.testing.assert_close(got_lse[:, rows], want_lse[:, rows], atol=4 * tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_absorbed_path_reads_fp8_ds_mla_rows(dtype):
    from mla_ops.ops.absorbed import absorbed_reference
    from mla_ops.triton.absorbed import absorbed_context_attention

    batch = ds_mla_context_batch(dtype, seed=4)
    args = batch.absorbed_args()
    got, got_lse = batch.sentinels(8, dtype=dtype)
    want, want_lse = batch.sentinels(8, dtype=torch.float32)
    absorbed_context_attention(*args, got, got_lse)
    absorbed_reference(*[a.float() if isinstance(a, torch.Tensor) and a.dtype == dtype else a for a in args],
                       want, want_lse)
    rows = torch.repeat_interleave(batch.context_lens > 0, (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).long())
    assert torch.isnan(got[~rows]).all() and not torch.isnan(got[rows]).any()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[rows].float(), want[rows], atol=tol, rtol=tol)
    torch.testing.assert_close(got_lse[:, rows], want_lse[:, rows], atol=4 * tol, rtol=0)


def test_a_dsa_step_on_both_formats_runs_on_the_triton_kernels():
    """run_prefill / index_topk with backend='triton' over fp8_ds_mla and fp8_per_token caches equal the torch
    kernels' (gather, up-projection and attention of the chunk loop, the absorbed path, sparse attention)."""
    import mla_ops
    from tests.support.sparse import random_topk

    batch = ds_mla_context_batch(torch.float32, seed=5)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, 4, 8,
                                absorb_max_query_len=1, index_topk=6, index_scores_budget=32)
    assert plan.sparse.any() and not plan.sparse.all()
    topk = random_topk(DS_CONTEXTS, DS_QUERIES, 6, seed=2, sparse=plan.sparse.tolist())
    outs = [mla_ops.run_prefill(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight,
                                batch.softmax_scale, plan, backend=backend, topk_indices=topk, return_lse=True,
                                kv_cache_format="fp8_ds_mla") for backend in ("triton", "torch")]
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=4e-4, rtol=0)
