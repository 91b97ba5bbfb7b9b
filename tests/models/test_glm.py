"""GLM-4.7-Flash (``glm4_moe_lite``) against transformers' Glm4MoeLiteForCausalLM, on tiny checkpoints written
here: DeepSeek-V3's attention and sigmoid gate (``e_score_correction_bias``, one group, norm_topk_prob,
routed_scaling_factor 1.8), P != V (P = 24 < V = 32, as the release's 192 < 256), interleaved RoPE rows,
and ``mlp_layer_types`` ("sparse", "dense", "sparse": the first layer has experts, which no
first_k_dense_replace can say). The release layout: its config.json form (rope_theta, no
mlp_layer_types: transformers makes layer 0 dense and the rest sparse) and an MTP layer past
num_hidden_layers.
"""

import json
import os
import shutil

import pytest
import torch

import mla_ops
from mla_ops.models.config import MLAConfig
from tests.support.families import check_cli, check_generation, check_logits, spread_weights

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=24,
             qk_rope_head_dim=8, v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
             max_position_embeddings=128, rope_parameters=dict(rope_type="default", rope_theta=50000.0))


def make_glm(mlp_layer_types, seed):
    config = transformers.Glm4MoeLiteConfig(**SHAPE, mlp_layer_types=mlp_layer_types)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # its grouped_mm takes no float64
    torch.manual_seed(seed)
    return spread_weights(transformers.Glm4MoeLiteForCausalLM(config), seed + 1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_glm(["sparse", "dense", "sparse"], seed=0)
    path = tmp_path_factory.mktemp("glm")
    hf.save_pretrained(path)
    return str(path), hf


def test_config_reads_the_layer_types_and_gate(checkpoint):
    path, hf = checkpoint
    config = MLAConfig.from_hf(path)
    assert config.layer_kinds.mlp_layer_types == ("sparse", "dense", "sparse")
    assert [config.is_moe_layer(i) for i in range(3)] == [True, False, True]
    assert (config.scoring_func, config.topk_method, config.norm_topk_prob) == ("sigmoid", "noaux_tc", True)
    assert (config.routed_scaling_factor, config.n_group, config.rms_norm_eps) == (1.8, 1, 1e-5)
    assert (config.qk_nope_head_dim, config.v_head_dim, config.rope_theta) == (24, 32, 50000.0)
    model = mla_ops.MLAForCausalLM(config)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["MoE", "FeedForward", "MoE"]


def test_logits_match_transformers_with_and_without_a_cached_prefix(checkpoint):
    path, hf = checkpoint
    print(f"glm4_moe_lite: largest logit difference {check_logits(path, hf):.2e} (relative, float64)")


def test_greedy_generation_matches_transformers_and_reuses_prefixes(checkpoint):
    check_generation(*checkpoint)


def test_cli_generates(checkpoint, capsys):
    check_cli(checkpoint[0], capsys)


def release_layout(hf, path):
    """GLM-4.7-Flash's Hub form: the released config.json keys and an MTP layer past num_hidden_layers."""
    hf.save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    n, hidden = hf.config.num_hidden_layers, hf.config.hidden_size
    g = torch.Generator().manual_seed(3)
    for suffix, shape in (("enorm.weight", [hidden]), ("hnorm.weight", [hidden]), ("eh_proj.weight", [hidden, 2 * hidden]),
                          ("shared_head.norm.weight", [hidden]), ("input_layernorm.weight", [hidden])):
        tensors[f"model.layers.{n}.{suffix}"] = torch.randn(shape, generator=g)
    save_file(tensors, file)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    for key in ("mlp_layer_types", "dtype", "qk_head_dim"):
        config.pop(key)
    config.update(rope_theta=rope["rope_theta"], rope_scaling=None, partial_rotary_factor=1.0, torch_dtype="bfloat16",
                  first_k_dense_replace=1, num_nextn_predict_layers=1, topk_method="noaux_tc",
                  architectures=["Glm4MoeLiteForCausalLM"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def test_release_layout_loads(tmp_path):
    hf = make_glm(None, seed=4)  # transformers' default: dense, sparse, sparse
    release_layout(hf, tmp_path)
    config = MLAConfig.from_hf(tmp_path)
    assert config.layer_kinds.mlp_layer_types == ("dense", "sparse", "sparse") and config.dtype == "bfloat16"
    model = mla_ops.MLAForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert len(model.model.layers) == 3  # the MTP layer (model.layers.3.*) skipped
    prompt = torch.arange(11) * 7 % 96
    plan = mla_ops.plan_prefill(torch.tensor([0, 11], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                                torch.arange(4, dtype=torch.int32)[None], 4)
    with torch.no_grad():
        got = model(prompt, torch.arange(11), model.allocate_kv_caches(4, 4), torch.arange(11), plan)
        expect = hf.to(torch.float64)(prompt[None]).logits[0]
    torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-6 * float(expect.abs().max()))


@pytest.mark.parametrize("change, error, match", [
    (dict(mlp_layer_types=["dense", "sparse"]), ValueError, r"mlp_layer_types must have num_hidden_layers=3 entries"),
    (dict(mlp_layer_types=["dense", "moe", "sparse"]), ValueError, r"mlp_layer_types\[1\] must be one of"),
    (dict(mlp_layer_types="dense"), TypeError, "mlp_layer_types must be None or a list"),
    (dict(n_routed_experts=0), ValueError, r"mlp_layer_types\[0\] is 'sparse' but n_routed_experts is None"),
    (dict(partial_rotary_factor=0.5), ValueError, "partial_rotary_factor=0.5"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)), ValueError,
     r"rope_parameters\.partial_rotary_factor"),
])
def test_config_errors_name_the_key(checkpoint, change, error, match):
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        config = json.load(f)
    with pytest.raises(error, match=match):
        MLAConfig.from_hf(dict(config, **change))


def test_a_layer_type_the_tensors_disagree_with_is_named(checkpoint, tmp_path):
    shutil.copytree(checkpoint[0], tmp_path, dirs_exist_ok=True)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(dict(config, mlp_layer_types=["sparse", "sparse", "sparse"]), f)
    with pytest.raises(ValueError, match=r"layer 1 is MoE by mlp_layer_types\[1\]='sparse', but the checkpoint's is not"):
        mla_ops.MLAForCausalLM.from_pretrained(tmp_path)
