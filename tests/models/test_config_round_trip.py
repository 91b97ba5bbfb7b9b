"""An ``MLAConfig`` survives its own dict form: ``MLAConfig(**dataclasses.asdict(config))``, directly and through
JSON, is the same config, with the same softmax scale and rotary tables. (A rope record's dict once lacked its
type and read back as plain RoPE: DeepSeek-V3's softmax scale went from 0.135 to 0.072.) Every preset, and every
family's config.json with no scaling, YaRN and LongRoPE."""

import dataclasses
import json

import pytest
import torch
import transformers

from mla_ops.models.config import MLAConfig, mla_configs
from mla_ops.models.families import FAMILIES
from mla_ops.models.rope import RotaryEmbedding
from mla_ops.models.scalings import LongRopeScaling, YarnScaling

YARN = dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=1.0)
PLAIN_ROPE_ONLY = ("dots3_note", "dots3_note_text")  # refused by name: their reader takes plain RoPE only


def family_config(model_type: str) -> dict:
    """A config.json of ``model_type``: its transformers config's defaults (full size: only read, never built)."""
    if model_type == "kimi_k2":  # remote code only: DeepSeek-V3's keys
        return dict(transformers.DeepseekV3Config().to_dict(), model_type="kimi_k2")
    if model_type == "mistral3":  # Mistral3Config's default text model is a plain Mistral
        return transformers.Mistral3Config(text_config=transformers.Mistral4Config().to_dict()).to_dict()
    config = transformers.AutoConfig.for_model(model_type).to_dict()
    if model_type == "deepseek_v2":  # DeepseekV2Config leaves it null
        config["num_experts_per_tok"] = 6
    return config


def with_rope(config: dict, rope: str) -> dict:
    """``config`` (a wrapper's text model) with ``rope_parameters`` of this kind."""
    text = config["text_config"] if FAMILIES[config["model_type"]].wrapper is not None else config
    half = text["qk_rope_head_dim"] // 2
    scaling = {"plain": dict(rope_type="default"), "yarn": YARN,
               "longrope": dict(rope_type="longrope", short_factor=[1.0 + i / 8 for i in range(half)],
                                long_factor=[4.0] * half,
                                original_max_position_embeddings=text["max_position_embeddings"])}[rope]
    text.pop("rope_scaling", None)
    text["rope_parameters"] = {**(text.get("rope_parameters") or {}), **scaling}
    return config


def assert_round_trips(config: MLAConfig) -> None:
    """Both dict forms give back ``config``: equal records, softmax scale and cos / sin tables."""
    plain = dataclasses.asdict(config)
    positions = torch.tensor([0, 1, 7, 4095, 4096, 100_000])
    expect_tables = RotaryEmbedding(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling)(
        positions, torch.float64)
    for form in (plain, json.loads(json.dumps(plain))):
        again = MLAConfig(**form)
        assert again == config
        assert again.softmax_scale == config.softmax_scale
        tables = RotaryEmbedding(again.qk_rope_head_dim, again.rope_theta, again.rope_scaling)(positions, torch.float64)
        for got, expect in zip(tables, expect_tables):
            assert torch.equal(got, expect)


@pytest.mark.parametrize("name", sorted(mla_configs))
def test_every_preset_round_trips(name):
    config = MLAConfig.from_name(name)
    assert_round_trips(config)
    if name == "deepseek-v3":  # the case that went wrong: YaRN's mscale correction of the softmax scale
        assert isinstance(config.rope_scaling, YarnScaling) and round(config.softmax_scale, 3) == 0.135


@pytest.mark.parametrize("rope", ["plain", "yarn", "longrope"])
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_config_round_trips(model_type, rope):
    if rope != "plain" and model_type in PLAIN_ROPE_ONLY:
        with pytest.raises(ValueError, match="rope_type must be 'default'"):
            MLAConfig.from_hf(with_rope(family_config(model_type), rope))
        return
    config = MLAConfig.from_hf(with_rope(family_config(model_type), rope))
    kind = {"plain": type(None), "yarn": YarnScaling, "longrope": LongRopeScaling}[rope]
    assert isinstance(config.rope_scaling, kind)
    assert_round_trips(config)
