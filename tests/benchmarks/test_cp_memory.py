"""benchmarks/cp_memory.py end to end with small arguments: the JSON's shape, the parameter count
against DeepSeek-V3's shapes written out here, and the bytes' formulas."""

import json
import math

import pytest
import torch.distributed as dist

from benchmarks import cp_memory

pytestmark = pytest.mark.bench


def deepseek_v3_parameters() -> int:
    """DeepSeek-V3's parameters without the Multi-Token-Prediction layer, from its published shapes."""
    h, vocab, layers, dense = 7168, 129280, 61, 3
    attention = (1536 * h + 1536 + 128 * 192 * 1536 + 576 * h + 512 + 128 * 256 * 512 + h * 128 * 128 + 2 * h)
    dense_mlp = 3 * 18432 * h
    moe = 256 * h + 256 + (256 + 1) * 3 * 2048 * h
    return 2 * vocab * h + h + layers * attention + dense * dense_mlp + (layers - dense) * moe


def test_cp_memory_runs_and_its_numbers_follow_the_shapes(tmp_path):
    if dist.is_initialized():
        pytest.skip("the script plans in a fake process group of its own")
    out = tmp_path / "cp_memory.json"
    result = cp_memory.main(["--json", str(out), "--world-sizes", "1,2,8", "--cached-tokens", "1000",
                             "--limit", "60"])
    assert json.loads(out.read_text()) == result
    assert not dist.is_initialized()  # the fake groups are gone
    assert set(result["parameters"]) == {"1", "2", "8"} and set(result["cache"]) == {"1000"}
    assert len(result["batches"]) == 4 and "headline" in result["batches"]
    assert result["batches"]["continuations"]["by_world_size"]["8"]["routed"]["absorbed_tokens"] == 64

    # D = 1: every tensor whole; bf16 = 2 bytes a parameter, the 58 routers' biases float32.
    one = result["parameters"]["1"]
    assert one["parameters"] == deepseek_v3_parameters() == 671_026_419_200
    assert one["bf16_bytes"] == 2 * one["parameters"] + 2 * 58 * 256
    # D = 8: the split tensors are an eighth; the whole ones (embeddings, lm_head, norms, q_a / kv_a, routers) stay.
    whole = 2 * 129280 * 7168 + 7168 + 61 * (1536 * 7168 + 1536 + 576 * 7168 + 512 + 2 * 7168) + 58 * (256 * 7168 + 256)
    assert result["parameters"]["8"]["parameters"] == whole + (one["parameters"] - whole) // 8

    # One request of 1,000 tokens at D = 8, interleave 1: 125 rows a rank, 2 blocks of 64.
    cache = result["cache"]["1000"]["8"]
    assert (cache["rows"], cache["blocks"], cache["fp8_bytes"]) == (125, 2, 2 * 64 * 576 * 61)

    headline = result["batches"]["headline"]
    assert (headline["requests"], headline["context_tokens"], headline["new_tokens"]) == (32, 60496, 32 * 513)
    for entry in result["batches"].values():
        d1 = entry["by_world_size"]["1"]
        assert d1["all_reduce_bytes"] == 0 and d1["all_gather"]["bf16_cache_bytes"] == 0
        for d in (2, 8):
            row = entry["by_world_size"][str(d)]
            assert row["all_reduce_bytes"] == round(61 * 2 * 2 * (d - 1) / d * entry["new_tokens"] * 7168 * 2)
            gather = row["all_gather"]
            assert gather["absorbed_tokens"] == 0 and gather["part_rows"] >= math.ceil(entry["context_tokens"] / d)
            assert gather["bf16_cache_bytes"] == (d - 1) * gather["part_rows"] * 576 * 2
            assert gather["bf16_cache_bytes"] == 2 * gather["fp8_cache_bytes"]  # fp8 rows travel as fp8
            assert gather["fp8_cache_bytes_per_step"] == 61 * gather["fp8_cache_bytes"]
            routed = row["routed"]  # the absorbed queries and partials do not shrink with an fp8 cache
            assert routed["bf16_cache_bytes"] - routed["fp8_cache_bytes"] == (d - 1) * routed["part_rows"] * 576
