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


def test_index_scores_read_fp8_per_token_keys():
    from mla_ops.ops.indexer import chunk_scores_reference, index_topk_chunked
    from mla_ops.triton.indexer import chunk_scores
    from tests.support.indexer import check_topk, indexer_batch

    topk, block = 6, 4
    batch = indexer_batch([21, 0, 3, 9], [3, 7, 2, 1], topk, block_size=block, width=20, dtype=torch.float16,
                          seed=1, stored=per_token_round_trip)
    packed = pack_per_token(batch.index_cache.float())
    args = (batch.q_index, batch.index_weights, batch.k_index, packed)
    plan = batch.plan(topk, 16, 32)
    s = plan.index_schedule
    for i in range(s.max_chunks):
        got, want = (torch.full((s.tokens, s.rows), 7.0) for _ in range(2))
        chunk = (*args, plan.block_table, plan.query_start_loc, plan.context_lens, s.starts[i], s.cu_seq_lens[i],
                 s.token_start.narrow(0, i, 1), s.token_end.narrow(0, i, 1), None)
        chunk_scores(*chunk, got)
        chunk_scores_reference(*chunk, want)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), i
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for max_chunks in (None, 24):
        plan = batch.plan(topk, 16, 32, max_chunks=max_chunks)
        s = plan.index_schedule
        top = index_topk_chunked(chunk_scores, *args, plan.block_table, plan.query_start_loc, plan.context_lens,
                                 plan.sparse, s.starts, s.cu_seq_lens, s.token_start, s.token_end, None,
                                 plan.index_topk, s.rows, s.tokens)
        check_topk(top, batch.expected, topk)


def per_token_round_trip(cache):
    codes, scale = per_token_quantize(cache.flatten(0, 1))
    return (codes.view(torch.float8_e4m3fn).float() * scale[:, None]).view(cache.shape)


def pack_per_token(cache):
    import mla_ops

    num_blocks, block_size, width = cache.shape
    packed = torch.zeros(num_blocks, block_size, width + 4, dtype=torch.uint8)
    mla_ops.write_index_cache(cache.flatten(0, 1), torch.arange(num_blocks * block_size), packed,
                              index_cache_format="fp8_per_token")
    return packed
