"""A.X-K2 (``axk2``) against transformers' AXK2ForCausalLM, on a tiny checkpoint its ``save_pretrained`` wrote (the
release's names: the fused ``self_attn.q_b_proj``, the gate MLPs' ``W_down`` / ``W_up``, per-expert tensors).

DeepSeek-V3.2's sparse layers with 40-wide latent rows (L = 32, R = 8: A.X-K2's 160 = 128 + 32 scaled down), no
``q_b_proj``: one projection of [normed, raw] q-LoRA latent gives the query and a per-head, per-dim sigmoid gate on
the attention output; gated RMSNorms (rank 4) on every input norm and on the MoE layers' post-attention norm (layer
0 is dense, its second norm plain); the router in 2 groups, 1 kept, with correction biases large enough that some
corrected scores are negative, so the experts of a dropped group (scored 0, not -inf, as transformers' A.X-K2 router
does) are picked. ``index_topk`` 8: the prompts of 13 and 21 tokens take the sparse path, the one of 7 the dense one;
``index_score_gap`` asserts the scores have no near-ties.
"""

import json
import os

import pytest
import torch

import mla_ops
from mla_ops.models.axk2 import transformers_name
from mla_ops.models.config import MLAConfig
from tests.support.dsa_families import check_preset_runs, check_regional_compile, check_selection, index_score_gap
from tests.support.families import check_cli, check_generation, check_logits, check_whole_model_compile, \
    prompts_of, spread_weights, step

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
             n_group=2, topk_group=1, max_position_embeddings=128, index_topk=8, index_n_heads=16, index_head_dim=16,
             gated_norm_rank=4, rope_parameters=dict(rope_type="default", rope_theta=50000.0), bos_token_id=0,
             eos_token_id=1)


def make_axk2(seed=0, **change):
    config = transformers.AXK2Config(**{**SHAPE, **change})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # its grouped_mm takes no float64
    torch.manual_seed(seed)
    hf = spread_weights(transformers.AXK2ForCausalLM(config), seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.6 * torch.randn(b.shape, generator=g))  # some corrected scores below 0
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_axk2()
    path = tmp_path_factory.mktemp("axk2")
    hf.save_pretrained(path)
    return str(path), hf


@pytest.fixture(scope="module")
def model64(checkpoint):
    return mla_ops.MLAForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float64)


def test_config_reads_the_family(checkpoint):
    config = MLAConfig.from_hf(checkpoint[0])
    assert (config.output_gate, config.gated_norm_rank, config.topk_method, config.rope_interleave) == \
        ("query", 4, "noaux_tc_zero", True)
    assert (config.n_group, config.topk_group, config.routed_scaling_factor, config.rms_norm_eps) == (2, 1, 2.5, 1e-6)
    assert (config.indexer.indexer_rope_interleave, config.indexer.indexer_rope_last) == (False, False)
    assert config.layer_kinds.mlp_layer_types == ("dense", "sparse", "sparse")
    model = mla_ops.MLAForCausalLM(config)
    layers = model.model.layers
    assert not hasattr(layers[0].self_attn, "q_b_proj") and layers[0].self_attn.q_gate_proj.weight.shape == (
        4 * (16 + 8 + 16), 2 * 32)
    assert [type(layer.post_attention_layernorm).__name__ for layer in layers] == \
        ["RMSNorm", "GatedRMSNorm", "GatedRMSNorm"]
    caches = model.allocate_kv_caches(5, 4)
    assert torch.stack(caches.latent).shape == (3, 5, 4, 40) and torch.stack(caches.index).shape == (3, 5, 4, 16)


def test_config_defaults_are_axk2_configs():
    """Without n_group / topk_group the router has no groups (A.X-K2-Light); without mlp_layer_types the layers
    from first_k_dense_replace (default 1) on are sparse; gated_norm_rank defaults to 16."""
    sizes = {k: v for k, v in SHAPE.items() if k not in ("n_group", "topk_group", "gated_norm_rank")}
    ref = transformers.AXK2Config(**sizes)
    ours = MLAConfig.from_hf(dict(sizes, model_type="axk2"))
    assert (ours.n_group, ours.topk_group, ref.n_group) == (1, 1, None)
    assert ours.layer_kinds.mlp_layer_types is None
    assert [ours.is_moe_layer(i) for i in range(3)] == [kind == "sparse" for kind in ref.mlp_layer_types]
    assert (ours.gated_norm_rank, ours.q_lora_rank, ours.routed_scaling_factor) == (ref.gated_norm_rank, 32, 2.5)


def test_release_names_read_as_transformers_reads_them():
    assert transformers_name("model.layers.1.input_layernorm.W_down.weight") == \
        "model.layers.1.input_layernorm.mlp.fc1.weight"
    assert transformers_name("model.layers.1.post_attention_layernorm.W_up.weight") == \
        "model.layers.1.post_attention_layernorm.mlp.fc2.weight"
    assert transformers_name("model.layers.1.self_attn.q_b_proj.weight") == "model.layers.1.self_attn.q_gate_proj.weight"


@pytest.mark.parametrize("change, match", [
    (dict(q_lora_rank=None), "q_lora_rank=null"),
    (dict(n_group=None), "n_group and topk_group must be set together"),
    (dict(gated_norm_rank=0), "gated_norm_rank must be"),
])
def test_config_errors_name_the_key(checkpoint, change, match):
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
    path, hf = checkpoint
    print(f"axk2: largest logit difference {check_logits(path, hf):.2e} (relative, float64)")


@torch.no_grad()
def test_the_model_parts_matter(model64, monkeypatch):
    """Without its norms' gates or its output gate the logits move far past the tolerance: each is exercised by the
    data (the router's zero-scored dropped groups: ``test_the_router_scores_dropped_groups_zero``)."""
    from mla_ops.models import layer as layer_module

    prompt = prompts_of([13], 96, seed=1)[0]

    def moved():
        got = torch.cat(step(model64, model64.allocate_kv_caches(4, 4), [prompt], [0], index_topk=8))
        return float((got - base).abs().max() / base.abs().max())

    base = torch.cat(step(model64, model64.allocate_kv_caches(4, 4), [prompt], [0], index_topk=8))
    layer = model64.model.layers[1]
    gated_norm = layer.input_layernorm
    layer.input_layernorm = gated_norm.norm  # the plain RMSNorm
    try:
        assert moved() > 1e-3
    finally:
        layer.input_layernorm = gated_norm
    with monkeypatch.context() as m:
        m.setattr(layer_module, "gated", lambda out, gate: out)  # no output gate
        assert moved() > 1e-3


@torch.no_grad()
def test_the_router_scores_dropped_groups_zero():
    """transformers' AXK2TopkRouter scores the experts of dropped groups 0 (not -inf): with every corrected score
    below 0 (biases -3) a token's top-2 is the two experts of the one group of 2 it dropped (no tie: 2 zeros for 2
    slots). mla_ops' gate ("noaux_tc_zero") routes the same, with the same weights; V3's ("noaux_tc") does not."""
    from mla_ops.models.moe import MoEGate

    config = transformers.AXK2Config(**dict(SHAPE, n_group=4, topk_group=3))
    ref = transformers.models.axk2.modeling_axk2.AXK2TopkRouter(config)
    g = torch.Generator().manual_seed(3)
    ref.weight.copy_(torch.randn(ref.weight.shape, generator=g) * 0.3)
    ref.e_score_correction_bias.copy_(-3 + 0.1 * torch.randn(8, generator=g))
    x = torch.randn(16, 64, generator=g)
    _, ref_weights, ref_indices = ref(x)
    ours = MLAConfig.from_hf({**config.to_dict(), "model_type": "axk2"})
    gate = MoEGate(ours)
    gate.weight.copy_(ref.weight)
    gate.e_score_correction_bias.copy_(ref.e_score_correction_bias)
    weights, indices = gate(x)
    order, ref_order = indices.sort(-1), ref_indices.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices))
    assert all(int(i[0]) // 2 == int(i[1]) // 2 for i in order.values)  # both experts of one (dropped) group
    gate.topk_method = "noaux_tc"
    assert not torch.equal(gate(x)[1].sort(-1).values, order.values)


def test_greedy_generation_matches_transformers_and_reuses_prefixes(checkpoint):
    check_generation(*checkpoint)


def test_cli_generates(checkpoint, capsys):
    check_cli(checkpoint[0], capsys)


def test_the_whole_model_compiles_with_a_region_per_layer_kind(checkpoint):
    """torch.compile of the whole step on five layers (dense, then four MoE layers with gated norms): one graph, the
    MoE layers one region stamped out for the later ones."""
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if k not in ("mlp_layer_types", "layer_types")}
    model = mla_ops.MLAForCausalLM(MLAConfig.from_hf(dict(config, num_hidden_layers=5))).double()
    spread_weights(model, seed=4)
    graph = check_whole_model_compile(model, prompts_of([9, 14, 3], model.config.vocab_size, seed=5), [4, 10, 0],
                                      max_regions=2)
    if graph is not None:
        assert any(n.target is torch.ops.higher_order.invoke_subgraph for n in graph.graph.nodes)


def test_tiny_preset_builds_and_runs():
    check_preset_runs("tiny-axk2")


def test_regional_compile_equals_eager():
    check_regional_compile("tiny-axk2")
