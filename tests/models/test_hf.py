"""Real checkpoints end to end, against transformers' DeepSeek-V2/V3 on tiny random models.

The checkpoints are written here (tests/support/hf_checkpoints.py): a V2-Lite-style and a V3-style model
saved by transformers' own save_pretrained, both with MoE and YaRN, and a V3 model in DeepSeek's
release layout with float8 block-scaled weights, two shards and an MTP layer.

logits [T, vocab] from MLAForCausalLM.from_pretrained(dir) vs transformers' forward on each whole
sequence; greedy tokens of mla_ops.generate vs transformers' generate(do_sample=False).
"""

import json
import os
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

import mla_ops
from mla_ops.models.checkpoint import dequantize_blocks
from mla_ops.models.config import MLAConfig
from mla_ops.models.rope import inverse_frequencies

transformers = pytest.importorskip("transformers")
from tests.support.hf_checkpoints import (  # noqa: E402
    dequantize_reference, make_hf_model, quantize_blocks, save_release_fp8)
from tests.support.families import prompts_of, rewrite_checkpoint, step, transformers_greedy  # noqa: E402

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (checkpoint directory, the transformers model it holds)."""
    out = {}
    for kind in ("v2", "v3"):
        hf = make_hf_model(kind)
        path = tmp_path_factory.mktemp(kind)
        hf.save_pretrained(path)
        out[kind] = (str(path), hf)
    hf = make_hf_model("v3", seed=5)
    path = tmp_path_factory.mktemp("fp8")
    save_release_fp8(hf, str(path), block=(16, 16))  # 16 x 16 blocks: partial edge blocks in tiny weights
    out["fp8"] = (str(path), hf)
    return out




@pytest.mark.parametrize("kind", ["v2", "v3", "fp8"])
@torch.no_grad()
def test_logits_match_transformers_with_and_without_a_cached_prefix(checkpoints, kind):
    path, hf = checkpoints[kind]
    model = mla_ops.MLAForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = prompts_of([13, 7, 21], model.config.vocab_size, seed=1)
    expect = [hf(torch.tensor([p])).logits[0] for p in prompts]  # each whole sequence, no cache
    caches = model.allocate_kv_caches(3 * 8, 4)

    for got, ref in zip(step(model, caches, prompts, [0, 0, 0]), expect):  # batched, nothing cached
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    cached = [8, 0, 17]  # request 1 has no context
    step(model, caches, [p[:c] for p, c in zip(prompts, cached)], [0, 0, 0])
    for options in ({}, {"absorb_max_query_len": 0, "workspace_size": 8}):  # absorbed; chunked MHA, 2+ chunks
        for got, ref, c in zip(step(model, caches, prompts, cached, **options), expect, cached):
            torch.testing.assert_close(got, ref[c:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["v2", "v3"])
def test_greedy_generation_matches_transformers_and_reuses_prefixes(checkpoints, kind):
    path, hf = checkpoints[kind]
    model = mla_ops.MLAForCausalLM.from_pretrained(path)
    vocab = model.config.vocab_size
    shared, other = prompts_of([10, 9], vocab, seed=2)
    prompts = [shared + [3, 4, 5], shared + [6], other[:5], shared + [3, 4, 5], other[5:6]]
    expect = transformers_greedy(hf, prompts, 6, pad_token_id=vocab - 1)

    generator = mla_ops.Generator(model, block_size=4)
    assert generator.generate(prompts, 6) == expect
    # Blocks of 4: prompt 1 reuses prompt 0's 2 shared blocks, prompt 3 (= prompt 0) 3 of them.
    assert (generator.stats.cached_tokens, generator.stats.prompt_tokens) == (8 + 12, 43)
    assert generator.generate(prompts, 6) == expect  # again: now every full prompt block is cached
    assert generator.stats.cached_tokens == 12 + 8 + 4 + 12 + 0
    with torch.no_grad():
        model.lm_head.weight.mul_(1.0)  # an in-place write: the cached rows may be stale now
    assert generator.generate(prompts, 6) == expect and generator.stats.cached_tokens == 8 + 12
    assert mla_ops.generate(model, prompts[:2], 6, block_size=16) == expect[:2]
    uncached = mla_ops.Generator(model, block_size=4, prefix_caching=False)
    assert uncached.generate(prompts, 6) == expect and uncached.stats.cached_tokens == 0

    stop = expect[0][2]
    assert generator.generate(prompts[:1], 6, eos_token_id=stop)[0] == expect[0][: expect[0].index(stop) + 1]


def test_compiled_generation_equals_eager(checkpoints):
    """compile=True: the layers compiled regionally once (three graphs: the attention inputs, a dense
    and an MoE layer's output) serve every step, bucket and call; the cache grows without a recompile."""
    path, _ = checkpoints["v3"]
    model = mla_ops.MLAForCausalLM.from_pretrained(path)
    prompts = prompts_of([9, 3, 14], model.config.vocab_size, seed=4)
    prompts.append(prompts[2][:9] + [1])  # shares two blocks with prompt 2: a deferred, mixed step
    longer = prompts_of([30, 21, 5, 17, 2], model.config.vocab_size, seed=5)
    eager, eager_longer = (mla_ops.Generator(model, block_size=4).generate(p, 4) for p in (prompts, longer))
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    compiled = mla_ops.Generator(model, block_size=4, compile=True)
    assert compiled.generate(prompts, 4) == eager
    assert compiled.stats.cached_tokens == 8
    runner = compiled._runner  # steps run through PrefillGraphs, none eager
    assert runner.regional and runner.stats["eager"] == 0 and runner.stats["replays"] == compiled.stats.steps
    assert counters["stats"]["unique_graphs"] - graphs == 3
    blocks = compiled.kv_caches.latent[0].shape[0]
    with torch.compiler.set_stance("fail_on_recompile"):
        assert compiled.generate(longer, 4) == eager_longer  # more blocks, larger buckets: no recompile
    assert compiled.kv_caches.latent[0].shape[0] > blocks and compiled._runner is not runner
    assert counters["stats"]["unique_graphs"] - graphs == 3


def test_config_forms_released_and_transformers_agree(checkpoints):
    path, _ = checkpoints["v3"]
    with open(os.path.join(path, "config.json")) as f:
        written = json.load(f)  # transformers 5: rope_parameters, dtype, no scoring_func / topk_method
    assert "rope_parameters" in written and "scoring_func" not in written and "rope_scaling" not in written
    rope = dict(written["rope_parameters"])
    released = {k: v for k, v in written.items() if k not in ("rope_parameters", "dtype")}
    released.update(rope_theta=rope.pop("rope_theta"), rope_scaling=dict(rope, type=rope.pop("rope_type")),
                    torch_dtype="float32", scoring_func="sigmoid", topk_method="noaux_tc")
    config = MLAConfig.from_hf(path)
    assert config == MLAConfig.from_hf(os.path.join(path, "config.json")) == MLAConfig.from_hf(released)
    assert (config.topk_method, config.scoring_func, config.n_group, config.dtype) == ("noaux_tc", "sigmoid", 4, "float32")
    assert (config.rope_scaling.factor, config.rope_scaling.original_max_position_embeddings) == (4.0, 32)
    with open(os.path.join(checkpoints["fp8"][0], "config.json")) as f:
        assert "rope_scaling" in json.load(f)  # the fp8 checkpoint carries the released form
    with pytest.raises(ValueError, match="rope_scaling type 'linear'"):
        MLAConfig.from_hf(dict(released, rope_scaling={"type": "linear", "factor": 2}))
    with pytest.raises(ValueError, match="model_type"):
        MLAConfig.from_hf(dict(written, model_type="kimi"))


@pytest.mark.parametrize("preset", ["deepseek-v2-lite", "deepseek-v3"])
def test_yarn_at_released_dims_matches_transformers(preset):
    """factor 40 over 4,096 positions, R = 64: frequencies, cos/sin factor and softmax scale."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    c = MLAConfig.from_name(preset)
    y = c.rope_scaling
    hf = transformers.DeepseekV3Config(
        hidden_size=256, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters=dict(rope_type="yarn", rope_theta=c.rope_theta, factor=y.factor, beta_fast=y.beta_fast,
                             beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim,
                             original_max_position_embeddings=y.original_max_position_embeddings),
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = inverse_frequencies(c.qk_rope_head_dim, c.rope_theta, y, "cpu", torch.float32)
    torch.testing.assert_close(ours, inv_freq, rtol=1e-6, atol=0)
    plain = inverse_frequencies(c.qk_rope_head_dim, c.rope_theta, None, "cpu", torch.float32)
    assert (ours < plain).sum() >= c.qk_rope_head_dim // 4  # YaRN changed the slow frequencies
    assert y.cos_sin_factor() == pytest.approx(attention_factor)
    assert c.softmax_scale == pytest.approx(DeepseekV3Attention(hf, 0).scaling)


@torch.no_grad()
def test_fp8_release_checkpoint_loads_dequantized_and_deinterleaved(checkpoints):
    path, hf = checkpoints["fp8"]
    model = mla_ops.MLAForCausalLM.from_pretrained(path)  # dtype from config.json: bfloat16
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays float32
    assert len(model.model.layers) == 2  # the MTP layer (model.layers.2.*) is skipped
    c = model.config
    # kv_a_proj_with_mqa: [L + R, H] = [48, 64], 16 x 16 blocks; the R rope rows de-interleaved.
    theirs = hf.model.layers[1].self_attn.kv_a_proj_with_mqa.weight  # dequantized, interleaved rope rows
    order = torch.cat([torch.arange(0, c.qk_rope_head_dim, 2), torch.arange(1, c.qk_rope_head_dim, 2)])
    expect = torch.cat([theirs[: c.kv_lora_rank], theirs[c.kv_lora_rank:][order]])
    assert torch.equal(model.model.layers[1].self_attn.kv_a_proj_with_mqa.weight, expect.to(torch.bfloat16))
    expert = model.model.layers[1].mlp.experts.gate_up_proj[5]  # stacked from experts.5.{gate,up}_proj
    assert torch.equal(expert, hf.model.layers[1].mlp.experts.gate_up_proj[5].to(torch.bfloat16))


def test_dequantize_blocks_partial_edge_blocks():
    """V3's kv_a_proj_with_mqa has 576 rows: the last 128-row block holds 64."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(576, 300, generator=g) * 3
    q, scale = quantize_blocks(weight, (128, 128))
    assert scale.shape == (5, 3)
    out = dequantize_blocks(q, scale)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), dequantize_reference(q, scale, (128, 128)), rtol=1e-7, atol=0)
    assert (out - weight).abs().max() <= weight.abs().max() / 8  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match=r"weight_scale_inv must be \[5, 3\]"):
        dequantize_blocks(q, scale[:4])


def fuse_experts(tensors):
    """Per-expert tensors -> transformers 5's in-memory 3-D layout (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    prefix = "model.layers.1.mlp.experts"
    count = len([n for n in tensors if n.startswith(prefix) and n.endswith("down_proj.weight")])
    parts = {p: [tensors.pop(f"{prefix}.{e}.{p}.weight") for e in range(count)] for p in ("gate_proj", "up_proj", "down_proj")}
    tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(parts["gate_proj"], parts["up_proj"])])
    tensors[f"{prefix}.down_proj"] = torch.stack(parts["down_proj"])


@torch.no_grad()
def test_fused_expert_tensors_load_too(checkpoints, tmp_path):
    path = checkpoints["v2"][0]
    fused = mla_ops.MLAForCausalLM.from_pretrained(rewrite_checkpoint(path, tmp_path / "fused", fuse_experts)).state_dict()
    reference = mla_ops.MLAForCausalLM.from_pretrained(path).state_dict()
    assert fused.keys() == reference.keys()
    for name, tensor in fused.items():
        assert torch.equal(tensor, reference[name]), name




BAD_CHECKPOINTS = {
    "missing": (lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
                r"missing tensors \(1\): model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"),
    "wrong shape": (lambda t: t.update({"model.layers.0.self_attn.kv_b_proj.weight": torch.zeros(128, 31)}),
                    r"model\.layers\.0\.self_attn\.kv_b_proj\.weight: the checkpoint has \[128, 31\], "
                    r"the model expects \[128, 32\]"),
    "unexpected": (lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(4)}),
                   r"unexpected tensors \(1\): model\.layers\.0\.self_attn\.q_norm\.weight"),
    "fp8 without scale": (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(FP8)}),
                          r"model\.norm\.weight: float8_e4m3fn without its model\.norm\.weight_scale_inv"),
    "missing lm_head": (lambda t: t.pop("lm_head.weight"), r"missing tensors \(1\): lm_head\.weight"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_loading_errors_name_the_tensor(checkpoints, tmp_path, case):
    change, message = BAD_CHECKPOINTS[case]
    path = rewrite_checkpoint(checkpoints["v2"][0], tmp_path / "ckpt", change)
    with pytest.raises(ValueError, match=message):
        mla_ops.MLAForCausalLM.from_pretrained(path)


def test_loading_errors_for_paths(tmp_path):
    with pytest.raises(ValueError, match="checkpoint directory"):
        mla_ops.MLAForCausalLM.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps(make_hf_model("v2").config.to_dict()))
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        mla_ops.MLAForCausalLM.from_pretrained(tmp_path)


def test_generate_rejects_bad_input(checkpoints):
    model = mla_ops.MLAForCausalLM.from_pretrained(checkpoints["v2"][0])
    with pytest.raises(TypeError, match="prompts"):
        mla_ops.generate(model, [], 2)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        mla_ops.generate(model, [[1, 2], [3, 96]], 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        mla_ops.generate(model, [[1, 2]], -1)
    with pytest.raises(ValueError, match="num_blocks=2 is too small"):
        mla_ops.generate(model, [[1] * 9], 4, block_size=4, num_blocks=2)
    with pytest.raises(TypeError, match="MLAForCausalLM"):
        mla_ops.generate(model.model, [[1, 2]], 2)
    assert mla_ops.generate(model, [[1, 2]], 0) == [[]]


def test_cli_generates_from_ids_and_text(checkpoints, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from mla_ops.__main__ import main

    path = shutil.copytree(checkpoints["v2"][0], tmp_path / "ckpt")
    model = mla_ops.MLAForCausalLM.from_pretrained(path)
    expect = mla_ops.generate(model, [[5, 6, 7]], 4)[0]
    main(["generate", "--model", str(path), "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--ignore-eos"])
    out = capsys.readouterr()
    assert out.out.strip() == ",".join(map(str, expect))
    assert "tok/s" in out.err and "4/4 tokens" in out.err

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    main(["generate", "--model", str(path), "--prompt", "w5 w6 w7", "--max-new-tokens", "4", "--ignore-eos"])
    assert capsys.readouterr().out.split() == ["w5", "w6", "w7"] + [f"w{t}" for t in expect]
