"""Mistral Large 4 (``mistral_large4``) against transformers' MistralLarge4ForConditionalGeneration, on tiny
checkpoints its ``save_pretrained`` wrote (Mistral's native names: ``layers.{i}.attention.wq``, ``wkv_a_with_mqa``,
``experts.{e}.w1``, ``tok_embeddings``, ``lerope.alpha``, ...; a one-layer Pixtral vision tower, skipped).

Three layers: RoPE, NoPE (``no_rope_layers`` 0: R = 0, an L-wide latent, P + R nope dims, an indexer without
RoPE), RoPE. Two checkpoints:

* ``plain``: indexer_types full, full, shared (the NoPE layer's own indexer; the last layer reuses its top-k);
* ``shared``: ``kv_source_layers`` 0, 1, 0 and indexer_types full, shared, full: layer 2 has no
  ``wkv_a_with_mqa``, writes no latent cache and attends layer 0's, with an indexer (and index cache) of its own.

Every layer has the learned per-head query scale (attention and indexer), the model learned RoPE frequencies
(set to ``0.3 * randn``: transformers computes its RoPE angles in float32, whose error grows with the
frequencies) and soft-capped logits. ``index_topk`` 8 with 16 indexer heads: the prompts of 13 and 21 tokens
take the sparse path, the one of 7 the dense one; ``index_score_gap`` asserts the scores have no near-ties.
"""

import json
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mla_ops
from mla_ops.models.config import MLAConfig
from mla_ops.models.mistral_large4 import native_name
from tests.support.dsa_families import check_cache_bookkeeping, check_selection, index_score_gap
from tests.support.families import check_cli, check_generation, check_logits, check_whole_model_compile, \
    prompts_of, spread_weights, step

transformers = pytest.importorskip("transformers")

TEXT = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
            max_position_embeddings=128, index_topk=8, index_n_heads=16, index_head_dim=16, no_rope_layers=[1, 0, 1],
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                                 beta_fast=32.0, beta_slow=1.0, attention_factor=1.0))
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
              image_size=28, head_dim=16)
KINDS = {"plain": dict(indexer_types=["full", "full", "shared"]),
         "shared": dict(indexer_types=["full", "shared", "full"], kv_source_layers=[0, 1, 0])}


def make_large4(kind, seed=0):
    config = transformers.MistralLarge4Config(text_config={**TEXT, **KINDS[kind]}, vision_config=VISION)
    for c in (config, config.text_config):
        c._attn_implementation = "eager"
        c._experts_implementation = "eager"  # its grouped_mm takes no float64
    torch.manual_seed(seed)
    hf = spread_weights(transformers.MistralLarge4ForConditionalGeneration(config), seed + 1)
    with torch.no_grad():
        alpha = hf.model.language_model.rotary_emb.alpha
        alpha.copy_(0.3 * torch.randn(alpha.shape, generator=torch.Generator().manual_seed(seed + 2)))
    return hf


@pytest.fixture(scope="module", params=sorted(KINDS))
def checkpoint(request, tmp_path_factory):
    hf = make_large4(request.param)
    path = tmp_path_factory.mktemp(f"large4_{request.param}")
    hf.save_pretrained(path)
    return str(path), hf, request.param


@pytest.fixture(scope="module")
def model64(checkpoint):
    return mla_ops.MLAForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float64)


def test_config_and_layers(checkpoint):
    path, _, kind = checkpoint
    config = MLAConfig.from_hf(path)
    kinds, indexer = config.layer_kinds, config.indexer
    assert (config.wrapper, config.q_lora_rank, indexer.index_n_heads, config.scalings.final_logit_softcapping) == \
        ("mistral_large4", None, 16, 30.0)
    assert kinds.no_rope_layers == (1, 0, 1) and kinds.indexer_types == tuple(KINDS[kind]["indexer_types"])
    assert (config.topk_method, config.lora_norm_eps, indexer.indexer_rope_interleave) == ("group_top2", 1e-5, True)
    model = mla_ops.MLAForCausalLM(config)
    attn = [layer.self_attn for layer in model.model.layers]
    assert [(a.qk_nope_head_dim, a.qk_rope_head_dim) for a in attn] == [(16, 8), (24, 0), (16, 8)]
    caches = model.allocate_kv_caches(5, 4)
    if kind == "shared":  # layer 2 reads layer 0's latent cache: two latent layers, and two indexers
        assert not hasattr(attn[2], "kv_a_proj_with_mqa") and attn[2].indexer is not None
        assert torch.stack(caches.latent).shape == (2, 5, 4, 40) and torch.stack(caches.index).shape == (2, 5, 4, 16)
    else:
        assert torch.stack(caches.latent).shape == (3, 5, 4, 40) and torch.stack(caches.index).shape == (2, 5, 4, 16)


def test_the_router_normalizes_whatever_the_config_says(checkpoint):
    # MistralLarge4TopkRouter always normalizes its top-k weights; config.json's norm_topk_prob is read by nothing.
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        config = json.load(f)
    config["text_config"]["norm_topk_prob"] = False
    assert MLAConfig.from_hf(config).norm_topk_prob


def test_the_test_data_has_no_near_ties(model64):
    prompts = prompts_of([13, 7, 21], 96, seed=1) + prompts_of([10, 9], 96, seed=2)
    assert index_score_gap(model64, prompts) > 1e-4


def test_the_indexer_selects_what_transformers_selects(checkpoint, model64):
    check_selection(model64, checkpoint[1].to(torch.float64), prompts_of([21], 96, seed=1)[0])


def test_logits_match_transformers_with_and_without_a_cached_prefix(checkpoint):
    # 1e-5, not 1e-6: transformers' MistralLarge4TextRotaryEmbedding computes its inverse frequencies, exp(alpha)
    # and the angles in float32 (and the query scale's log(pos + 1)), whatever the model dtype: about 8e-6 here,
    # 1.4e-6 with those in float64 (measured by patching them; the rest is the float32 gates of both sides).
    path, hf, kind = checkpoint
    worst = check_logits(path, hf, rtol=1e-5)
    print(f"mistral_large4 ({kind}): largest logit difference {worst:.2e} (relative, float64)")


class OpCounts(TorchDispatchMode):
    """The latent rows each mla_ops cache write puts in (by the written tensor's width)."""

    def __init__(self):
        super().__init__()
        self.widths = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() == "mla_ops::write_latent_cache":
            self.widths.append(args[0].shape[1] + args[1].shape[1])  # kv_c + k_pe (or an index key + nothing)
        return func(*args, **(kwargs or {}))


def test_a_shared_layer_writes_no_latent_rows(checkpoint, model64):
    kind = checkpoint[2]
    with torch.no_grad(), OpCounts() as ops:
        step(model64, model64.allocate_kv_caches(4, 4), [prompts_of([13], 96, seed=1)[0]], [0], index_topk=8)
    # latent rows: 40 (L + R), 32 (the NoPE layer: L, R = 0); index keys: 16 (+ 0) per full layer
    expect = [40, 16, 32, 16, 40] if kind == "plain" else [40, 16, 32, 16]  # each layer: latent, then index key
    assert ops.widths == expect


def test_greedy_generation_matches_transformers_and_reuses_prefixes(checkpoint):
    check_generation(*checkpoint[:2])


def test_eviction_frees_every_cache(checkpoint):
    path, hf, _ = checkpoint
    hits = check_cache_bookkeeping(path, hf)
    # The second call's blocks evict some of the first's cached ones (latent and index rows alike, one block id
    # naming both), so the third reuses only part of its prefixes and recomputes the rest.
    assert hits[1] == 0 and 0 < hits[2] < 32, hits


def test_cli_generates(checkpoint, capsys):
    check_cli(checkpoint[0], capsys)


def test_context_parallel_is_refused_by_name(checkpoint):
    with pytest.raises(ValueError, match="context_parallel does not serve DeepSeek Sparse Attention"):
        mla_ops.MLAForCausalLM.from_pretrained(checkpoint[0], context_parallel=mla_ops.ContextParallel())


def test_native_names():
    assert native_name("layers.3.attention.wkv_a_with_mqa.weight") == "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"
    assert native_name("layers.1.experts.2.w3.weight") == "model.layers.1.mlp.experts.2.up_proj.weight"
    assert native_name("layers.1.shared_experts.w2.weight") == "model.layers.1.mlp.shared_experts.down_proj.weight"
    assert native_name("layers.0.attention.indexer.ssmax_scaling.s") == \
        "model.layers.0.self_attn.indexer.softmax_scaling.scale"
    assert native_name("lerope.alpha") == "model.rotary_emb.alpha" and native_name("output.weight") == "lm_head.weight"
    assert native_name("model.language_model.layers.0.mlp.experts.gate_up_proj") == \
        "model.layers.0.mlp.experts.gate_up_proj"  # transformers' own module names load too
    for skipped in ("vision_encoder.transformer.layers.0.attention.wq.weight", "patch_merger.merging_layer.weight",
                    "mtp_dspark.layers.0.attention.wq.weight", "model.vision_tower.ln_pre.weight"):
        assert native_name(skipped) is None


@pytest.mark.parametrize("change, error, match", [
    (dict(kv_source_layers=[0, 0, 0]), ValueError, r"kv_source_layers\[1\] is 0, but the last shared layer"),
    (dict(kv_source_layers=[0, 2, 1]), ValueError, r"kv_source_layers\[1\] is 2"),
    (dict(kv_source_layers=[0, 1]), ValueError, "kv_source_layers must have num_hidden_layers=3 entries"),
    (dict(no_rope_layers=[1, 2, 1]), ValueError, r"no_rope_layers\[1\] must be 1 \(RoPE\) or 0 \(NoPE\)"),
    (dict(no_rope_layers="101"), TypeError, "no_rope_layers must be None or a list"),
    (dict(final_logit_softcapping="30"), TypeError, "final_logit_softcapping"),
    (dict(q_lora_rank=16), ValueError, "Mistral Large 4's attention has no q-LoRA"),
])
def test_config_errors_name_the_key(checkpoint, change, error, match):
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        config = json.load(f)
    config["text_config"].update(change)
    with pytest.raises(error, match=match):
        MLAConfig.from_hf(config)


def test_the_whole_model_compiles_with_a_region_per_layer_kind(model64):
    """torch.compile of the whole step: RoPE and NoPE layers, full and shared indexers, KV-sharing layers;
    the latent and index caches per layer."""
    check_whole_model_compile(model64, prompts_of([9, 14, 3], model64.config.vocab_size, seed=5), [4, 10, 0],
                              max_regions=8)
