"""Context parallel's cache layout (mla_ops/parallel/layout.py): ``shard_context`` and
``local_context_lens`` follow vLLM's interleaved layout; bad arguments are named."""

import numpy as np
import pytest
import torch

import mla_ops
from mla_ops import parallel
from tests.support.batches import FP8, paged_cache


def row(cache, table, r, p):
    return cache[table[r, p // cache.shape[1]].long(), p % cache.shape[1]]


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (3, 2), (4, 4), (2, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, FP8])
def test_shard_context_follows_the_vllm_layout(world, interleave, dtype):
    contexts = [0, 1, 17, 64, 5, 33]
    cache, table, ctx = paged_cache(contexts, 4, 6, seed=world * 10 + interleave, dtype=dtype)
    bits = lambda x: x.view(torch.uint8) if x.dtype == FP8 else x  # noqa: E731  (compare fp8 bit for bit)
    held = {r: [] for r in range(len(contexts))}
    for rank in range(world):
        local_cache, local_table = mla_ops.shard_context(cache, table, ctx, rank=rank, world_size=world,
                                                         interleave=interleave)
        assert local_cache.dtype == dtype and local_table.dtype == torch.int32
        lens = parallel.local_context_lens(ctx, rank, world, interleave)
        assert torch.equal(lens, torch.tensor(parallel.local_context_lens(np.array(contexts), rank, world,
                                                                                  interleave), dtype=torch.int32))
        for r, c in enumerate(contexts):
            owned = [p for p in range(c) if (p // interleave) % world == rank]
            assert int(lens[r]) == len(owned)
            for p in owned:
                j = (p // (interleave * world)) * interleave + p % interleave
                assert torch.equal(bits(row(local_cache, local_table, r, j)), bits(row(cache, table, r, p)))
            held[r] += owned
    assert all(sorted(held[r]) == list(range(c)) for r, c in enumerate(contexts))  # each row exactly once


def test_shard_context_rejects_bad_arguments():
    cache, table, ctx = paged_cache([5, 9], 4, 6, seed=0)
    with pytest.raises(ValueError, match="rank must be an int in"):
        mla_ops.shard_context(cache, table, ctx, rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        mla_ops.shard_context(cache, table, ctx, rank=0, world_size=0)
    with pytest.raises(ValueError, match="block_table row 1 has 1 blocks"):
        mla_ops.shard_context(cache, table[:, :1], ctx, rank=0, world_size=1)
    with pytest.raises(TypeError, match="context_lens must be int32"):
        mla_ops.shard_context(cache, table, ctx.long(), rank=0, world_size=1)


def test_an_interleave_past_int32_is_refused_by_name():
    with pytest.raises(ValueError, match=r"interleave must be at most 2\*\*31 - 1"):
        mla_ops.ContextParallel(interleave=2**31)
