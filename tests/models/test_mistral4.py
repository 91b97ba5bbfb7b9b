"""Mistral 4 (model type ``mistral4``, Mistral Small 4) end to end, against transformers' Mistral4ForCausalLM.

A tiny random model written here by transformers' own save_pretrained (stacked experts, rope_parameters with
``llama_4_scaling_beta`` and ``partial_rotary_factor``), loaded by ``MLAForCausalLM.from_pretrained``:

* float64 logits [T, vocab] vs transformers' forward on each whole sequence, with no cache and with a cached
  context (absorbed path, and the chunk loop with ``absorb_max_query_len=0``), at positions up to 3x YaRN's
  ``original_max_position_embeddings`` so the query scale 1 + beta * log(1 + floor(pos / original)) is not 1;
* the gate (softmax, groups ranked by their top-2 sum, no bias) and the query scale alone;
* greedy ``mla_ops.generate`` / ``Generator`` (prefix caching) and ``python -m mla_ops generate`` vs
  transformers' ``generate(do_sample=False)``;
* the release's multimodal wrapper (``mistral3``: Mistral3ForConditionalGeneration, a Pixtral tower skipped).
"""

import copy
import dataclasses
import json
import os

import pytest
import torch

import mla_ops
from mla_ops.models.config import MLAConfig
from mla_ops.models.moe import MoEGate
from mla_ops.models.query_scale import PositionScale
from mla_ops.models.scalings import QueryScale

transformers = pytest.importorskip("transformers")
from transformers.models.mistral4 import modeling_mistral4  # noqa: E402

from tests.support.families import prompts_of, step, transformers_greedy  # noqa: E402

ORIGINAL = 16  # YaRN's original_max_position_embeddings: the query scale steps every 16 positions
ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=ORIGINAL,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.3)
# Layer 0 dense, layer 1 MoE: 8 experts in 2 groups of 4 (one kept), so ranking groups by their top-2 sum
# differs from ranking them by their best expert.
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5,
            max_position_embeddings=4 * ORIGINAL, rms_norm_eps=1e-6, tie_word_embeddings=False)


def hf_config(**changes):
    config = transformers.Mistral4Config(**dict(TINY, rope_parameters=dict(ROPE), **changes))
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the reference's expert loop: grouped_mm has no float64
    return config


@torch.no_grad()
def spread(module, seed):
    """Weights at ~1/sqrt(fan_in), norms near 1: attention and routing far from uniform (std 0.02 makes
    every softmax nearly flat), so greedy tokens are far from ties."""
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5 * 1.5)
        else:
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return module


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, the transformers model it holds): what save_pretrained writes, float32."""
    torch.manual_seed(0)
    hf = spread(transformers.Mistral4ForCausalLM(hf_config()).eval(), seed=1)
    path = tmp_path_factory.mktemp("mistral4")
    hf.save_pretrained(path)
    return str(path), hf




# transformers' Mistral 4 keeps its RMSNorm, rotary tables and attention softmax in float32 even as a float64
# model: measured 6e-7 .. 1.6e-6 here (4e-15 with those three in float64 too). A wrong query scale is 0.7.
TOLERANCE = 5e-6


def relative_error(got, ref):
    """The largest difference over the largest logit."""
    return float((got - ref).abs().max() / ref.abs().max())


def test_config_json_reads_into_mla_config(checkpoint):
    path, _ = checkpoint
    with open(os.path.join(path, "config.json")) as f:
        written = json.load(f)
    assert written["model_type"] == "mistral4" and "partial_rotary_factor" in written["rope_parameters"]
    c = MLAConfig.from_hf(path)
    assert (c.scoring_func, c.topk_method, c.n_group, c.topk_group) == ("softmax", "group_top2", 2, 1)
    assert (c.norm_topk_prob, c.routed_scaling_factor, c.n_shared_experts, c.rope_interleave) == (True, 1.5, 1, True)
    assert c.scalings.query_scale == QueryScale(beta=0.3, original_max_position_embeddings=ORIGINAL)
    assert (c.rope_scaling.factor, c.rope_scaling.original_max_position_embeddings) == (4.0, ORIGINAL)
    assert c.softmax_scale == pytest.approx(modeling_mistral4.Mistral4Attention(hf_config(), 0).scaling)
    with pytest.raises(ValueError, match="model_type 'mistral5'"):  # a model type of unknown gate: named
        MLAConfig.from_hf(dict(written, model_type="mistral5"))

    # transformers' defaults are Mistral Small 4's dims (its docstring names mistralai/Mistral-Small-4-119B-2603).
    released = MLAConfig.from_hf(transformers.Mistral4Config().to_dict())
    assert dataclasses.replace(released, dtype="bfloat16") == MLAConfig.from_name("mistral-small-4")
    assert (released.kv_lora_rank, released.qk_nope_head_dim, released.qk_rope_head_dim) == (256, 64, 64)


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("llama_4_scaling_beta"), r"lacks rope_parameters\.llama_4_scaling_beta"),
    (lambda r: r.update(llama_4_scaling_beta="0.1"), r"rope_parameters\.llama_4_scaling_beta must be a number"),
    (lambda r: r.update(partial_rotary_factor=0.5), r"rope_parameters\.partial_rotary_factor=0\.5 rotates int"),
])
def test_config_errors_name_the_key(checkpoint, change, message):
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        written = json.load(f)
    change(written["rope_parameters"])
    with pytest.raises((TypeError, ValueError), match=message):
        MLAConfig.from_hf(written)


def test_query_scale_matches_transformers():
    positions = torch.arange(0, 200)
    ours = PositionScale(QueryScale(0.1, 16))(positions, torch.float64)
    theirs = modeling_mistral4.get_llama_4_attn_scale(positions[None], 0.1, 16)[0, 0, :, 0]
    torch.testing.assert_close(ours, theirs.double(), rtol=1e-7, atol=0)
    assert ours[15] == 1 and ours[16] > 1 and ours.dtype == torch.float64


@torch.no_grad()
def test_gate_picks_transformers_experts_and_weights():
    config = hf_config()
    router = spread(modeling_mistral4.Mistral4TopkRouter(config), seed=3)
    gate = MoEGate(MLAConfig.from_hf(config.to_dict()))
    gate.load_state_dict(router.state_dict())
    x = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(4))
    _, hf_weights, hf_indices = router(x)
    weights, indices = gate(x)
    order, hf_order = indices.argsort(-1), hf_indices.argsort(-1)
    assert torch.equal(indices.gather(1, order), hf_indices.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=1e-6, atol=1e-7)
    gate.topk_method = "group_limited_greedy"  # groups ranked by their best expert: other experts for some tokens
    assert not torch.equal(gate(x)[1].sort(-1).values, indices.sort(-1).values)


@torch.no_grad()
def test_float64_logits_match_transformers_with_and_without_a_cached_context(checkpoint):
    path, hf = checkpoint
    hf = copy.deepcopy(hf).double()  # (its RMSNorm, rotary tables and attention softmax stay float32)
    model = mla_ops.MLAForCausalLM.from_pretrained(path, dtype=torch.float64)
    prompts = prompts_of([50, 9, 37], model.config.vocab_size, seed=1)  # positions up to 49: scales 1 .. 1.42
    expect = [hf(torch.tensor([p])).logits[0] for p in prompts]  # each whole sequence, no cache
    caches = model.allocate_kv_caches(3 * 16, 4)

    errors = []
    for got, ref in zip(step(model, caches, prompts, [0, 0, 0], max_blocks=16), expect):  # batched, nothing cached
        errors.append(relative_error(got, ref))
    cached = [35, 0, 20]  # request 1 has no context; the others' new tokens sit past 2 * ORIGINAL / ORIGINAL
    step(model, caches, [p[:c] for p, c in zip(prompts, cached)], [0, 0, 0], max_blocks=16)
    for options in ({}, {"absorb_max_query_len": 0, "workspace_size": 8}):  # absorbed; chunk loop, 2+ chunks
        for got, ref, c in zip(step(model, caches, prompts, cached, max_blocks=16, **options), expect, cached):
            errors.append(relative_error(got, ref[c:]))
    assert max(errors) < TOLERANCE, errors

    # The query scale matters here: without it the logits past position 16 are far off.
    model.model.position_scale = None
    unscaled = step(model, model.allocate_kv_caches(3 * 16, 4), prompts, [0, 0, 0], max_blocks=16)[0]
    assert relative_error(unscaled[:ORIGINAL], expect[0][:ORIGINAL]) < TOLERANCE
    assert relative_error(unscaled[ORIGINAL:], expect[0][ORIGINAL:]) > 1e-3


def test_greedy_generation_matches_transformers_and_reuses_prefixes(checkpoint):
    path, hf = checkpoint
    model = mla_ops.MLAForCausalLM.from_pretrained(path)  # config.json's dtype: float32
    shared, other = prompts_of([18, 9], model.config.vocab_size, seed=2)
    prompts = [shared + [3, 4, 5], shared + [6], other, shared + [3, 4, 5]]  # generation runs past position 16
    expect = transformers_greedy(hf, prompts, 6)

    generator = mla_ops.Generator(model, block_size=4)
    assert generator.generate(prompts, 6) == expect
    # Blocks of 4: prompt 1 reuses prompt 0's 4 shared blocks, prompt 3 (= prompt 0) 5 of them.
    assert (generator.stats.cached_tokens, generator.stats.prompt_tokens) == (16 + 20, 21 + 19 + 9 + 21)
    assert generator.generate(prompts, 6) == expect  # again: every full prompt block is cached now
    assert mla_ops.generate(model, prompts[:2], 6, block_size=16) == expect[:2]


def test_cli_generates(checkpoint, capsys):
    from mla_ops.__main__ import main

    path, _ = checkpoint
    prompt = prompts_of([20], 96, seed=5)[0]
    expect = mla_ops.generate(mla_ops.MLAForCausalLM.from_pretrained(path), [prompt], 4)[0]
    main(["generate", "--model", path, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "4",
          "--ignore-eos"])
    assert capsys.readouterr().out.strip() == ",".join(map(str, expect))


@torch.no_grad()
def test_multimodal_wrapper_loads_its_text_model(tmp_path):
    """Mistral Small 4 as released: Mistral3ForConditionalGeneration (a Pixtral vision tower and a projector,
    skipped) around the mistral4 text model, written by save_pretrained (``language_model.model.*``,
    ``language_model.lm_head.weight``); float64 logits of a text prompt equal the wrapper's."""
    vision = transformers.PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, head_dim=8, image_size=28, patch_size=14)
    config = transformers.Mistral3Config(text_config=hf_config().to_dict(), vision_config=vision,
                                         tie_word_embeddings=False)
    config._attn_implementation = config.text_config._attn_implementation = "eager"
    config._experts_implementation = config.text_config._experts_implementation = "eager"
    torch.manual_seed(0)
    hf = spread(transformers.Mistral3ForConditionalGeneration(config).eval(), seed=6)
    hf.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["text_config"]["model_type"] == "mistral4"

    model = mla_ops.MLAForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert model.config.wrapper == "mistral3" and model.config.scalings.query_scale.beta == 0.3
    prompt = prompts_of([40], 96, seed=7)[0]
    expect = hf.double()(input_ids=torch.tensor([prompt])).logits[0]
    got = step(model, model.allocate_kv_caches(16, 4), [prompt], [0], max_blocks=16)[0]
    assert relative_error(got, expect) < TOLERANCE
    with pytest.raises(ValueError, match="model_type 'mistral'"):  # Mistral3Config's default text model: no MLA
        MLAConfig.from_hf(dict(config.to_dict(), text_config={"hidden_size": 64}))
