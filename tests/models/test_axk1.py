"""A.X-K1 (``axk1``) against transformers' AXK1ForCausalLM, on tiny checkpoints written here: DeepSeek-V3's
attention (always a q_lora_rank) and gate (sigmoid, group-limited top-k over ``e_score_correction_bias``-
corrected scores, norm_topk_prob, routed_scaling_factor 2.5), YaRN, interleaved RoPE rows, per-layer
``mlp_layer_types`` ("sparse", "dense", "sparse"), and its one delta: an RMSNorm on the MoE output,
``post_mlp_layernorm``, before the residual add (``MLAConfig.post_mlp_layernorm``).

Checkpoint names: ``save_pretrained`` writes the norm at the layer (``model.layers.{i}.post_mlp_layernorm``,
transformers' conversion renames it into ``mlp.`` at load) and the correction bias; the release layout has
an unused copy of the norm in the dense layers and no correction bias (transformers routes with zeros).
"""

import json
import os
import shutil

import pytest
import torch

import mla_ops
from mla_ops.models.config import MLAConfig
from tests.support.families import check_cli, check_generation, check_logits, rewrite_checkpoint, spread_weights

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=24,
             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
             n_group=2, topk_group=1, max_position_embeddings=128, bos_token_id=None, eos_token_id=None)


def make_axk1(mlp_layer_types, seed, rope=YARN):
    config = transformers.AXK1Config(**SHAPE, mlp_layer_types=mlp_layer_types, rope_parameters=dict(rope))
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # its grouped_mm takes no float64
    torch.manual_seed(seed)
    return spread_weights(transformers.AXK1ForCausalLM(config), seed + 1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_axk1(["sparse", "dense", "sparse"], seed=0)
    path = tmp_path_factory.mktemp("axk1")
    hf.save_pretrained(path)
    return str(path), hf


def test_config_reads_the_gate_layer_types_and_the_moe_output_norm(checkpoint):
    path, hf = checkpoint
    names = load_file(os.path.join(path, "model.safetensors"))
    # save_pretrained's names: the norm at the layer, in the MoE layers only; the correction bias written
    assert sorted(n for n in names if "post_mlp_layernorm" in n) == [
        "model.layers.0.post_mlp_layernorm.weight", "model.layers.2.post_mlp_layernorm.weight"]
    assert "model.layers.0.mlp.gate.e_score_correction_bias" in names
    config = MLAConfig.from_hf(path)
    assert config.layer_kinds.mlp_layer_types == ("sparse", "dense", "sparse")
    assert (config.scoring_func, config.topk_method, config.norm_topk_prob) == ("sigmoid", "noaux_tc", True)
    assert (config.routed_scaling_factor, config.n_group, config.topk_group) == (2.5, 2, 1)
    assert config.post_mlp_layernorm and config.optional_correction_bias
    assert config.rope_scaling is not None and config.rope_scaling.factor == 4.0
    model = mla_ops.MLAForCausalLM(config)
    layers = model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["MoE", "FeedForward", "MoE"]
    assert [layer.post_mlp_layernorm is not None for layer in layers] == [True, False, True]
    # Other families: no norm, no optional bias (their graphs and checks unchanged)
    with open(os.path.join(path, "config.json")) as f:
        v3 = MLAConfig.from_hf(dict(json.load(f), model_type="deepseek_v3"))
    assert not v3.post_mlp_layernorm and not v3.optional_correction_bias


def test_logits_match_transformers_with_and_without_a_cached_prefix(checkpoint):
    path, hf = checkpoint
    print(f"axk1: largest logit difference {check_logits(path, hf):.2e} (relative, float64)")


def test_greedy_generation_matches_transformers_and_reuses_prefixes(checkpoint):
    check_generation(*checkpoint)


def test_cli_generates(checkpoint, capsys):
    check_cli(checkpoint[0], capsys)


def release_layout(hf, path, nested=False):
    """A.X-K1's Hub form: the released config.json keys (first_k_dense_replace, rope_theta + rope_scaling,
    torch_dtype), an unused post_mlp_layernorm in the dense layer, no correction bias. ``nested``: the MoE
    layers' norm under transformers' model name (``mlp.post_mlp_layernorm``) instead."""
    hf.save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    tensors = {n: t for n, t in load_file(file).items() if not n.endswith("e_score_correction_bias")}
    if nested:
        tensors = {n.replace(".post_mlp_layernorm.", ".mlp.post_mlp_layernorm."): t for n, t in tensors.items()}
    tensors["model.layers.0.post_mlp_layernorm.weight"] = torch.full([hf.config.hidden_size], 7.0)  # dense: unused
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    for key in ("mlp_layer_types", "dtype", "qk_head_dim", "head_dim"):
        config.pop(key)
    config.update(rope_theta=rope.pop("rope_theta"), rope_scaling={"type": "yarn", **rope}, torch_dtype="bfloat16",
                  first_k_dense_replace=1, moe_layer_freq=1, architectures=["AXK1ForCausalLM"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("nested", [False, True])
def test_release_layout_loads(tmp_path, nested):
    hf = make_axk1(None, seed=4)  # transformers' default: dense, sparse, sparse
    release_layout(hf, tmp_path, nested)
    config = MLAConfig.from_hf(tmp_path)
    assert config.layer_kinds.mlp_layer_types is None
    assert config.first_k_dense_replace == 1 and config.dtype == "bfloat16"
    assert [config.is_moe_layer(i) for i in range(3)] == [False, True, True]
    model = mla_ops.MLAForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert model.model.layers[0].post_mlp_layernorm is None  # the dense layer's copy skipped
    for i in (1, 2):  # no bias in the checkpoint: zeros, as transformers routes
        assert not model.model.layers[i].mlp.gate.e_score_correction_bias.any()
        torch.testing.assert_close(model.model.layers[i].post_mlp_layernorm.weight.float(),
                                   hf.model.layers[i].mlp.post_mlp_layernorm.weight.float())
    ref = transformers.AXK1ForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)  # transformers' reading
    ref.config._attn_implementation = "eager"
    ref.config._experts_implementation = "eager"
    assert not ref.model.layers[1].mlp.gate.e_score_correction_bias.any()
    prompt = torch.arange(11) * 7 % 96
    table = torch.arange(4, dtype=torch.int32)[None]
    plan = mla_ops.plan_prefill(torch.tensor([0, 11], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                                table, 4)
    with torch.no_grad():
        got = model(prompt, torch.arange(11), model.allocate_kv_caches(4, 4), torch.arange(11), plan)
        expect = ref(prompt[None]).logits[0]
    torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-6 * float(expect.abs().max()))


def test_a_missing_moe_output_norm_is_named(checkpoint, tmp_path):
    def drop(tensors):
        del tensors["model.layers.2.post_mlp_layernorm.weight"]

    path = rewrite_checkpoint(checkpoint[0], tmp_path / "ckpt", drop)
    with pytest.raises(ValueError, match=r"missing tensors \(1\): model\.layers\.2\.post_mlp_layernorm\.weight"):
        mla_ops.MLAForCausalLM.from_pretrained(path)


def test_the_norm_is_unexpected_in_another_family(checkpoint, tmp_path):
    shutil.copytree(checkpoint[0], tmp_path, dirs_exist_ok=True)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(dict(config, model_type="deepseek_v3"), f)
    with pytest.raises(ValueError, match=r"unexpected tensors \(2\): model\.layers\.0\.post_mlp_layernorm\.weight"):
        mla_ops.MLAForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("change, error, match", [
    (dict(q_lora_rank=None), ValueError, r"q_lora_rank=null: A\.X-K1's attention always has a q_lora_rank"),
    (dict(mlp_layer_types=["dense", "sparse"]), ValueError, r"mlp_layer_types must have num_hidden_layers=3 entries"),
    (dict(mlp_layer_types=["dense", "moe", "sparse"]), ValueError, r"mlp_layer_types\[1\] must be one of"),
    (dict(n_routed_experts=0), ValueError, r"mlp_layer_types\[0\] is 'sparse' but n_routed_experts is None"),
    (dict(n_group=3), ValueError, r"n_routed_experts \(8\) divisible by n_group \(3\)"),
    (dict(attention_bias=True), ValueError, "attention_bias=true"),
    (dict(partial_rotary_factor=0.5), ValueError, "partial_rotary_factor=0.5"),
])
def test_config_errors_name_the_key(checkpoint, change, error, match):
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        config = json.load(f)
    with pytest.raises(error, match=match):
        MLAConfig.from_hf(dict(config, **change))


def test_the_release_defaults_are_transformers(checkpoint):
    """Keys a release leaves out take AXK1Config's defaults (n_group 8 needs 8 | E and >= 2 experts a group)."""
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        config = json.load(f)
    for key in ("q_lora_rank", "n_group", "topk_group", "mlp_layer_types", "max_position_embeddings"):
        config.pop(key)
    config.update(n_routed_experts=16, num_experts_per_tok=4)
    c = MLAConfig.from_hf(config)
    ref = transformers.AXK1Config(**{k: v for k, v in config.items()
                                     if k not in ("model_type", "architectures", "transformers_version")})
    assert (c.q_lora_rank, c.n_group, c.topk_group, c.max_position_embeddings) == (
        ref.q_lora_rank, ref.n_group, ref.topk_group, ref.max_position_embeddings)
    assert [c.is_moe_layer(i) for i in range(3)] == [t == "sparse" for t in ref.mlp_layer_types]


def test_flag_values_are_checked():
    base = dict(MLAConfig.from_name("tiny").__dict__)
    with pytest.raises(TypeError, match="post_mlp_layernorm"):
        MLAConfig(**dict(base, post_mlp_layernorm="true"))
    with pytest.raises(ValueError, match="post_mlp_layernorm=True norms the MoE output of decoder_layer 'deepseek'"):
        MLAConfig(**dict(base, post_mlp_layernorm=True, decoder_layer="longcat", n_routed_experts=4,
                         num_experts_per_tok=1, moe_intermediate_size=8))
