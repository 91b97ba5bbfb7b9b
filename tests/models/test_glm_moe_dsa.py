"""GLM-5 (``glm_moe_dsa``) against transformers' GlmMoeDsaForCausalLM, on tiny checkpoints written here:
DeepSeek-V3.2's layers with GLM's dims (P = 24 < V = 32, as the release's 192 < 256), one gate group,
``rms_norm_eps`` 1e-5, an indexer whose RoPE interleaves pairs (its rows permuted to halves at load), and
``indexer_types`` full, shared, full: the shared layer has no indexer and no index cache, and attends the top-k
of the full layer before it, computed once per step (``mla_ops.index_topk`` runs twice per step, not three
times). ``index_topk`` 8: the prompts of 13 and 21 tokens take the sparse path, the one of 7 the dense one.
"""

import json
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mla_ops
from mla_ops.models.config import MLAConfig
from tests.support.dsa_families import check_selection, index_score_gap
from tests.support.families import check_cli, check_generation, check_logits, check_whole_model_compile, \
    prompts_of, spread_weights, step

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=24,
             qk_rope_head_dim=8, v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
             first_k_dense_replace=1, max_position_embeddings=128, index_topk=8, index_n_heads=16, index_head_dim=16,
             rope_parameters=dict(rope_type="default", rope_theta=50000.0))
TYPES = ["full", "shared", "full"]


def make_glm5(seed, **change):
    config = transformers.GlmMoeDsaConfig(**{**SHAPE, "indexer_types": TYPES, **change})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # its grouped_mm takes no float64
    torch.manual_seed(seed)
    return spread_weights(transformers.GlmMoeDsaForCausalLM(config), seed + 1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_glm5(seed=0)
    path = tmp_path_factory.mktemp("glm5")
    hf.save_pretrained(path)
    return str(path), hf


@pytest.fixture(scope="module")
def model64(checkpoint):
    return mla_ops.MLAForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float64)


def test_config_reads_the_shared_layers(checkpoint):
    config = MLAConfig.from_hf(checkpoint[0])
    assert config.layer_kinds.indexer_types == tuple(TYPES) and config.num_index_layers == 2
    assert (config.indexer.indexer_rope_interleave, config.n_group, config.rms_norm_eps) == (True, 1, 1e-5)
    assert (config.qk_nope_head_dim, config.v_head_dim, config.indexer.index_n_heads) == (24, 32, 16)
    model = mla_ops.MLAForCausalLM(config)
    assert [layer.self_attn.indexer is None for layer in model.model.layers] == [False, True, False]
    caches = model.allocate_kv_caches(5, 4)
    assert torch.stack(caches.latent).shape == (3, 5, 4, 40) and torch.stack(caches.index).shape == (2, 5, 4, 16)  # none for the shared layer


def test_the_test_data_has_no_near_ties(model64):
    prompts = prompts_of([13, 7, 21], 96, seed=1) + prompts_of([10, 9], 96, seed=2)
    assert index_score_gap(model64, prompts) > 1e-4


def test_the_indexer_selects_what_transformers_selects(checkpoint, model64):
    check_selection(model64, checkpoint[1].to(torch.float64), prompts_of([21], 96, seed=1)[0])


def test_logits_match_transformers_with_and_without_a_cached_prefix(checkpoint):
    path, hf = checkpoint
    print(f"glm_moe_dsa: largest logit difference {check_logits(path, hf):.2e} (relative, float64)")


def test_greedy_generation_matches_transformers_and_reuses_prefixes(checkpoint):
    check_generation(*checkpoint)


def test_cli_generates(checkpoint, capsys):
    check_cli(checkpoint[0], capsys)


class OpCounts(TorchDispatchMode):
    """How many times each mla_ops operator runs (by name) inside the mode."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("mla_ops::"):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_a_step_selects_once_per_full_layer(model64):
    prompt = prompts_of([13], 96, seed=1)[0]
    with torch.no_grad(), OpCounts() as ops:
        step(model64, model64.allocate_kv_caches(4, 4), [prompt], [0], index_topk=8)
    assert ops.counts["mla_ops::index_topk"] == 2  # the full layers; the shared layer reuses layer 0's
    assert ops.counts["mla_ops::write_latent_cache"] == 3 + 2  # 3 latent rows and 2 index keys per token


def test_index_topk_pattern_and_schedule_give_the_layer_types(checkpoint):
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if k != "indexer_types"}
    assert MLAConfig.from_hf(dict(config, index_topk_pattern="FSF")).layer_kinds.indexer_types == tuple(TYPES)
    schedule = MLAConfig.from_hf(dict(config, num_hidden_layers=3, index_topk_freq=2, index_skip_topk_offset=1))
    assert schedule.layer_kinds.indexer_types == tuple(transformers.GlmMoeDsaConfig(
        **SHAPE, index_topk_freq=2, index_skip_topk_offset=1).indexer_types)
    assert MLAConfig.from_hf(config).layer_kinds.indexer_types == ("full",) * 3  # transformers' default schedule


@pytest.mark.parametrize("change, error, match", [
    (dict(indexer_types=["shared", "full", "full"]), ValueError, r"indexer_types\[0\] must be 'full'"),
    (dict(indexer_types=["full", "sparse", "full"]), ValueError, r"indexer_types\[1\] must be one of"),
    (dict(indexer_types=["full", "full"]), ValueError, "indexer_types must have num_hidden_layers=3 entries"),
    (dict(indexer_types=None, index_topk_pattern="FXF"), ValueError, "index_topk_pattern must be a string of 'F'"),
])
def test_config_errors_name_the_key(checkpoint, change, error, match):
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        config = json.load(f)
    with pytest.raises(error, match=match):
        MLAConfig.from_hf(dict(config, **change))


def test_the_whole_model_compiles_with_a_region_per_layer_kind(model64):
    """torch.compile of the whole step: full and shared layers (which reuse the top-k handed in), dense and MoE."""
    check_whole_model_compile(model64, prompts_of([9, 14, 3], model64.config.vocab_size, seed=5), [4, 10, 0],
                              max_regions=6)
