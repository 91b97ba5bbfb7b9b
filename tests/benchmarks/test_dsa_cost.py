"""benchmarks/dsa_cost.py: the DSA-vs-dense cost model's numbers against hand-computed ones, and the
script end to end at a small size."""

import json

import pytest

from benchmarks import dsa_cost

pytestmark = pytest.mark.bench


def test_pair_counts_by_brute_force():
    for c in range(0, 10):
        for q in range(0, 7):
            assert dsa_cost.candidate_pairs(c, q) == sum(c + j + 1 for j in range(q))
            for k in range(1, 9):
                assert dsa_cost.selected_pairs(c, q, k) == sum(min(k, c + j + 1) for j in range(q))


def test_index_pieces_skip_queries_that_see_no_row():
    # c = 5, q = 6: 11 keys in row chunks of 4 -> [0, 4) seen by all 6 queries, [4, 8) by all
    # (query 0 sits at position 5), [8, 11) by queries 3.. (positions 8, 9, 10): 3; 2 tokens a piece.
    assert dsa_cost.index_pieces(5, 6, 4, 2) == [(4, 6, 3), (4, 6, 3), (3, 3, 2)]


def test_costs_at_deepseek_v32_dims_by_hand():
    c, q = 8192, 1024
    row = dsa_cost.request_cost(c, q, dsa_cost.V3, dsa_cost.V32_INDEXER, 65536, 1024, 1)
    pairs = q * c + q * (q + 1) // 2
    assert row["indexer"]["flops"] == pairs * (2 * 64 * 128 + 2 * 64)
    # One row chunk of 9,216 keys, one piece of 1,024 queries: keys read once (fp8, 128 B a row).
    assert row["indexer"]["key_bytes"] == (c + q) * 128 and row["indexer"]["index_chunks"] == 1
    assert row["indexer"]["logits_bytes"] == 2 * 4 * q * (c + q)
    fold = q * 128 * 2 * 512 * (128 + 128)
    assert row["sparse_attention"]["pairs"] == q * 2048  # every query has more than K_I candidates
    assert row["sparse_attention"]["flops"] == q * 2048 * 128 * 2 * (2 * 512 + 64) + fold
    assert row["sparse_attention"]["bytes"] == (q * 2048 * 576 + q * 128 * (576 + 512) * 2 + q * 2048 * 4)
    assert row["dense_mha"]["flops"] == (c + q) * 128 * 2 * 512 * 256 + pairs * 128 * 2 * 320
    assert row["dense_absorbed"]["flops"] == pairs * 128 * 2 * (2 * 512 + 64) + fold
    assert row["dense_routed"] == "mha"
    assert row["dsa"]["flops"] == row["indexer"]["flops"] + row["sparse_attention"]["flops"]
    assert row["dsa_over_dense_flops"] == round(row["dsa"]["flops"] / row["dense_mha"]["flops"], 4)


def test_short_requests_save_the_indexer_at_least():
    for c, q in dsa_cost.SHORT:
        s = dsa_cost.short_request_saving(c, q, dsa_cost.V3, dsa_cost.V32_INDEXER, 65536, 1024, 1)
        assert s["dsa_flops"] - s["dense_flops"] >= s["indexer_flops"] * (1 - 1e-12)
        assert 0 < s["flops_saved_by_skipping_the_indexer"] <= s["flops_saved"]
    with pytest.raises(ValueError, match="c \\+ q <= K_I"):
        dsa_cost.short_request_saving(2000, 100, dsa_cost.V3, dsa_cost.V32_INDEXER, 65536, 1024, 1)


def test_dsa_cost_cli(tmp_path):
    out, png = tmp_path / "dsa.json", tmp_path / "dsa.png"
    result = dsa_cost.main(["--json", str(out), "--plot", str(png), "--contexts", "8192,65536",
                            "--queries", "1024", "--short", "0:2048,1920:128"])
    assert json.loads(out.read_text()) == result
    assert [(r["context"], r["query"]) for r in result["rows"]] == [(8192, 1024), (65536, 1024)]
    assert result["dims"] == dict(N=128, L=512, P=128, R=64, V=128, H_I=64, D_I=128, K_I=2048)
    assert "nothing measured" in result["kind"]
    small, large = result["rows"]
    assert large["dsa_over_dense_flops"] < small["dsa_over_dense_flops"] < 1  # sparse pays off with context
    assert large["sparse_attention"]["flops"] == small["sparse_attention"]["flops"]  # K_I keys a query either way
    assert [s["dense_routed"] for s in result["short_requests"]] == ["mha", "absorbed"]
    assert png.stat().st_size > 10_000


def test_vllms_packed_formats_bytes():
    """fp8_ds_mla: 512 fp8 + 4 float32 scales + 64 bf16 = 656 B a latent row; fp8_per_token: 128 + 4 = 132 B."""
    assert dsa_cost.latent_row_bytes(dsa_cost.V3, "vllm") == 656
    assert dsa_cost.index_row_bytes(dsa_cost.V32_INDEXER, "vllm") == 132
    formats = dsa_cost.cache_formats(dsa_cost.V3, dsa_cost.V32_INDEXER)
    assert formats["fp8 (per-tensor k_scale)"] == dict(latent=576, index=128)
    assert formats["bf16"] == dict(latent=1152, index=256)
    assert formats["vllm_over_per_tensor_fp8"] == dict(latent=round(656 / 576, 4), index=round(132 / 128, 4))
    c, q = 8192, 1024
    fp8 = dsa_cost.request_cost(c, q, dsa_cost.V3, dsa_cost.V32_INDEXER, 65536, 1024, 1)
    vllm = dsa_cost.request_cost(c, q, dsa_cost.V3, dsa_cost.V32_INDEXER, 65536, 1024, "vllm")
    assert vllm["indexer"]["key_bytes"] == (c + q) * 132
    assert vllm["sparse_attention"]["bytes"] - fp8["sparse_attention"]["bytes"] == q * 2048 * (656 - 576)
    assert vllm["dense_mha"]["bytes"] - fp8["dense_mha"]["bytes"] == c * (656 - 576)
    assert vllm["dense_mha"]["flops"] == fp8["dense_mha"]["flops"]


def test_dsa_cost_cli_with_vllms_formats(tmp_path):
    out = tmp_path / "dsa.json"
    result = dsa_cost.main(["--json", str(out), "--contexts", "8192", "--queries", "1024", "--short", "0:2048",
                            "--cache-bytes", "vllm"])
    assert result["cache_row_bytes"] == dict(latent=656, index=132)
    assert json.loads(out.read_text()) == result
