"""mla_prefill with per-request routing between the absorbed and the chunked MHA path: every split
(none, some, all routed) on every planning path equals the pure-MHA result and the dense reference;
fp8 caches; bad routing options; routing under torch.compile."""

import pytest
import torch

import mla_ops
from tests.support.batches import ROUTING_MIX, assert_close_to_reference, make_batch

CONTEXT_LENS, QUERY_LENS = ROUTING_MIX
SPLITS = [0, 8, 64]


@pytest.mark.parametrize("absorb", SPLITS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("block_size", [1, 16])
def test_every_split_matches_the_dense_reference(absorb, dtype, block_size):
    batch = make_batch(CONTEXT_LENS, QUERY_LENS, seed=absorb, block_size=block_size, dtype=dtype)
    ref = batch.reference()
    pure_mha = batch.run(workspace_size=7)
    for out in (
        batch.run(workspace_size=7, absorb_max_query_len=absorb),
        batch.run(workspace_size=7, absorb_max_query_len=absorb, max_chunks=40),
        batch.run(workspace_size=7, absorb_max_query_len=absorb, max_chunks=40, max_absorbed_tokens=64),
        batch.run(workspace_size=7, absorb_max_query_len=absorb, policy="whole_requests"),
    ):
        assert_close_to_reference(out, ref, dtype, f"absorb<={absorb}")
        torch.testing.assert_close(out, pure_mha, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("bad", [-1, 2.5, "4"])
def test_bad_capacity(bad):
    batch = make_batch([3], [2], seed=0)
    with pytest.raises((ValueError, TypeError), match="max_absorbed_tokens"):
        batch.run(max_absorbed_tokens=bad)


def test_fp8_cache_on_both_paths():
    batch = make_batch(CONTEXT_LENS, QUERY_LENS, seed=4, fp8_scale=0.5, dtype=torch.float32)
    assert_close_to_reference(batch.run(workspace_size=9, absorb_max_query_len=8), batch.reference(), torch.float32)


def test_bad_threshold():
    batch = make_batch([3], [2], seed=0)
    with pytest.raises(ValueError, match="absorb_max_query_len"):
        batch.run(absorb_max_query_len=-1)


def test_routing_under_compile_matches_eager():
    mla_ops.enable()
    batch = make_batch(CONTEXT_LENS, QUERY_LENS, seed=6, dtype=torch.float32)

    def step(*args):  # 14 routed tokens; the 4 of the default capacity (16 // 4) would truncate the MHA chunks
        return mla_ops.mla_prefill(*args, workspace_size=16, max_chunks=8, absorb_max_query_len=8,
                                   max_absorbed_tokens=14)

    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(*batch.args()), step(*batch.args()), rtol=1e-5, atol=1e-5)
