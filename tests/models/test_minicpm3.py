"""MiniCPM3 (``minicpm3``) against transformers' MiniCPM3ForCausalLM, on tiny checkpoints written here: a dense
MLA model with DeepSeek-V2's attention but half-split RoPE (never interleaved), LongRoPE frequencies (short
factors far from 1), tied embeddings and its three scalings: embeddings times ``scale_emb``, each residual
branch times ``scale_depth / sqrt(num_hidden_layers)``, the final hidden states divided by
``hidden_size / dim_model_base`` (4 here) before the tied ``lm_head``. The release's config.json form
(``rope_scaling`` of type "longrope", no ``v_head_dim`` and no ``tie_word_embeddings``) reads the same.
"""

import json
import os

import pytest
import torch

import mla_ops
from mla_ops.models.config import MLAConfig
from mla_ops.models.scalings import LongRopeScaling
from mla_ops.models.rope import inverse_frequencies
from tests.support.families import check_cli, check_generation, check_logits, spread_weights

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

SHORT = [1.0, 1.7, 3.1, 6.4]  # R/2 = 4 frequency divisors
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=SHORT, long_factor=[2.0] * 4,
                original_max_position_embeddings=128)
SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             max_position_embeddings=128, scale_emb=2, scale_depth=3.0, dim_model_base=16, rope_parameters=LONGROPE)
# scale_emb 2 and scale_depth 3 (the release's 12 and 1.4 drown 2 tiny layers: one token repeats)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.MiniCPM3Config(**SHAPE)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = spread_weights(transformers.MiniCPM3ForCausalLM(config), 1)
    path = tmp_path_factory.mktemp("minicpm3")
    hf.save_pretrained(path)
    return str(path), hf


def test_config_reads_the_scalings_and_rope(checkpoint):
    path, hf = checkpoint
    config = MLAConfig.from_hf(path)
    scalings = config.scalings
    assert (scalings.embedding_scale, scalings.logits_scaling) == (2.0, 4.0) == (2.0, hf.config.logits_scaling)
    assert config.scalings.residual_scale == pytest.approx(3.0 / 2 ** 0.5) == hf.model.layers[0].residual_scale
    assert not config.rope_interleave and config.tie_word_embeddings and config.v_head_dim == 16
    assert config.rope_scaling == LongRopeScaling(tuple(SHORT), 128, 1.0)
    ours = inverse_frequencies(8, config.rope_theta, config.rope_scaling, "cpu", torch.float32)
    torch.testing.assert_close(ours, hf.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: the loader fills lm_head from the embeddings


def test_logits_match_transformers_with_and_without_a_cached_prefix(checkpoint):
    path, hf = checkpoint
    print(f"minicpm3: largest logit difference {check_logits(path, hf):.2e} (relative, float64)")


def test_greedy_generation_matches_transformers_and_reuses_prefixes(checkpoint):
    check_generation(*checkpoint)


def test_cli_generates(checkpoint, capsys):
    check_cli(checkpoint[0], capsys)


def released_form(written: dict) -> dict:
    """openbmb/MiniCPM3-4B's config.json form: rope_scaling {"type": "longrope", ...} without rope_theta,
    torch_dtype, and no v_head_dim / tie_word_embeddings (the remote code derives and fixes them)."""
    released = {k: v for k, v in written.items()
                if k not in ("rope_parameters", "dtype", "v_head_dim", "tie_word_embeddings", "head_dim", "qk_head_dim")}
    rope = {k: v for k, v in written["rope_parameters"].items() if k not in ("rope_type", "rope_theta")}
    return dict(released, rope_scaling=dict(rope, type="longrope"), torch_dtype="bfloat16",
                architectures=["MiniCPM3ForCausalLM"])


def test_released_config_form_reads_the_same(checkpoint):
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        written = json.load(f)
    config = MLAConfig.from_hf(released_form(written))
    assert config == MLAConfig.from_hf(dict(written, dtype="bfloat16"))
    assert MLAConfig.from_hf(dict(written, rope_interleave=True)).rope_interleave is False  # as transformers
    nulls = MLAConfig.from_hf(dict(written, scale_depth=None, dim_model_base=None))  # transformers: no scaling
    assert (nulls.scalings.residual_scale, nulls.scalings.logits_scaling) == (1.0, 1.0)


@pytest.mark.parametrize("change, error, match", [
    (dict(rope_parameters=dict(LONGROPE, short_factor=[1.0] * 3)), ValueError,
     r"rope_scaling\.short_factor must have qk_rope_head_dim / 2 = 4 entries, got 3"),
    (dict(rope_parameters=dict(LONGROPE, short_factor=[1.0, "2", 1.0, 1.0])), TypeError,
     r"rope_parameters\.short_factor\[1\]"),
    (dict(max_position_embeddings=256), ValueError,
     r"max_position_embeddings=256 > original_max_position_embeddings=128 is not supported"),
    (dict(scale_emb="12"), TypeError, "scale_emb"),
    (dict(dim_model_base=0), ValueError, "dim_model_base"),
])
def test_config_errors_name_the_key(checkpoint, change, error, match):
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        config = json.load(f)
    with pytest.raises(error, match=match):
        MLAConfig.from_hf(dict(config, **change))


@torch.no_grad()
def test_tied_lm_head_after_scaling_reads_the_embeddings(checkpoint):
    model = mla_ops.MLAForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float64)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hidden = torch.randn(3, 64, dtype=torch.float64)
    torch.testing.assert_close(model.logits(hidden), hidden @ model.model.embed_tokens.weight.T / 4)
