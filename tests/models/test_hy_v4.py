"""HY-V4 (``hy_v4``, and ``hy_v4_vl`` around ``hy_v4_vl_text``) against transformers' HYV4ForCausalLM and
HYV4VLForConditionalGeneration, on tiny checkpoints their ``save_pretrained`` wrote (the release's names:
``learnable_sink_param``, ``linear_gate``, ``hc_pre.hc_attn_layer.hc_fn``, ...; the VL one with a one-layer vision
tower under ``vit.*``, skipped).

GLM-5's sparse layers (P = 24 < V = 32) with a per-head, per-dim sigmoid output gate, learned attention sinks
(the ops' ``sinks=``), 3 hyper-connection streams, routed experts whose SwiGLU is clamped at 1.5 (often, with these
weights), an indexer rotating the last R dims of its heads; three layers: dense then sparse, indexers full, full,
shared (HYV4Config's defaults). ``index_topk`` 8: the prompts of 13 and 21 tokens take the sparse path, the one of
7 the dense one; ``index_score_gap`` asserts the scores have no near-ties.

transformers keeps its norms and rotary tables (and here its hyper-connections, whose float32 is not what matters:
made float64 the difference stays 1.1e-6) in float32 even in a float64 model: the logits agree to ~1e-6 of the
largest (1.03e-6 for the VL checkpoint), just past ``check_logits``' default 1e-6, so ``RTOL`` is 2e-6.
"""

import json
import os

import pytest
import torch

import mla_ops
from mla_ops.models.config import MLAConfig
from mla_ops.models.hy_v4 import transformers_name
from tests.support.dsa_families import check_cache_bookkeeping, check_preset_runs, check_regional_compile, \
    check_selection, index_score_gap
from tests.support.families import check_cli, check_generation, check_logits, check_whole_model_compile, \
    prompts_of, spread_weights, step

transformers = pytest.importorskip("transformers")

TEXT = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8,
            v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, max_position_embeddings=128,
            index_topk=8, index_n_heads=16, index_head_dim=16, hc_mult=3, swiglu_limit=1.5,
            rope_parameters=dict(rope_type="default", rope_theta=50000.0), pad_token_id=None, bos_token_id=0,
            eos_token_id=1)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, out_hidden_size=64,
              patch_size=4, max_image_size=32)
RTOL = 2e-6


def make_hy(kind, seed=0):
    if kind == "hy_v4":
        config = transformers.HYV4Config(**TEXT)
        configs, cls = (config,), transformers.HYV4ForCausalLM
    else:
        text = dict(TEXT, rope_parameters=dict(TEXT["rope_parameters"], mrope_section=[2, 1, 1]))
        config = transformers.HYV4VLConfig(text_config=text, vision_config=VISION, image_token_id=90,
                                           video_token_id=91)
        configs, cls = (config, config.text_config), transformers.HYV4VLForConditionalGeneration
    for c in configs:
        c._attn_implementation = "eager"
        c._experts_implementation = "eager"  # its grouped_mm takes no float64
    torch.manual_seed(seed)
    hf = spread_weights(cls(config), seed + 1)
    with torch.no_grad():  # sinks around the attention logits' size, so they matter
        for name, p in hf.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 2)))
    return hf


@pytest.fixture(scope="module", params=["hy_v4", "hy_v4_vl"])
def checkpoint(request, tmp_path_factory):
    hf = make_hy(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return str(path), hf, request.param


@pytest.fixture(scope="module")
def model64(checkpoint):
    return mla_ops.MLAForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float64)


def test_config_reads_the_family(checkpoint):
    path, _, kind = checkpoint
    config = MLAConfig.from_hf(path)
    assert (config.decoder_layer, config.output_gate, config.attention_sinks, config.swiglu_limit) == \
        ("hyper", "hidden", True, 1.5)
    assert (config.hyper_connections.hc_mult, config.hyper_connections.hc_magnitude) == (3, 2.0)
    assert config.layer_kinds.indexer_types == ("full", "full", "shared")
    assert config.layer_kinds.mlp_layer_types == ("dense", "sparse", "sparse")
    indexer = config.indexer
    assert (indexer.indexer_rope_interleave, indexer.indexer_rope_last, indexer.indexer_norm_eps) == (True, True, 1e-5)
    assert (config.n_group, config.routed_scaling_factor, config.rms_norm_eps, config.rope_interleave) == \
        (1, 2.827, 1e-5, True)
    assert config.lora_norm_eps == (1e-5 if kind == "hy_v4_vl" else 1e-6)  # VL's latent norms read rms_norm_eps
    assert config.wrapper == (None if kind == "hy_v4" else "hy_v4_vl")
    model = mla_ops.MLAForCausalLM(config)
    caches = model.allocate_kv_caches(5, 4)
    assert torch.stack(caches.latent).shape == (3, 5, 4, 40) and torch.stack(caches.index).shape == (2, 5, 4, 16)


def test_config_defaults_are_hy_v4_configs():
    """A config.json naming only the sizes reads as HYV4Config fills it in (its layer kinds from the depth)."""
    sizes = {k: v for k, v in TEXT.items() if k not in ("hc_mult", "swiglu_limit", "pad_token_id", "bos_token_id",
                                                         "eos_token_id", "rope_parameters")}
    ref = transformers.HYV4Config(**dict(sizes, num_hidden_layers=6))
    ours = MLAConfig.from_hf(dict(sizes, model_type="hy_v4", num_hidden_layers=6))
    assert ours.layer_kinds.indexer_types == tuple(ref.indexer_types)  # full on 0 and (l - 1) % 4 == 0
    assert ours.layer_kinds.mlp_layer_types == tuple(ref.mlp_layer_types)
    assert (ours.hyper_connections.hc_mult, ours.hyper_connections.hc_eps, ours.swiglu_limit) == \
        (ref.hc_mult, ref.hc_eps, ref.swiglu_limit)
    assert (ours.routed_scaling_factor, ours.norm_topk_prob, ours.rms_norm_eps) == \
        (ref.routed_scaling_factor, ref.norm_topk_prob, ref.rms_norm_eps)


def test_release_names_read_as_transformers_reads_them():
    assert transformers_name("model.layers.3.hc_pre.hc_attn_layer.hc_fn") == "model.layers.3.attn_hc.fn"
    assert transformers_name("model.layers.3.hc_mlp_layer.hc_scale") == "model.layers.3.ffn_hc.scale"
    assert transformers_name("model.hc_pre.hc_head.hc_head_base") == "model.hc_head.hc_base"
    assert transformers_name("model.hc_head.hc_pre.hc_head_fn") == "model.hc_head.hc_fn"  # as the VL model writes it
    assert transformers_name("model.layers.0.self_attn.learnable_sink_param") == "model.layers.0.self_attn.sinks"
    assert transformers_name("model.layers.0.mlp.linear_gate.weight") == "model.layers.0.mlp.gate_proj.weight"


@pytest.mark.parametrize("change, match", [
    (dict(swiglu_limit=0), "swiglu_limit must be > 0"),
    (dict(hc_mult=0), "hc_mult must be"),
    (dict(indexer_types=["shared", "full", "full"]), r"indexer_types\[0\] must be 'full'"),
])
def test_config_errors_name_the_key(checkpoint, change, match):
    if checkpoint[2] != "hy_v4":
        pytest.skip("the text model's keys: one checkpoint suffices")
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        config = json.load(f)
    with pytest.raises(ValueError, match=match):
        MLAConfig.from_hf(dict(config, **change))


def test_the_test_data_has_no_near_ties(model64):
    prompts = prompts_of([13, 7, 21], 96, seed=1) + prompts_of([10, 9], 96, seed=2)
    assert index_score_gap(model64, prompts) > 1e-4


def test_the_indexer_selects_what_transformers_selects(checkpoint, model64):
    check_selection(model64, checkpoint[1].to(torch.float64), prompts_of([21], 96, seed=1)[0])


def test_logits_match_transformers_with_and_without_a_cached_prefix(checkpoint):
    path, hf, kind = checkpoint
    print(f"{kind}: largest logit difference {check_logits(path, hf, rtol=RTOL):.2e} (relative, float64)")


@torch.no_grad()
def test_the_model_parts_matter(model64):
    """Without its sinks, gate or clamp the model's logits move far past RTOL: each is exercised by the data."""
    prompt = prompts_of([13], 96, seed=1)[0]

    def logits():
        return torch.cat(step(model64, model64.allocate_kv_caches(4, 4), [prompt], [0], index_topk=8))

    base = logits()
    attn = model64.model.layers[1].self_attn
    experts = model64.model.layers[1].mlp.experts
    changes = [(attn, "sinks", None), (attn, "output_gate", None), (experts, "swiglu_limit", None)]
    for module, name, value in changes:
        old = getattr(module, name)
        setattr(module, name, value)
        try:
            assert float((logits() - base).abs().max() / base.abs().max()) > 1e-3, name
        finally:
            setattr(module, name, old)


@torch.no_grad()
def test_bfloat16_keeps_the_float32_parts(checkpoint):
    """In bfloat16 the hyper-connections, sinks, routers and indexer head weights stay float32, as transformers keeps
    them, and the logits are near transformers' own bfloat16 ones (these weights move both 0.27 from float64's: a
    routing or selection flips; 0.03 apart)."""
    if checkpoint[2] != "hy_v4":
        pytest.skip("the text model's parts: one checkpoint suffices")
    model = mla_ops.MLAForCausalLM.from_pretrained(checkpoint[0], dtype=torch.bfloat16)
    layer = model.model.layers[1]
    assert (layer.attn_hc.fn.dtype, model.model.hc_head.hc_fn.dtype, layer.self_attn.sinks.dtype,
            layer.self_attn.indexer.weights_proj.weight.dtype, layer.self_attn.gate_proj.weight.dtype) == \
        (torch.float32,) * 4 + (torch.bfloat16,)
    hf = transformers.HYV4ForCausalLM.from_pretrained(checkpoint[0], dtype=torch.bfloat16)
    hf.config._attn_implementation = "eager"
    hf.config._experts_implementation = "eager"
    prompt = prompts_of([13], 96, seed=1)[0]
    got = step(model, model.allocate_kv_caches(4, 4), [prompt], [0], index_topk=8)[0].double()
    ref = hf(torch.tensor([prompt])).logits[0].double()
    assert float((got - ref).abs().max() / ref.abs().max()) < 0.1


def test_greedy_generation_matches_transformers_and_reuses_prefixes(checkpoint):
    check_generation(*checkpoint[:2])


def test_evicted_blocks_are_rewritten_and_nothing_leaks(checkpoint):
    if checkpoint[2] != "hy_v4":
        pytest.skip("the caches are the text model's: one checkpoint suffices")
    check_cache_bookkeeping(*checkpoint[:2])


def test_cli_generates(checkpoint, capsys):
    check_cli(checkpoint[0], capsys)


def test_the_whole_model_compiles_with_a_region_per_layer_kind(checkpoint):
    """torch.compile of the whole step on six hyper-connected layers (HYV4Config's kinds for six: dense full, MoE
    full, three MoE shared, MoE full): one graph, each MoE kind a region stamped out for its later layers."""
    if checkpoint[2] != "hy_v4":
        pytest.skip("the text model's layers: one checkpoint suffices")
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if k not in ("indexer_types", "mlp_layer_types", "layer_types")}
    model = mla_ops.MLAForCausalLM(MLAConfig.from_hf(dict(config, num_hidden_layers=6))).double()
    spread_weights(model, seed=4)
    graph = check_whole_model_compile(model, prompts_of([9, 14, 3], model.config.vocab_size, seed=5), [4, 10, 0],
                                      max_regions=3)
    if graph is not None:
        assert any(n.target is torch.ops.higher_order.invoke_subgraph for n in graph.graph.nodes)


def test_tiny_preset_builds_and_runs():
    check_preset_runs("tiny-hy-v4")


def test_regional_compile_equals_eager():
    check_regional_compile("tiny-hy-v4")
