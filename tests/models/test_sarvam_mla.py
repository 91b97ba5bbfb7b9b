"""Sarvam (``sarvam_mla``) against transformers, whose model for it is DeepseekV3ForCausalLM: a DeepSeek-V3
checkpoint (no q LoRA here, sigmoid gate over one group, YaRN) under its own model type, whose config
defaults differ (first_k_dense_replace 1, n_shared_experts 1). The release's config.json form, written for
its remote code (``num_experts``, ``num_shared_experts``, ``head_dim``, ``q_head_dim``, YaRN named
"deepseek_yarn"), reads as transformers' SarvamMLAConfig reads it.
"""

import json
import os

import pytest
import torch

from mla_ops.models.config import MLAConfig
from tests.support.families import check_cli, check_generation, check_logits, spread_weights

transformers = pytest.importorskip("transformers")

YARN = dict(factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
             rope_parameters=dict(YARN, rope_type="yarn", rope_theta=10000.0))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.SarvamMLAConfig(**SHAPE)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # its grouped_mm takes no float64
    torch.manual_seed(0)
    hf = spread_weights(transformers.DeepseekV3ForCausalLM(config), 1)
    path = tmp_path_factory.mktemp("sarvam")
    hf.save_pretrained(path)
    return str(path), hf


def test_release_config_form_reads_as_transformers_reads_it(checkpoint):
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        written = json.load(f)
    config = MLAConfig.from_hf(written)
    assert (config.scoring_func, config.topk_method, config.first_k_dense_replace) == ("sigmoid", "noaux_tc", 1)
    legacy = {k: v for k, v in written.items()
              if k not in ("n_routed_experts", "n_shared_experts", "first_k_dense_replace", "rope_parameters")}
    legacy.update(num_experts=8, num_shared_experts=1, head_dim=40, q_head_dim=24, rope_theta=10000.0,
                  rope_scaling=dict(YARN, type="deepseek_yarn"))
    theirs = transformers.SarvamMLAConfig(**legacy)
    assert (theirs.n_routed_experts, theirs.first_k_dense_replace, theirs.rope_parameters["rope_type"]) == (8, 1, "yarn")
    assert MLAConfig.from_hf(legacy) == config
    with pytest.raises(ValueError, match="num_experts=8 and n_routed_experts=4"):
        MLAConfig.from_hf(dict(legacy, n_routed_experts=4))


def test_logits_match_transformers_with_and_without_a_cached_prefix(checkpoint):
    print(f"sarvam_mla: largest logit difference {check_logits(*checkpoint):.2e} (relative, float64)")


def test_greedy_generation_matches_transformers_and_reuses_prefixes(checkpoint):
    check_generation(*checkpoint)


def test_cli_generates(checkpoint, capsys):
    check_cli(checkpoint[0], capsys)
