"""The bucketing and padding contract (mla_ops.serving.buckets), shared by PrefillGraphs and Generator."""

import numpy as np
import pytest

import mla_ops
from mla_ops.serving.buckets import Bucket, Buckets, padded_lengths, powers_of_two_up_to


def test_default_buckets_are_powers_of_two_up_to_the_maxima():
    assert powers_of_two_up_to(100, 16) == (16, 32, 64, 100)
    assert powers_of_two_up_to(16, 16) == (16,)
    buckets = Buckets.build(max_tokens=40, max_requests=3)
    assert buckets == Buckets(tokens=(16, 32, 40), requests=(1, 2, 3), chunks=(1, 2, 4, 8, 16))
    assert buckets.all()[0] == Bucket(40, 3, 16) and buckets.all()[-1] == Bucket(16, 1, 1)
    assert len(buckets.all()) == 3 * 3 * 5


def test_bucket_lists_are_checked():
    with pytest.raises(ValueError, match="token_buckets must not exceed 32"):
        Buckets.build(32, 2, tokens=(16, 64))
    with pytest.raises(TypeError, match="chunk_buckets must be a sequence of positive ints"):
        Buckets.build(32, 2, chunks="1,2")
    with pytest.raises(ValueError, match="request_buckets must hold at least one size"):
        Buckets.build(32, 2, requests=())
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        Buckets.build(0, 2)
    # Token and request counts become int32 lengths: past int32 they would wrap around.
    with pytest.raises(ValueError, match=r"max_tokens must be at most 2\*\*31 - 1"):
        Buckets.build(2**31, 2)
    with pytest.raises(ValueError, match=r"max_requests must be at most 2\*\*31 - 1"):
        Buckets.build(32, 2**31)
    with pytest.raises(ValueError, match=r"chunk_buckets must be at most 2\*\*31 - 1"):
        Buckets.build(32, 2, chunks=(1, 2**31))


def test_choose_takes_the_smallest_bucket_and_counts_only_chunked_context():
    buckets = Buckets.build(64, 4, chunks=(1, 2, 4))
    options = mla_ops.PlanOptions(block_size=4, workspace_size=8, max_chunks=4, absorb_max_query_len=2)
    qsl, ctx = np.array([0, 5, 6, 20]), np.array([9, 30, 0])  # request 1 (one token) is absorbed
    assert buckets.choose(qsl, ctx, options) == Bucket(32, 4, 2)  # 9 chunked rows: 2 chunks of 8
    no_routing = mla_ops.PlanOptions(block_size=4, workspace_size=8, max_chunks=4, absorb_max_query_len=0)
    assert buckets.choose(qsl, ctx, no_routing) is None  # 39 rows need 5 chunks: beyond the largest
    assert buckets.choose(np.array([0, 65]), np.array([0]), options) is None  # 65 tokens


def test_padding_order_real_requests_then_sentinels_then_the_padding_request():
    lengths = padded_lengths(Bucket(tokens=16, requests=4, chunks=1), np.array([0, 3, 5]), np.array([7, 0]))
    qsl, ctx = lengths[:6], lengths[6:]
    assert qsl.tolist() == [0, 3, 5, 5, 5, 16]  # 2 real requests, 2 empty sentinels, the padding request
    assert ctx.tolist() == [7, 0, 0, 0, 0]
    assert lengths.dtype == np.int32


def test_prefill_graphs_buckets_and_plans_with_one_options_object():
    model = mla_ops.MLAModel(mla_ops.MLAConfig.from_name("tiny"))
    runner = mla_ops.PrefillGraphs(model, max_tokens=32, max_requests=2, max_blocks_per_request=4, block_size=4,
                                   workspace_size=8, mode="eager", max_absorbed_tokens=3)
    assert runner.variants == runner.buckets.all() == Buckets.build(32, 2).all()
    options = runner.options
    assert (options.block_size, options.workspace_size, options.max_chunks) == (4, 8, 16)
    # None routes by the cost model at the model's own dims (tiny: L=32, P=16, R=8, V=16), not DeepSeek's 170.
    assert options.absorb_threshold == mla_ops.routing.cost_model_threshold(32, 16, 8, 16) == 32
    assert model.config.default_absorb_max_query_len == 32
    assert options.absorbed_capacity == 3
    with pytest.raises(ValueError, match="max_absorbed_tokens must be an int >= 0"):
        mla_ops.PrefillGraphs(model, max_tokens=32, max_requests=2, max_blocks_per_request=4, block_size=4,
                              workspace_size=8, mode="eager", max_absorbed_tokens=-1)
