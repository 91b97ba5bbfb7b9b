"""LongCat-Flash (model type ``longcat_flash``) end to end, against transformers' LongcatFlashForCausalLM.

The tiny checkpoint is written here by transformers' own save_pretrained, in float64: two layers (four
attentions, four latent caches), 6 routed and 3 identity experts with top-3 routing, q_lora_rank and
kv_lora_rank below hidden_size so both LoRA scalings (sqrt(2) and 2) matter, weights ~1/sqrt(fan_in) so
attention and routing are far from ties, and a correction bias that sends about half of the picks
to identity experts. transformers is made a float64 reference (its RMSNorm, rotary and attention softmax
run in float32; the router stays float32 on both sides) and runs its experts' eager loop (5.25's default
grouped GEMM takes no float64): the logits agree to ~1e-14.
"""

import json
import os
import types

import pytest
import torch

import mla_ops
from mla_ops.models.config import MLAConfig

transformers = pytest.importorskip("transformers")
from tests.support.families import (  # noqa: E402
    check_generation, check_whole_model_compile, prompts_of, relative_diff, rewrite_checkpoint, step)

ROUTED, IDENTITY = 6, 3
HF_CONFIG = dict(
    vocab_size=96, hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=96, q_lora_rank=32,
    kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=16, moe_topk=3,
    n_routed_experts=ROUTED, zero_expert_num=IDENTITY, expert_ffn_hidden_size=32, routed_scaling_factor=2.0,
    max_position_embeddings=128, rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)


def _rms_norm_in_input_dtype(self, x):
    """transformers' LongcatFlashRMSNorm computes in float32, a downcast for float64 that alone moves the
    logits by ~2e-6 (relative); the same formula in x's dtype makes it a float64 reference."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _attention_in_input_dtype(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention takes its softmax in float32 (~5e-7 of the logits past position 0; the
    weights that 5.25 draws made it 8e-6 at one token, past the tolerance): the same attention with the
    softmax in the inputs' dtype, registered as ``float64_eager``, makes it a float64 reference."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    return torch.matmul(scores.softmax(dim=-1), value).transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register("float64_eager", _attention_in_input_dtype)
transformers.masking_utils.AttentionMaskInterface.register("float64_eager", transformers.masking_utils.eager_mask)


def _rotary_in_float64(self, x, position_ids):
    """transformers' LongcatFlashRotaryEmbedding takes its frequencies, angles, cos and sin in float32; in
    float64 (from a float64 inverse frequency) it is a float64 reference."""
    dim = self.inv_freq.shape[0] * 2
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    freqs = position_ids[..., None].double() / self.config.rope_parameters["rope_theta"] ** exponents
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


@torch.no_grad()
def make_hf_longcat(seed: int = 0):
    """A float64 transformers LongCat-Flash model with weights at ~1/sqrt(fan_in) (RMSNorm in float64)."""
    config = transformers.LongcatFlashConfig(**HF_CONFIG)
    config._attn_implementation = "float64_eager"
    config._experts_implementation = "eager"  # 5.25's default grouped_mm takes no float64
    torch.manual_seed(seed)
    model = transformers.LongcatFlashForCausalLM(config).double().eval()
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * p.shape[-1] ** -0.5 * 1.5)
        else:
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn(b.shape, generator=g, dtype=torch.float64))
            b[ROUTED:] += 0.02  # identity experts: picked often, not always
    for module in model.modules():
        if isinstance(module, transformers.models.longcat_flash.modeling_longcat_flash.LongcatFlashRMSNorm):
            module.forward = types.MethodType(_rms_norm_in_input_dtype, module)
    model.model.rotary_emb.forward = types.MethodType(_rotary_in_float64, model.model.rotary_emb)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory written by save_pretrained, the transformers model it holds)."""
    hf = make_hf_longcat()
    path = tmp_path_factory.mktemp("longcat")
    hf.save_pretrained(path)
    return str(path), hf


def routed_indices(model, run):
    """The top-k expert indices of every MoE call made by ``run()``, concatenated."""
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: seen.append(out[1]))
             for layer in model.model.layers]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(seen)


def test_config_forms_released_and_transformers_agree(checkpoint):
    path, _ = checkpoint
    with open(os.path.join(path, "config.json")) as f:
        written = json.load(f)
    assert "num_hidden_layers" not in written and written["num_layers"] == 2  # transformers' key names
    config = MLAConfig.from_hf(path)
    assert (config.decoder_layer, config.num_hidden_layers, config.intermediate_size, config.moe_intermediate_size,
            config.num_experts_per_tok, config.n_routed_experts,
            config.zero_expert_num) == ("longcat", 2, 96, 32, 3, 6, 3)
    assert (config.scoring_func, config.topk_method, config.n_group, config.norm_topk_prob,
            config.routed_scaling_factor) == ("softmax", "noaux_tc", 1, False, 2.0)
    assert config.scalings.mla_scale_q_lora and config.scalings.mla_scale_kv_lora and config.rope_interleave
    # The release's form: rope_theta apart, torch_dtype, its own flags.
    released = {k: v for k, v in written.items() if k not in ("rope_parameters", "dtype", "head_dim", "qk_head_dim")}
    released.update(rope_theta=10000.0, torch_dtype="float64", mla_scale_q_lora=True, mla_scale_kv_lora=True,
                    zero_expert_type="identity", router_bias=False, attention_method="MLA")
    assert MLAConfig.from_hf(released) == config
    model = mla_ops.MLAForCausalLM(config)
    assert torch.stack(model.allocate_kv_caches(5, 4).latent).shape == (4, 5, 4, 16 + 8)  # two attentions per layer


@pytest.mark.parametrize("change, error, message", [
    (dict(ffn_hidden_size=None), ValueError, "lacks 'ffn_hidden_size'"),
    (dict(num_layers=None), ValueError, "lacks 'num_layers'"),
    (dict(moe_topk=None), ValueError, "lacks 'moe_topk'"),
    (dict(router_bias=True), ValueError, "router_bias"),
    (dict(zero_expert_type="copy"), ValueError, "zero_expert_type"),
    (dict(head_dim=16), ValueError, r"head_dim must equal qk_rope_head_dim \(8\)"),
    (dict(qk_head_dim=20), ValueError, r"qk_head_dim must equal qk_nope_head_dim \+ qk_rope_head_dim \(24\)"),
    (dict(n_routed_experts=0), ValueError, "n_routed_experts must be set"),
    (dict(q_lora_rank=None), ValueError, "q_lora_rank must be set"),
    (dict(moe_topk=10), ValueError, r"n_routed_experts \+ zero_expert_num=9"),
    (dict(mla_scale_q_lora="yes"), TypeError, "mla_scale_q_lora"),
    (dict(model_type="longcat_flash_v2"), ValueError, "model_type 'longcat_flash_v2'"),
])
def test_config_errors_name_the_key(checkpoint, change, error, message):
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        written = json.load(f)
    with pytest.raises(error, match=message):
        MLAConfig.from_hf({**written, **change})


def test_longcat_fields_need_the_longcat_layer():
    tiny = mla_ops.models.config.mla_configs["tiny"]
    with pytest.raises(ValueError, match="mla_scale_kv_lora=True scales LongCat-Flash's attention"):
        MLAConfig(**tiny, scalings=dict(mla_scale_kv_lora=True))
    with pytest.raises(ValueError, match="decoder_layer must be one of"):
        MLAConfig(**tiny, decoder_layer="qwen")
    with pytest.raises(ValueError, match="identity experts need routed experts and n_group 1"):
        MLAConfig(**tiny, n_routed_experts=8, moe_intermediate_size=8, num_experts_per_tok=2, zero_expert_num=2,
                  topk_method="noaux_tc", n_group=2, topk_group=1)


@torch.no_grad()
def test_logits_match_transformers_with_and_without_a_cached_prefix(checkpoint):
    path, hf = checkpoint
    model = mla_ops.MLAForCausalLM.from_pretrained(path, dtype=torch.float64)
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32  # the router stays float32
    prompts = prompts_of([13, 7, 21], model.config.vocab_size, seed=1)
    expect = [hf(torch.tensor([p])).logits[0] for p in prompts]  # each whole sequence, no cache
    caches = model.allocate_kv_caches(3 * 8, 4)
    worst = 0.0

    def check(got, ref):
        nonlocal worst
        worst = max(worst, relative_diff(got, ref))
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())

    indices = routed_indices(model, lambda: [check(g, r) for g, r in zip(step(model, caches, prompts, [0, 0, 0]),
                                                                         expect)])
    identity = (indices >= ROUTED).float().mean().item()
    assert 0.25 < identity < 0.7, identity  # identity experts are picked, and so are routed ones
    cached = [8, 0, 17]  # request 1 has no context
    step(model, caches, [p[:c] for p, c in zip(prompts, cached)], [0, 0, 0])
    for options in ({}, {"absorb_max_query_len": 0, "workspace_size": 8}):  # absorbed; chunked MHA, 2+ chunks
        for got, ref, c in zip(step(model, caches, prompts, cached, **options), expect, cached):
            check(got, ref[c:])
    print(f"longcat float64: max |logit diff| / max |logit| = {worst:.2e}")

    # Every one of the four caches holds its own latent rows: the second attention of a layer is not the first.
    latent = caches.latent
    assert not torch.equal(latent[0], latent[1]) and not torch.equal(latent[2], latent[3])


@torch.no_grad()
def test_regionally_compiled_layers_equal_eager(checkpoint):
    path, _ = checkpoint
    model = mla_ops.MLAForCausalLM.from_pretrained(path, dtype=torch.float64)
    prompts = prompts_of([9, 1, 5], model.config.vocab_size, seed=3)
    eager = step(model, model.allocate_kv_caches(3 * 8, 4), prompts, [0, 0, 0])
    model.compile_layers(backend="eager")
    projections, mlps = model.model.compiled_regions
    compiled = step(model, model.allocate_kv_caches(3 * 8, 4), prompts, [0, 0, 0])
    assert len(projections.compiled) == 1 and len(mlps.compiled) == 2  # the attentions; the MLPs and the MoE
    for got, ref in zip(compiled, eager):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_greedy_generation_matches_transformers_and_reuses_prefixes(checkpoint):
    check_generation(*checkpoint, dtype=torch.float64)


def test_cli_generates(checkpoint, capsys):
    from mla_ops.__main__ import main

    path = checkpoint[0]
    expect = mla_ops.generate(mla_ops.MLAForCausalLM.from_pretrained(path), [[5, 6, 7]], 4)[0]
    main(["generate", "--model", path, "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--ignore-eos"])
    assert capsys.readouterr().out.strip() == ",".join(map(str, expect))


@torch.no_grad()
def test_release_and_524_layouts_load_and_identity_junk_is_not_read(checkpoint, tmp_path):
    """The release lacks the identity experts' gate/up tensors (as transformers 5.25 writes) and has
    Multi-Token-Prediction weights under model.mtp; transformers 5.24 wrote gate/up tensors for the identity
    experts too, whose junk changes nothing."""
    path = checkpoint[0]
    reference = mla_ops.MLAForCausalLM.from_pretrained(path).state_dict()

    def release(tensors):
        for name in [n for n in tensors if any(f".experts.{e}." in n for e in range(ROUTED, ROUTED + IDENTITY))]:
            tensors.pop(name)
        tensors["model.mtp.layers.0.eh_proj.weight"] = torch.ones(64, 128)

    def written_by_524(tensors):
        for layer in range(2):
            for e in range(ROUTED, ROUTED + IDENTITY):
                for part in ("gate_proj", "up_proj"):
                    tensors[f"model.layers.{layer}.mlp.experts.{e}.{part}.weight"] = torch.full((32, 64), float("nan"))

    for change in (release, written_by_524):
        changed = rewrite_checkpoint(path, tmp_path / change.__name__, change)
        loaded = mla_ops.MLAForCausalLM.from_pretrained(changed).state_dict()
        assert loaded.keys() == reference.keys()
        assert all(torch.equal(loaded[k], reference[k]) for k in reference)
    with pytest.raises(ValueError, match=rf"unexpected tensors \(1\): model\.layers\.0\.mlp\.experts\.{ROUTED}\."
                                         r"down_proj\.weight"):
        mla_ops.MLAForCausalLM.from_pretrained(rewrite_checkpoint(path, tmp_path / "down", lambda t: t.update(
            {f"model.layers.0.mlp.experts.{ROUTED}.down_proj.weight": torch.zeros(64, 32)})))
    with pytest.raises(ValueError, match=r"missing tensors \(1\): model\.layers\.0\.mlp\.gate\.weight"):
        mla_ops.MLAForCausalLM.from_pretrained(rewrite_checkpoint(path, tmp_path / "router", lambda t: t.pop(
            "model.layers.0.mlp.router.classifier.weight")))


def test_context_parallel_is_refused(checkpoint):
    config = MLAConfig.from_hf(checkpoint[0])
    with pytest.raises(ValueError, match="context_parallel: only DeepSeek.s layers"):  # before any group is read
        mla_ops.MLAForCausalLM(config, context_parallel=mla_ops.ContextParallel())


def test_the_whole_model_compiles_with_a_region_per_part(checkpoint):
    """torch.compile of the whole step: each of a layer's three parts (split at its two cache writes) is one
    region, whatever the layer; the caches per layer (each layer is handed its two)."""
    model = mla_ops.MLAForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float64)
    check_whole_model_compile(model, prompts_of([9, 14, 3], model.config.vocab_size, seed=5), [4, 10, 0],
                              max_regions=3)
