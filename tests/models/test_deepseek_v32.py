"""DeepSeek-V3.2 (``deepseek_v32``) against transformers' DeepseekV32ForCausalLM, on tiny checkpoints written here:
DeepSeek-V3's MLA and gate plus, per layer, the lightning indexer (``self_attn.indexer.{wq_b, wk, k_norm,
weights_proj}``: wq_b reads the q-LoRA latent, k_norm a LayerNorm with bias, its RoPE over the first R dims
rotating halves where the main attention's rows are interleaved pairs). ``index_topk`` 8, so the prompts of
13 and 21 tokens take the sparse path (their later queries select 8 of their keys) and the one of 7 the
dense one; 16 indexer heads keep the scores clear of ties (a relu of every head's dot is rarely all zero),
which ``index_score_gap`` asserts. The release layout: float8 weights with block scales, the indexer's
``wq_b`` / ``wk`` among them, the released config.json form and an MTP layer.
"""

import json
import os

import pytest
import torch

import mla_ops
from mla_ops.models.config import MLAConfig
from tests.support.dsa_families import check_cache_bookkeeping, check_selection, index_score_gap
from tests.support.families import check_cli, check_generation, check_logits, check_whole_model_compile, \
    prompts_of, spread_weights

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
             n_group=2, topk_group=1, first_k_dense_replace=1, max_position_embeddings=128,
             index_topk=8, index_n_heads=16, index_head_dim=16)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=1.0)


def make_v32(seed, rope=None):
    config = transformers.DeepseekV32Config(
        **SHAPE, rope_parameters=rope or dict(rope_type="default", rope_theta=10000.0))
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # its grouped_mm takes no float64
    torch.manual_seed(seed)
    return spread_weights(transformers.DeepseekV32ForCausalLM(config), seed + 1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_v32(seed=0)
    path = tmp_path_factory.mktemp("v32")
    hf.save_pretrained(path)
    return str(path), hf


@pytest.fixture(scope="module")
def model64(checkpoint):
    return mla_ops.MLAForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float64)


def test_config_reads_the_indexer(checkpoint):
    config = MLAConfig.from_hf(checkpoint[0])
    assert (config.index_topk, config.indexer.index_n_heads, config.indexer.index_head_dim) == (8, 16, 16)
    assert config.is_sparse and config.num_index_layers == 2 and config.layer_kinds.indexer_types is None
    assert (config.rope_interleave, config.indexer.indexer_rope_interleave) == (True, False)
    assert (config.scoring_func, config.topk_method, config.n_group, config.layer_kinds.mlp_layer_types) == \
        ("sigmoid", "noaux_tc", 2, ("dense", "sparse"))
    model = mla_ops.MLAForCausalLM(config)
    caches = model.allocate_kv_caches(5, 4)
    assert isinstance(caches, mla_ops.KVCaches) and caches.index is not None
    assert torch.stack(caches.latent).shape == (2, 5, 4, 40) and torch.stack(caches.index).shape == (2, 5, 4, 16)


def test_the_test_data_has_no_near_ties(model64):
    prompts = prompts_of([13, 7, 21], 96, seed=1) + prompts_of([10, 9], 96, seed=2)
    assert index_score_gap(model64, prompts) > 1e-4


def test_the_indexer_selects_what_transformers_selects(checkpoint, model64):
    check_selection(model64, checkpoint[1].to(torch.float64), prompts_of([21], 96, seed=1)[0])


def test_logits_match_transformers_with_and_without_a_cached_prefix(checkpoint):
    path, hf = checkpoint
    print(f"deepseek_v32: largest logit difference {check_logits(path, hf):.2e} (relative, float64)")


def test_greedy_generation_matches_transformers_and_reuses_prefixes(checkpoint):
    check_generation(*checkpoint)


def test_eviction_frees_both_caches(checkpoint):
    path, hf = checkpoint
    hits = check_cache_bookkeeping(path, hf)
    # The first call's 8 full prompt blocks stay cached; the second's 9 blocks evict 2 of them (the oldest), so
    # the third reuses only part of its prefixes (and recomputes, rewriting both caches' rows, the rest).
    assert hits[1] == 0 and 0 < hits[2] < 32, hits


def test_cli_generates(checkpoint, capsys):
    check_cli(checkpoint[0], capsys)


def test_a_dense_plan_is_refused(model64):
    plan = mla_ops.plan_prefill(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                                torch.zeros(1, 1, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"plan was made with index_topk=None, but the model selects index_topk=8"):
        model64(torch.tensor([1, 2, 3]), torch.arange(3), model64.allocate_kv_caches(1, 4), torch.arange(3), plan)
    with pytest.raises(ValueError, match=r"kv_caches.index is None, but a sparse"):
        model64(torch.tensor([1, 2, 3]), torch.arange(3), model64.allocate_kv_caches(1, 4).latent, torch.arange(3),
                plan)


def test_context_parallel_is_refused_by_name(checkpoint):
    with pytest.raises(ValueError, match="context_parallel does not serve DeepSeek Sparse Attention"):
        mla_ops.MLAForCausalLM.from_pretrained(checkpoint[0], context_parallel=mla_ops.ContextParallel())


def test_fp8_release_layout_loads(tmp_path):
    from tests.support.hf_checkpoints import save_release_fp8

    hf = make_v32(seed=3, rope=YARN)
    save_release_fp8(hf, str(tmp_path), block=(16, 16), released_keys=dict(
        architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", index_topk=8, index_n_heads=16,
        index_head_dim=16))
    with open(tmp_path / "model.safetensors.index.json") as f:
        names = json.load(f)["weight_map"]
    assert "model.layers.1.self_attn.indexer.wq_b.weight_scale_inv" in names  # the indexer's fp8 weights
    assert "model.layers.1.self_attn.indexer.weights_proj.weight_scale_inv" not in names
    model = mla_ops.MLAForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert model.config.rope_scaling is not None and model.config.dtype == "bfloat16"
    prompt = prompts_of([13], 96, seed=4)[0]
    table = torch.arange(4, dtype=torch.int32)[None]
    plan = mla_ops.plan_prefill(torch.tensor([0, 13], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                                table, 4, index_topk=8)
    assert bool(plan.sparse[0])
    with torch.no_grad():
        got = model(torch.tensor(prompt), torch.arange(13), model.allocate_kv_caches(4, 4), torch.arange(13), plan)
        expect = hf.to(torch.float64)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-6 * float(expect.abs().max()))
    bf16 = mla_ops.MLAForCausalLM.from_pretrained(tmp_path)  # the release's dtype; weights_proj kept float32
    assert bf16.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    assert bf16.model.layers[0].self_attn.indexer.wq_b.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("change, error, match", [
    (dict(index_topk=None), ValueError, "index_topk=null"),
    (dict(index_topk=0), ValueError, "index_topk"),
    # past int32 it would wrap in the plan's comparisons: refused here, before any weight loads
    (dict(index_topk=2**31), ValueError, r"index_topk must be at most 2\*\*31 - 1 .*got 2147483648"),
    (dict(index_head_dim=4), ValueError, r"index_head_dim \(4\) must hold the qk_rope_head_dim"),
    (dict(q_lora_rank=None), ValueError, "q_lora_rank is None: the indexer's wq_b reads the q-LoRA latent"),
    (dict(layer_types=["full_attention", "indexed_attention"]), ValueError, "layer_types must list"),
    (dict(index_n_heads="4"), TypeError, "index_n_heads"),
])
def test_config_errors_name_the_key(checkpoint, change, error, match):
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        config = json.load(f)
    with pytest.raises(error, match=match):
        MLAConfig.from_hf(dict(config, **change))


def test_generator_options_take_the_models_index_topk(model64):
    assert mla_ops.Generator(model64).options.index_topk == 8
    with pytest.raises(ValueError, match=r"options.index_topk is 4, but the model selects index_topk=8"):
        mla_ops.Generator(model64, options=mla_ops.PlanOptions(index_topk=4))
    dense = mla_ops.MLAForCausalLM(MLAConfig.from_name("tiny"))
    with pytest.raises(ValueError, match=r"options.index_topk is 4, but the model has no indexer"):
        mla_ops.Generator(dense, options=mla_ops.PlanOptions(index_topk=4))


def test_the_whole_model_compiles_with_a_region_per_layer_kind(model64):
    """torch.compile of the whole step: the parts before and after each cache write, the second for dense and MoE layers."""
    check_whole_model_compile(model64, prompts_of([9, 14, 3], model64.config.vocab_size, seed=5), [4, 10, 0],
                              max_regions=3)
