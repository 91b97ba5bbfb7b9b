"""benchmarks/_lib: the cost model, the JSON writer, the dims and the batch builders."""

import json

import pytest
import torch

import mla_ops
from benchmarks._lib import batches, report
from benchmarks._lib.costs import modeled_flops
from benchmarks._lib.timing import best_of_interleaved_s, thread_time_samples

pytestmark = pytest.mark.bench


def test_modeled_flops_at_the_cost_model_break_even():
    # 170 is the cost model's break-even at DeepSeek's dims: routed at 170, MHA at 171.
    flops = modeled_flops([1000, 1000], [170, 171], 16, 512, 128, 64, 128, absorb_max_query_len=170)
    assert flops["routed"] < flops["mha_only"]
    assert flops["absorbed_context_tokens"] == 1000 and flops["mha_context_tokens"] == 1000
    assert mla_ops.planning.routing.cost_model_threshold(512, 128, 64, 128) == 170


def test_dims_come_from_the_model_presets():
    assert batches.V2_LITE == (16, 512, 128, 64, 128) and batches.V3 == (128, 512, 128, 64, 128)
    assert batches.V2_LITE.header() == dict(N=16, L=512, P=128, R=64, V=128)


def test_paged_batch_places_every_request_in_its_own_blocks():
    dims = batches.Dims(2, 16, 8, 4, 8)
    x = batches.paged_batch([40, 0, 23], [5, 3, 1], dims, 16, "cpu", torch.float32)
    assert x["q"].shape == (9, 2, 12) and x["kv_cache"].shape == (3 + 2 + 1, 16, 20)
    assert x["kv_b_proj_weight"].shape == (2 * 16, 16) and x["query_start_loc"].tolist() == [0, 5, 8, 9]
    used = x["block_table"][0, :3].tolist() + x["block_table"][2, :2].tolist()
    assert len(set(used)) == 5  # no block shared
    out = mla_ops.mla_prefill(**x, softmax_scale=12 ** -0.5, workspace_size=32)
    assert out.shape == (9, 2, 8) and torch.isfinite(out).all()


def test_json_with_one_line_per_step_reads_back(tmp_path):
    obj = {"a": 1, "nested": {"b": [1, 2]}, "steps": [{"x": 1, "y": [1, 2]}, {"x": 2, "y": []}],
           "ratios": {"packed": [0.5, 0.25], "whole": []}}
    path = tmp_path / "out" / "r.json"
    report.write_json_atomic(path, obj, one_line=("steps", "ratios"))
    text = path.read_text()
    assert json.loads(text) == obj
    assert '{"x":1,"y":[1,2]},\n' in text and '"packed": [0.5,0.25],\n' in text
    report.write_json_atomic(path, {"steps": []}, one_line=("steps",))
    assert json.loads(path.read_text()) == {"steps": []}


def test_interleaved_timers_call_every_variant_in_every_round():
    calls = []
    best = best_of_interleaved_s({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3)
    assert set(best) == {"a", "b"} and calls == ["a", "b"] * 4  # one warm-up round, then 3
    calls.clear()
    samples, results = thread_time_samples({"a": lambda: calls.append("a") or 1, "b": lambda: 2}, rounds=4)
    assert results == {"a": 1, "b": 2} and [len(s) for s in samples.values()] == [4, 4]
