"""dots3_note (``dots3_note_text``, and the text model of the multimodal ``dots3_note``) against transformers'
Dots3NoteForCausalLM, on tiny checkpoints written here. Two kinds of layer with two cache geometries in one
model (issue 47 item 3): DSA layers 0, 1 and 5 (i < 2 or i % 4 == 1; N = 4, L = 32, P = 16, R = 8, an indexer of
16 x 16 with interleaved RoPE, ``index_topk`` 8) and sliding-window layers 2-4 (window 6, N = 2, q-LoRA 24, L = 48,
P = 24, R = 8, V = 8, theta 50,000: 56-wide rows beside 40-wide ones); latent scales sqrt(H / q_lora) and
sqrt(H / L), an RMSNorm on k_pe before RoPE, a per-head sigmoid gate, shared experts of their own size. The
prompts of 13 and 21 tokens take the sparse path in the DSA layers and outgrow the window in the sliding ones.
"""

import dataclasses
import json
import os

import pytest
import torch

import mla_ops
from mla_ops.models.config import MLAConfig
from tests.support.dsa_families import check_selection, index_score_gap
from tests.support.families import check_cli, check_generation, check_logits, check_whole_model_compile, \
    prompts_of, spread_weights, step

transformers = pytest.importorskip("transformers")
dots3 = pytest.importorskip("transformers.models.dots3_note")

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=6,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, head_dim=32, n_routed_experts=8, n_shared_experts=1,
             num_experts_per_tok=2, max_position_embeddings=128, index_topk=8, index_n_heads=16, index_head_dim=16,
             shared_experts_intermediate_size=24, sliding_window=6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             # the release's keys of the sliding layers' geometry (transformers writes per_layer_config)
             swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=24, swa_kv_lora_rank=48,
             swa_head_dim=32, swa_qk_nope_head_dim=24, swa_v_head_dim=8)
KINDS = ("full", "full", "sliding", "sliding", "sliding", "full")


# The multimodal wrapper's towers, tiny (their output widths the text model's hidden size).
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=2,
              moe_intermediate_size=8, mlp_layer_types=["dense"], num_local_experts=2, adapter_in_dim=16,
              adapter_out_dim=64)
AUDIO = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, feature_size=16,
             downsample_hidden_size=8, adapter_input_size=16, adapter_out_dim=64)


def make_dots3(seed, **change):
    config = dots3.Dots3NoteTextConfig(**{**SHAPE, **change})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # its grouped_mm takes no float64
    torch.manual_seed(seed)
    return spread_weights(dots3.Dots3NoteForCausalLM(config), seed + 1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_dots3(seed=0)
    path = tmp_path_factory.mktemp("dots3")
    hf.save_pretrained(path)
    return str(path), hf


@pytest.fixture(scope="module")
def model64(checkpoint):
    return mla_ops.MLAForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float64)


def test_config_reads_both_kinds_of_layer(checkpoint):
    config = MLAConfig.from_hf(checkpoint[0])
    assert config.layer_kinds.attention_types == KINDS and config.num_index_layers == 3
    s = config.sliding_attention
    assert (s.sliding_window, s.num_attention_heads, s.q_lora_rank, s.kv_lora_rank, s.qk_nope_head_dim,
            s.qk_rope_head_dim, s.v_head_dim, s.rope_theta) == (6, 2, 24, 48, 24, 8, 8, 50000.0)
    assert (config.rope_theta, config.rms_norm_eps, config.lora_norm_eps, config.shared_expert_intermediate_size) == (
        80_000_000.0, 1e-5, 1e-5, 24)
    assert config.indexer.indexer_rope_interleave and config.k_rope_norm and config.head_gate
    assert config.scalings.lora_latent_scales and config.layer_kinds.mlp_layer_types == ("dense",) + ("sparse",) * 5
    assert config.layer_softmax_scale(2) == 32 ** -0.5 and config.layer_softmax_scale(0) == 24 ** -0.5  # no mscale


def test_the_tiny_preset_is_the_checkpoints_config(checkpoint):
    preset = MLAConfig.from_name("dots3-note-tiny")
    assert preset == dataclasses.replace(MLAConfig.from_hf(checkpoint[0]), dtype=None, initializer_range=0.02,
                                         first_k_dense_replace=0)
    model = mla_ops.MLAForCausalLM(preset)
    with torch.no_grad():
        (logits,) = step(model, model.allocate_kv_caches(4, 4), [[5, 6, 7, 8, 9, 10, 11, 12, 13]], [0], index_topk=8)
    assert logits.shape == (9, 96) and bool(logits.isfinite().all())


def test_caches_hold_each_layer_at_its_own_width(checkpoint):
    model = mla_ops.MLAForCausalLM(MLAConfig.from_hf(checkpoint[0]))
    caches = model.allocate_kv_caches(5, 4)
    assert [t.shape[-1] for t in caches.latent] == [40, 40, 56, 56, 56, 40]  # L + R of each layer's kind
    assert [t.shape for t in caches.index] == [(5, 4, 16)] * 3  # the DSA layers' only
    assert [layer.self_attn.indexer is None for layer in model.model.layers] == [k == "sliding" for k in KINDS]
    with pytest.raises(ValueError, match="kv_caches.latent must be a list of 6"):  # no one stacked tensor of two widths
        step(model, mla_ops.KVCaches(torch.zeros(6, 5, 4, 40), caches.index), [[1, 2, 3]], [0], index_topk=8)
    wrong = mla_ops.KVCaches([t.new_zeros(5, 4, 40) for t in caches.latent], caches.index)
    with pytest.raises(ValueError, match=r"kv_caches.latent\[2\] must be \[num_blocks, block_size, 56\]"):
        step(model, wrong, [[1, 2, 3]], [0], index_topk=8)


def test_the_sliding_layers_plan_their_window_once_per_step(model64, monkeypatch):
    """One ModelStep per kind: the sliding layers' plan has the window (its chunks hold at most 5 rows of a
    request's context) and no indexer; the DSA layers' is the caller's."""
    import mla_ops.models.decoder as decoder

    plans = []
    original = decoder.kind_plans
    monkeypatch.setattr(decoder, "kind_plans", lambda plan, config: plans.append(original(plan, config)) or plans[-1])
    prompts = prompts_of([21, 13], 96, seed=3)
    caches = model64.allocate_kv_caches(16, 4)
    with torch.no_grad():
        step(model64, caches, [p[:17] for p in prompts], [0, 0], index_topk=8)
        step(model64, caches, prompts, [17, 9], index_topk=8, absorb_max_query_len=0, workspace_size=8)
    (full, sliding) = plans[-1][0], plans[-1][1]
    assert (full.sliding_window, full.index_topk, sliding.sliding_window, sliding.index_topk) == (0, 8, 6, 0)
    assert sliding.schedule.num_context_tokens == 5 + 5  # w - 1 rows of each context (17 and 9), not 26
    with pytest.raises(ValueError, match="plan was made with sliding_window=6"):
        step(model64, caches, prompts, [17, 9], index_topk=8, sliding_window=6)


def test_the_test_data_has_no_near_ties(model64):
    prompts = prompts_of([13, 7, 21], 96, seed=1) + prompts_of([10, 9], 96, seed=2)
    assert index_score_gap(model64, prompts) > 1e-4


def test_the_indexer_selects_what_transformers_selects(checkpoint, model64):
    check_selection(model64, checkpoint[1].to(torch.float64), prompts_of([21], 96, seed=1)[0])


def test_logits_match_transformers_with_and_without_a_cached_prefix(checkpoint):
    """Within 3e-6: transformers' Dots3 model rounds its RMSNorms, RoPE tables and attention softmax through
    float32 even in float64 (the next test makes them float64: 1e-7)."""
    path, hf = checkpoint
    print(f"dots3_note: largest logit difference {check_logits(path, hf, rtol=3e-6):.2e} (relative, float64)")


def test_logits_match_transformers_float64_throughout(checkpoint, monkeypatch):
    """transformers' float32 roundings (RMSNorm, RoPE tables, eager softmax) made float64: what is left is its
    float32 router, which both sides share."""
    modeling = dots3.modeling_dots3_note

    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rope(self, x, position_ids, layer_type):
        dim = 2 * getattr(self, f"{layer_type}_inv_freq").shape[0]
        theta = self.config.rope_parameters[layer_type]["rope_theta"]
        freqs = position_ids[..., None].double() / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        weights = (query @ key.transpose(2, 3) * scaling + attention_mask).softmax(-1)
        return (weights @ value).transpose(1, 2).contiguous(), weights

    monkeypatch.setattr(modeling.Dots3NoteRMSNorm, "forward", norm)
    monkeypatch.setattr(modeling.Dots3NoteTextRotaryEmbedding, "forward", rope)
    monkeypatch.setattr(modeling, "eager_attention_forward", attention)
    check_logits(*checkpoint, rtol=1e-7)


def test_greedy_generation_matches_transformers_and_reuses_prefixes(checkpoint):
    check_generation(*checkpoint)


def test_cli_generates(checkpoint, capsys):
    check_cli(checkpoint[0], capsys)


def test_the_whole_model_compiles_with_a_region_per_layer_kind(model64):
    """torch.compile of the whole step, both plans made inside it (the sliding layers' from the caller's): one
    region for the DSA MoE layers (1, 5), one for the sliding ones (2-4); layer 0 (dense MLP) is inlined."""
    check_whole_model_compile(model64, prompts_of([9, 14, 3], model64.config.vocab_size, seed=5), [4, 10, 0],
                              max_regions=2)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """The multimodal model, saved by transformers (text_config nested; the text model's names are the release's,
    model.layers.*, beside vision_encoder.* and audio_encoder.*), and the same checkpoint with the release's
    config.json: the text model's keys at the top level, in the release's own names."""
    config = dots3.Dots3NoteConfig(text_config=dict(SHAPE), vision_config=VISION, audio_config=AUDIO)
    config.text_config._attn_implementation = config._attn_implementation = "eager"
    config.text_config._experts_implementation = "eager"
    torch.manual_seed(3)
    hf = spread_weights(dots3.Dots3NoteForConditionalGeneration(config), 4)
    path = tmp_path_factory.mktemp("dots3_mm")
    hf.save_pretrained(path / "transformers")
    release = path / "release"
    release.mkdir()
    for name in os.listdir(path / "transformers"):
        if name != "config.json":
            os.link(path / "transformers" / name, release / name)
    flat = {"model_type": "dots3_note", "vision_config": VISION, "audio_config": AUDIO, **SHAPE, "use_dsa": True,
            "sliding_window_size": SHAPE["sliding_window"], "swa_rope_theta": 50000.0, "rope_theta": 80_000_000.0,
            "moe_shared_expert_intermediate_size": 24, "first_k_dense_replace": 1, "moe_layer_freq": 1}
    for key in ("sliding_window", "shared_experts_intermediate_size"):
        del flat[key]
    with open(release / "config.json", "w") as f:
        json.dump(flat, f)
    return str(path / "transformers"), str(release), hf


def test_the_multimodal_checkpoint_keeps_the_towers_and_the_release_names(multimodal):
    from safetensors import safe_open

    with safe_open(os.path.join(multimodal[0], "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert any(n.startswith("vision_encoder.") for n in names) and any(n.startswith("audio_encoder.") for n in names)
    assert "model.layers.2.self_attn.g_proj.weight" in names and "lm_head.weight" in names


def test_the_release_config_reads_as_transformers_reads_it(multimodal):
    """The release's top-level keys (swa_*, use_dsa, sliding_window_size, swa_rope_theta, ...) read as
    transformers' Dots3NoteConfig reads them, equal to the config transformers writes."""
    ours = MLAConfig.from_hf(multimodal[1])
    with open(os.path.join(multimodal[1], "config.json")) as f:
        flat = {k: v for k, v in json.load(f).items() if k != "model_type"}
    theirs = dots3.Dots3NoteConfig(**flat).text_config
    assert theirs.layer_types == ["indexed_attention"] * 2 + ["sliding_attention"] * 3 + ["indexed_attention"]
    text = dataclasses.replace(MLAConfig.from_hf(theirs.to_dict()), wrapper="dots3_note")  # their text config alone
    assert ours == text == dataclasses.replace(MLAConfig.from_hf(multimodal[0]), dtype=ours.dtype)
    assert MLAConfig.from_hf(multimodal[0]).wrapper == ours.wrapper == "dots3_note"


@pytest.mark.parametrize("layout", [0, 1], ids=["transformers", "release"])
def test_the_text_model_of_the_multimodal_checkpoint_matches_transformers(multimodal, layout):
    """Loaded by name (the towers left out), its logits equal the multimodal model's on text."""
    print(f"dots3_note ({['transformers', 'release'][layout]} layout): largest logit difference "
          f"{check_logits(multimodal[layout], multimodal[2], rtol=3e-6):.2e}")


def test_the_release_defaults_are_transformers(checkpoint):
    """A release config.json that leaves out the sliding layers' keys takes Dots3NoteTextConfig's defaults (64
    heads, LoRA 1024, P 192, R 64, V 128, window 512, theta 50,000)."""
    flat = {key: value for key, value in SHAPE.items() if not key.startswith("swa_") and key != "sliding_window"}
    s = MLAConfig.from_hf(dict(flat, model_type="dots3_note_text")).sliding_attention
    theirs = dots3.Dots3NoteTextConfig(**flat).per_layer_config[2]
    assert (s.num_attention_heads, s.q_lora_rank, s.kv_lora_rank, s.qk_nope_head_dim, s.qk_rope_head_dim,
            s.v_head_dim, s.sliding_window, s.rope_theta) == (
        theirs.num_attention_heads, theirs.q_lora_rank, theirs.kv_lora_rank, theirs.qk_nope_head_dim,
        theirs.qk_rope_head_dim, theirs.v_head_dim, theirs.sliding_window, 50000.0) == (
        64, 1024, 1024, 192, 64, 128, 512, 50000.0)


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=["indexed_attention"] * 5), "layer_types must list num_hidden_layers=6"),
    (dict(q_lora_rank=None), "q_lora_rank=null"),
    (dict(layer_types=["indexed_attention", "full_attention"] + ["sliding_attention"] * 4), "mixes"),
    (dict(per_layer_config={"0": {"num_attention_heads": 2}}), r"per_layer_config\[0\] changes layer 0"),
    (dict(per_layer_config={str(i): {"num_attention_heads": 2 + (i == 3)} for i in (2, 3, 4)}),
     r"per_layer_config\[3\] differs"),
    (dict(per_layer_config={str(i): {"sliding_window": 4} for i in (2, 3, 4)}), r"sets \['sliding_window'\]"),
    (dict(rope_parameters={"indexed_attention": {"rope_type": "yarn", "factor": 2.0},
                           "sliding_attention": {"rope_type": "default"}}), "must be 'default'"),
])
def test_config_errors_name_the_key(checkpoint, change, match):
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        config = json.load(f)
    with pytest.raises(ValueError, match=match):
        MLAConfig.from_hf(dict(config, **change))


def test_compiled_generation_equals_eager(checkpoint):
    """Generator(compile=True): each bucket's step (both kinds' device plans made inside) compiled, the greedy
    tokens those of eager steps."""
    model = mla_ops.MLAForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float32)
    prompts = prompts_of([13, 5, 21], 96, seed=8)
    expect = mla_ops.Generator(model, block_size=4).generate(prompts, 4)
    torch._dynamo.reset()
    assert mla_ops.Generator(model, block_size=4, compile=True).generate(prompts, 4) == expect
