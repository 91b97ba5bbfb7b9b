"""Context parallel's cost model (mla_ops/parallel/config.py): the documented byte and FLOP formulas,
and the routing between the all-gather and absorbed-queries paths on host and device."""

import dataclasses

import numpy as np
import torch

from mla_ops import parallel


def test_cost_model_bytes_and_flops_follow_the_documented_formulas():
    model = parallel.CostModel()  # DeepSeek-V3: 128 heads, L=512, P=128, R=64, V=128, bf16, fp32 partials
    k = model.path_costs(np.array([1000]), np.array([10]), 8)  # 16 heads per rank
    assert k["all_gather_bytes"][0] == 1000 * 7 / 8 * 576 * 2
    assert k["absorbed_bytes"][0] == 10 * 16 * 7 * (576 * 2 + 513 * 4)
    assert k["all_gather_flops"][0] == 16 * 1000 * (2 * 512 * 256 + 10 * 2 * 320)
    assert k["absorbed_flops"][0] == 16 * 10 * (2 * 128 * 512 * 2 + 1000 * 2 * 1088)
    one = model.path_costs(np.array([1000]), np.array([10]), 1)
    assert one["all_gather_bytes"][0] == 0 and one["absorbed_bytes"][0] == 0  # one rank moves nothing


def test_cost_model_routes_by_queries_and_context_on_host_and_device():
    model = parallel.CostModel()
    ctx = np.array([100_000, 100_000, 50, 4096, 0])
    queries = np.array([1, 4096, 1, 64, 8])
    host = model.prefers_absorbed(ctx, queries, 8)
    device = model.prefers_absorbed(torch.tensor(ctx, dtype=torch.int32), torch.tensor(queries, dtype=torch.int32), 8)
    assert host.tolist() == device.tolist()
    assert host[0] and not host[1]  # long context: few queries gather their queries, many gather the rows
    # The two terms: a slow link decides by bytes alone, a free one by FLOPs alone.
    k = model.path_costs(ctx, queries, 8)
    slow_link = dataclasses.replace(model, flops_per_byte=1e12).prefers_absorbed(ctx, queries, 8)
    assert slow_link.tolist() == (k["absorbed_bytes"] < k["all_gather_bytes"]).tolist()
    free_link = dataclasses.replace(model, flops_per_byte=0.0).prefers_absorbed(ctx, queries, 8)
    assert free_link.tolist() == (k["absorbed_flops"] < k["all_gather_flops"]).tolist()
    assert slow_link.tolist() != free_link.tolist()  # the batch is one where the two terms disagree
