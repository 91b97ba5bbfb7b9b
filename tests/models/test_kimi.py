"""Kimi K2.5 (model type ``kimi_k25``): DeepSeek-V3's text model inside a multimodal wrapper, against
transformers' ``Kimi_K25ForConditionalGeneration`` on a tiny random model with a tiny vision tower.

Two layouts of one checkpoint: what transformers' save_pretrained writes (config.json in transformers 5's
form, the text layers as ``language_model.model.blocks.{i}``) and the Hub release's (text config of model
type "kimi_k2" in the released form, ``language_model.model.layers.{i}``, two shards), made here by
renaming the first. The vision tower and projector are in both and skipped.
"""

import json
import os
import shutil

import pytest
import torch

import mla_ops
from mla_ops.models.config import MLAConfig
from mla_ops.models.wrappers import text_names

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from tests.support.families import prompts_of, rewrite_checkpoint, step, transformers_greedy  # noqa: E402

TEXT = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, max_position_embeddings=128,
            rms_norm_eps=1e-6, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
            norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                                 beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))
VISION = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
              num_hidden_layers=1, hidden_size=16, intermediate_size=32)


@torch.no_grad()
def make_kimi(seed: int = 0):
    """Kimi K2.5 with untied embeddings (as released), float64, weights at ~1/sqrt(fan_in) so attention
    and routing are far from uniform and greedy tokens far from ties."""
    config = transformers.Kimi_K25Config(text_config=TEXT, vision_config=VISION, projection_hidden_size=16,
                                         tie_word_embeddings=False)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # a loop over experts: float64 (torch._grouped_mm takes none)
    torch.manual_seed(seed)
    model = transformers.Kimi_K25ForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5 * 1.5 if p.dim() >= 2
                else 1 + 0.3 * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.double()


def hub_layout(src, dst):
    """The Hub's layout of a transformers-written checkpoint: ``layers`` for ``blocks`` in the text model,
    two shards and an index, and config.json as released (text model_type "kimi_k2", rope_theta +
    rope_scaling, torch_dtype, the gate named)."""
    os.makedirs(dst)
    tensors = {name.replace("language_model.model.blocks.", "language_model.model.layers."): t
               for name, t in load_file(os.path.join(src, "model.safetensors")).items()}
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(dst, file))
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    text = config["text_config"]
    rope = dict(text.pop("rope_parameters"))
    text.update(model_type="kimi_k2", rope_theta=rope.pop("rope_theta"), rope_scaling=dict(rope, type=rope.pop("rope_type")),
                scoring_func="sigmoid", topk_method="noaux_tc", torch_dtype="float64")
    del config["dtype"]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """layout -> checkpoint directory, and the transformers model both hold."""
    hf = make_kimi()
    path = tmp_path_factory.mktemp("kimi")
    hf.save_pretrained(path / "transformers")
    return {"transformers": str(path / "transformers"), "hub": hub_layout(path / "transformers", path / "hub")}, hf


def test_transformers_writes_blocks_and_keeps_the_vision_tower(kimi):
    paths, _ = kimi
    names = load_file(os.path.join(paths["transformers"], "model.safetensors")).keys()
    assert "language_model.model.blocks.1.mlp.experts.7.down_proj.weight" in names
    assert "language_model.lm_head.weight" in names
    assert not any(".layers." in n for n in names) and any(n.startswith("vision_tower.") for n in names)


def test_config_of_both_layouts(kimi):
    paths, hf = kimi
    config = MLAConfig.from_hf(paths["transformers"])
    text = MLAConfig.from_hf(hf.config.text_config.to_dict())  # the text model alone, as DeepSeek-V3
    assert config == MLAConfig(**{**text.__dict__, "wrapper": "kimi_k25", "dtype": "float64"})
    assert (config.tie_word_embeddings, text.tie_word_embeddings) == (False, False)
    assert MLAConfig.from_hf(paths["hub"]) == config
    assert (config.scoring_func, config.topk_method, config.n_group, config.rope_scaling.factor) == (
        "sigmoid", "noaux_tc", 4, 4.0)

    with open(os.path.join(paths["transformers"], "config.json")) as f:
        raw = json.load(f)
    del raw["tie_word_embeddings"]  # transformers' Kimi_K25Config ties lm_head by default
    assert MLAConfig.from_hf(raw).tie_word_embeddings is True
    with pytest.raises(ValueError, match=r"text_config must be an object \(the text model of model_type 'kimi_k25'\), got None"):
        MLAConfig.from_hf(dict(raw, text_config=None))
    text_raw = {k: v for k, v in raw["text_config"].items() if k != "hidden_size"}
    with pytest.raises(ValueError, match=r"text_config \(the text model of model_type 'kimi_k25'\): config.json "
                                         r"lacks 'hidden_size'"):
        MLAConfig.from_hf(dict(raw, text_config=text_raw))
    with pytest.raises(TypeError, match=r"text_config \(the text model of model_type 'kimi_k25'\): kv_lora_rank must be an int"):
        MLAConfig.from_hf(dict(raw, text_config=dict(raw["text_config"], kv_lora_rank="32")))
    with pytest.raises(ValueError, match=r"model_type 'llava' is not one mla_ops reads.*'kimi_k25'"):
        MLAConfig.from_hf(dict(raw, model_type="llava"))  # a wrapper mla_ops does not read
    with pytest.raises(TypeError, match="wrapper must be a string"):
        MLAConfig(**{**text.__dict__, "wrapper": 1})
    with pytest.raises(ValueError, match="wrapper must be one of"):  # checked where its checkpoint names are read
        text_names("llava", ["language_model.model.embed_tokens.weight"])


def max_relative(got, ref):
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("layout", ["transformers", "hub"])
@torch.no_grad()
def test_float64_logits_equal_transformers_with_and_without_cached_context(kimi, layout):
    paths, hf = kimi
    model = mla_ops.MLAForCausalLM.from_pretrained(paths[layout], dtype=torch.float64)
    assert len(model.model.layers) == 2 and model.lm_head.weight is not model.model.embed_tokens.weight
    prompts = prompts_of([13, 7, 21], model.config.vocab_size, seed=1)
    expect = [hf(input_ids=torch.tensor([p])).logits[0] for p in prompts]  # text only, each whole sequence
    caches = model.allocate_kv_caches(3 * 8, 4)
    worst = 0.0
    for got, ref in zip(step(model, caches, prompts, [0, 0, 0]), expect):
        worst = max(worst, max_relative(got, ref))
    cached = [8, 0, 17]
    step(model, caches, [p[:c] for p, c in zip(prompts, cached)], [0, 0, 0])
    for options in ({}, {"absorb_max_query_len": 0, "workspace_size": 8}):  # absorbed; the chunk loop, 2+ chunks
        for got, ref, c in zip(step(model, caches, prompts, cached, **options), expect, cached):
            worst = max(worst, max_relative(got, ref[c:]))
    # Measured 8.5e-7: transformers computes its RMSNorms, the attention softmax and the router in float32
    # even for float64 weights (mla_ops only the router).
    assert worst < 5e-6, f"max |logit diff| / max |logit| = {worst:.2e}"


@pytest.fixture(scope="module")
def float32_kimi(kimi):
    """The same model in float32 (its weights are float32 values), for generation at its usual dtype."""
    return kimi[0], make_kimi().float()


def test_greedy_generation_equals_transformers_with_prefix_caching(float32_kimi):
    paths, hf = float32_kimi
    model = mla_ops.MLAForCausalLM.from_pretrained(paths["hub"], dtype=torch.float32)
    vocab = model.config.vocab_size
    shared, other = prompts_of([10, 9], vocab, seed=2)
    prompts = [shared + [3, 4, 5], shared + [6], other[:5], shared + [3, 4, 5]]
    expect = transformers_greedy(hf, prompts, 6, pad_token_id=vocab - 1)  # the multimodal class, text only
    generator = mla_ops.Generator(model, block_size=4)
    assert generator.generate(prompts, 6) == expect
    assert generator.stats.cached_tokens == 8 + 12  # prompt 1 reuses 2 of prompt 0's blocks, prompt 3 all 3
    assert generator.generate(prompts, 6) == expect and generator.stats.cached_tokens == 12 + 8 + 4 + 12
    assert mla_ops.generate(model, prompts[:2], 6) == expect[:2]


def test_cli_generates(float32_kimi, tmp_path, capsys):
    from mla_ops.__main__ import main

    paths, _ = float32_kimi
    path = shutil.copytree(paths["hub"], tmp_path / "hub")
    model = mla_ops.MLAForCausalLM.from_pretrained(path)  # dtype from config.json (float64)
    assert model.lm_head.weight.dtype == torch.float64
    expect = mla_ops.generate(model, [[5, 6, 7]], 4)[0]
    main(["generate", "--model", str(path), "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--ignore-eos"])
    assert capsys.readouterr().out.strip() == ",".join(map(str, expect))
    config = json.loads((path / "config.json").read_text())
    assert "eos_token_id" not in config and "vocab_size" not in config  # both sit in text_config
    config["text_config"]["eos_token_id"] = expect[1]
    (path / "config.json").write_text(json.dumps(config))
    main(["generate", "--model", str(path), "--prompt-ids", "5,6,7", "--max-new-tokens", "4"])
    assert capsys.readouterr().out.strip() == ",".join(map(str, expect[: expect.index(expect[1]) + 1]))




BAD = {
    "missing": (lambda t: t.pop("language_model.model.blocks.1.self_attn.kv_b_proj.weight"),
                r"missing tensors \(1\): model\.layers\.1\.self_attn\.kv_b_proj\.weight"),
    "both names": (lambda t: t.update({"language_model.model.layers.0.input_layernorm.weight": torch.ones(64)}),
                   r"language_model\.model\.blocks\.0\.input_layernorm\.weight and "
                   r"language_model\.model\.layers\.0\.input_layernorm\.weight are both"),
    "wrong shape": (lambda t: t.update({"language_model.model.norm.weight": torch.ones(63)}),
                    r"language_model\.model\.norm\.weight: the checkpoint has \[63\], the model expects \[64\]"),
    "extra layer": (lambda t: t.update({"language_model.model.blocks.2.input_layernorm.weight": torch.ones(64)}),
                    r"num_hidden_layers=2 in config.json, but the checkpoint has decoder layer 2"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_loading_errors_name_the_tensor(kimi, tmp_path, case):
    change, message = BAD[case]
    path = rewrite_checkpoint(kimi[0]["transformers"], tmp_path / "ckpt", change)
    with pytest.raises(ValueError, match=message):
        mla_ops.MLAForCausalLM.from_pretrained(path)


def test_int4_release_is_refused_by_its_quant_method(kimi, tmp_path):
    """Kimi K2.5's release stores its routed experts as compressed-tensors int4: named, not misread."""
    path = shutil.copytree(kimi[0]["hub"], tmp_path / "int4")
    with open(path / "config.json") as f:
        config = json.load(f)
    config["text_config"]["quantization_config"] = dict(quant_method="compressed-tensors", format="pack-quantized")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method is 'compressed-tensors'"):
        mla_ops.MLAForCausalLM.from_pretrained(path)
