"""Youtu-LLM (``youtu``) against transformers' YoutuForCausalLM, on a tiny checkpoint written here: DeepSeek-V3's
attention (q LoRA, interleaved RoPE rows) in a dense Llama-style decoder, tied embeddings (its config's
default, so the checkpoint has no lm_head.weight).
"""

import json
import os

import pytest
import torch

from mla_ops.models.config import MLAConfig
from tests.support.families import check_cli, check_generation, check_logits, spread_weights

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=24, max_position_embeddings=128, bos_token_id=0, eos_token_id=1,
             rope_parameters=dict(rope_type="default", rope_theta=20000.0))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.YoutuConfig(**SHAPE)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = spread_weights(transformers.YoutuForCausalLM(config), 1)
    path = tmp_path_factory.mktemp("youtu")
    hf.save_pretrained(path)
    return str(path), hf


def test_config_is_dense_tied_and_interleaved(checkpoint):
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        written = json.load(f)
    config = MLAConfig.from_hf(written)
    assert config.n_routed_experts is None and config.rope_interleave and config.tie_word_embeddings
    with safe_open(os.path.join(checkpoint[0], "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    del written["tie_word_embeddings"]  # absent: YoutuConfig's default, tied
    assert MLAConfig.from_hf(written).tie_word_embeddings


def test_logits_match_transformers_with_and_without_a_cached_prefix(checkpoint):
    print(f"youtu: largest logit difference {check_logits(*checkpoint):.2e} (relative, float64)")


def test_greedy_generation_matches_transformers_and_reuses_prefixes(checkpoint):
    check_generation(*checkpoint)


def test_cli_generates(checkpoint, capsys):
    check_cli(checkpoint[0], capsys)
