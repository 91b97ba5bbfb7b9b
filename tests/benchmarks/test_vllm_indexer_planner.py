"""benchmarks/vllm_indexer_planner.py: vLLM's indexer chunking re-expressed (on the cases its own tests
pin), the library's side read from the plan, and the script end to end on the trace's first requests."""

import json

import pytest

from benchmarks import vllm_indexer_planner as vip

pytestmark = pytest.mark.bench


@pytest.mark.parametrize("seq_lens, query_lens, workspace, logits_bytes, expected", [
    # The logits budget (1,250 float32) holds one request's 10 x 100 scores, not two requests'.
    ([100, 100, 100], [10, 10, 10], 1000, 5000, [(slice(0, 1), slice(0, 10)), (slice(1, 2), slice(0, 10)),
                                                 (slice(2, 3), slice(0, 10))]),
    # Both budgets hold all three: one chunk of 15 queries.
    ([10, 10, 10], [5, 5, 5], 100, 10000, [(slice(0, 3), slice(0, 15))]),
    # The workspace holds one request's 50 rows at a time.
    ([50, 50, 50], [1, 1, 1], 50, 10**6, [(slice(0, 1), slice(0, 1)), (slice(1, 2), slice(0, 1)),
                                         (slice(2, 3), slice(0, 1))]),
    # Greedy: 10 x 20 = 200 <= 250 scores for the first two, 15 x 30 = 450 > 250 with the third.
    ([10, 10, 10], [5, 5, 5], 100, 1000, [(slice(0, 2), slice(0, 10)), (slice(2, 3), slice(0, 5))]),
    # A lone request past the logits budget: 250 // 1000 -> pieces of one query; the next fits whole.
    ([1000, 50], [100, 5], 2000, 1000, [(slice(0, 1), slice(i, i + 1)) for i in range(100)]
     + [(slice(1, 2), slice(0, 5))]),
])
def test_split_indexer_prefill_chunks_as_vllm_tests_pin_it(seq_lens, query_lens, workspace, logits_bytes, expected):
    assert vip.split_indexer_prefill_chunks(seq_lens, query_lens, workspace, logits_bytes) == expected


def test_vllm_chunks_score_every_prefill_over_its_whole_sequence():
    # The 1-token request is a vLLM decode; the short one (c + q = 110 <= 2048) is scored all the same.
    chunks = vip.vllm_chunks([3000, 7, 100], [500, 1, 10], vip.VLLM_WORKSPACE, 512 * vip.MIB)
    assert chunks == [(3500 + 110, 510)]


def test_our_chunks_score_only_sparse_requests_within_both_budgets():
    w, budget = 1024, 1024 * 256
    chunks = vip.our_chunks([3000, 100], [500, 10], w, budget, block_size=16)
    assert len(chunks) >= -(-3500 // w)  # the dense request's 110 keys are not scored: 4 row chunks
    assert all(0 < rows <= w and 0 < tokens and rows * tokens <= budget for rows, tokens in chunks)
    assert sum(rows for rows, tokens in chunks if tokens) >= 3500
    assert vip.our_chunks([100], [10], w, budget, block_size=16) == []  # dense-routed: no index chunk


def test_vllm_indexer_planner_cli_on_the_trace_prefix(tmp_path):
    out, png = tmp_path / "vip.json", tmp_path / "vip.png"
    result = vip.main(["--json", str(out), "--plot", str(png), "--limit", "40", "--logits-mib", "512,16",
                       "--workspace-sizes", "65536,16384"])
    assert json.loads(out.read_text()) == result
    assert "MatthewBonanni/vllm@e32eae27" in result["vllm_source"] and result["index_topk"] == 2048
    configs = {(c["planner"], c["workspace_size"], c["logits_mib"]): c for c in result["configs"]}
    # 16 MiB holds 4,194,304 scores: 64 tokens over W = 65,536 rows, 256 over 16,384.
    assert set(configs) == {("vllm", vip.VLLM_WORKSPACE, 512), ("mla_ops", 65536, 512), ("mla_ops", 16384, 512),
                            ("vllm", vip.VLLM_WORKSPACE, 16), ("mla_ops", 65536, 16), ("mla_ops", 16384, 16)}
    for (planner, w, mib), c in configs.items():
        assert c["peak_logits_mib"] <= mib
        assert sum(c["chunks_per_step_histogram"]) == result["num_prefill_steps"]
        if planner == "mla_ops":
            assert c["peak_key_rows"] <= w and c["tokens_per_chunk"] == mib * vip.MIB // 4 // w
        else:
            assert c["peak_key_rows"] <= result["requests"]["max_sequence"]
    # A smaller budget never needs fewer chunks.
    assert configs[("vllm", vip.VLLM_WORKSPACE, 16)]["total_chunks"] >= configs[("vllm", vip.VLLM_WORKSPACE, 512)][
        "total_chunks"]
    assert configs[("mla_ops", 65536, 16)]["total_chunks"] >= configs[("mla_ops", 65536, 512)]["total_chunks"]
    assert 0 < result["requests"]["dense_routed"] < result["num_prefill_requests"]
    assert png.stat().st_size > 10_000


def test_our_indexer_needs_at_most_vllms_chunks_on_the_trace_prefix():
    """Issue 39: pieces sized per request, dense requests never scored: at W = 65,536 (a key buffer bounded by
    W) no more chunks than vLLM's at each of its three logits budgets."""
    steps = list(vip.simulate(vip.load_trace(vip.DEFAULT_TRACE, 400), token_budget=8192))
    result = vip.compare(steps, vip.VLLM_LOGITS_MIB, [65536])
    for mib in vip.VLLM_LOGITS_MIB:
        vllm, ours = (next(c for c in result["configs"] if c["planner"] == p and c["logits_mib"] == mib)
                      for p in ("vllm", "mla_ops"))
        assert ours["total_chunks"] <= vllm["total_chunks"], mib
        assert ours["peak_key_rows"] <= 65536 and ours["peak_logits_mib"] <= mib
