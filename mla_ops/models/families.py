"""The MLA families (DESIGN §11): one ``Family`` record per model type mla_ops reads, in one registry,
``FAMILIES``. A record says what its config.json means beyond the keys DeepSeek-V2/V3 share (``hf_config``
reads those); ``Family()`` is DeepSeek's reading. Adding a family: docs/models.md, "Adding a family".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from .. import _checks
from . import axk2, dots3_note, hy_v4, mistral4, mistral_large4


@dataclass(frozen=True)
class Gate:
    """The router's ``MLAConfig`` values where config.json leaves them out."""

    scoring_func: str
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float


V2_GATE = Gate("softmax", "greedy", False, 1.0)
V3_GATE = Gate("sigmoid", "noaux_tc", True, 2.5)  # transformers 5 writes no scoring_func / topk_method for V3
MISTRAL4_GATE = Gate("softmax", "group_top2", True, 1.0)  # groups ranked by their top-2 sum, no bias


@dataclass(frozen=True)
class Wrapper:
    """Where a multimodal wrapper's text model is; every other tensor (vision tower, projector) is left out."""

    text_config: str  # the config.json key holding the text model's config
    text_model_type: str  # the text config's model_type when it names none
    names: tuple[tuple[str, str], ...]  # checkpoint name prefix -> the decoder's, the first that matches
    tie_word_embeddings: bool  # the wrapper's default for its top-level key
    # name -> the decoder's name or None (skipped), where the names differ past their prefixes; replaces names
    rename: Optional[Callable[[str], Optional[str]]] = None
    # Without ``text_config`` the text model's keys are the top level's (dots3_note's release), these left out
    top_level_text: Optional[tuple[str, ...]] = None


def shared_keys(c: dict) -> dict:
    """``MLAConfig`` values from the keys some families share, whatever the model type: ``mlp_layer_types``
    (GLM-4.7-Flash: "dense" / "sparse" per layer), MiniCPM3's ``scale_emb`` (-> ``embedding_scale``),
    ``scale_depth`` (-> ``residual_scale = scale_depth / sqrt(num_hidden_layers)``) and ``dim_model_base``
    (-> ``logits_scaling = hidden_size / dim_model_base``). A ``partial_rotary_factor`` other than 1 is refused:
    these models rotate all R (``hf_config`` has read the sizes by now)."""
    for where, scaling in (("", c), ("rope_parameters.", c.get("rope_parameters")),
                           ("rope_scaling.", c.get("rope_scaling"))):
        factor = scaling.get("partial_rotary_factor") if isinstance(scaling, dict) else None
        if factor is not None and _checks.check_real(factor, f"{where}partial_rotary_factor") != 1:
            raise ValueError(f"config.json sets {where}partial_rotary_factor={factor}: only 1 (RoPE over all "
                             "qk_rope_head_dim) is supported")
    out = {}
    if c.get("mlp_layer_types") is not None:
        out["mlp_layer_types"] = c["mlp_layer_types"]
    if c.get("scale_emb") is not None:
        out["embedding_scale"] = _checks.check_real(c["scale_emb"], "scale_emb")
    if c.get("scale_depth") is not None:
        layers = _checks.check_int(c["num_hidden_layers"], "num_hidden_layers", 1)
        out["residual_scale"] = _checks.check_real(c["scale_depth"], "scale_depth") / math.sqrt(layers)
    if c.get("dim_model_base") is not None:
        hidden = _checks.check_int(c["hidden_size"], "hidden_size", 1)
        out["logits_scaling"] = hidden / _checks.check_real(c["dim_model_base"], "dim_model_base")
    return out


def dsa_keys(c: dict, indexer_interleaved: bool) -> dict:
    """DeepSeek Sparse Attention's keys: ``index_topk``, ``index_n_heads``, ``index_head_dim``,
    ``indexer_types``; ``layer_types``, if given, must say "indexed_attention" for every layer."""
    model_type = c["model_type"]
    layer_types = c.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or any(kind != "indexed_attention" for kind in layer_types):
            raise ValueError(f"layer_types must list 'indexed_attention' for every layer (a {model_type} model's "
                             f"attention), got {layer_types!r}")
    if c.get("index_topk") is None:
        raise ValueError(f"config.json sets index_topk=null: a {model_type} model's indexer selects index_topk keys")
    return dict(index_topk=c.get("index_topk"), index_n_heads=c.get("index_n_heads"),
                index_head_dim=c.get("index_head_dim"), indexer_rope_interleave=indexer_interleaved,
                indexer_types=c.get("indexer_types"))


@dataclass(frozen=True)
class Family:
    """What one model type's config.json means beyond DeepSeek-V2/V3's keys; ``Family()`` is DeepSeek's reading."""

    # With experts: the router's values config.json leaves out (None: the file must name its scoring_func and
    # topk_method, the rest as V2's).
    gate: Optional[Gate] = None
    # config.json -> a copy: keys renamed (releases written for remote code), refusals, defaults derived from others
    prepare: Optional[Callable[[dict], dict]] = None
    # Its transformers config's defaults for keys absent after prepare (an explicit null stays null, as there)
    defaults: dict = field(default_factory=dict)
    # Readers of the keys only some families have: config.json -> MLAConfig keyword arguments
    keys: tuple[Callable[[dict], dict], ...] = (shared_keys,)
    # DeepSeek Sparse Attention (dsa_keys): the indexer's RoPE rows are interleaved pairs (GLM-5) or halves
    # (V3.2); None: dense MLA
    indexer_interleaved: Optional[bool] = None
    fixed: dict = field(default_factory=dict)  # MLAConfig values the model type implies whatever the file says
    wrapper: Optional[Wrapper] = None  # a multimodal wrapper's: where its text model is (models.wrappers)

    def read(self, c: dict) -> dict:
        """config.json's dict as this model type's transformers config reads it."""
        return {**self.defaults, **(c if self.prepare is None else self.prepare(c))}

    def kwargs(self, c: dict) -> dict:
        """``MLAConfig`` keyword arguments from the keys only some families have (``c``: ``read``'s)."""
        out = {}
        for reader in self.keys:
            out.update(reader(c))
        if self.indexer_interleaved is not None:
            out.update(dsa_keys(c, self.indexer_interleaved))
        return out


UNNAMED = Family()  # a config.json that names no model type: DeepSeek's keys, a gate it must name


def _size(c: dict, key: str) -> int | None:
    """A size a default derives from; None where it is absent or bad (MLAConfig then names the key)."""
    value = c.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _glm4_moe_lite(c: dict) -> dict:
    # transformers' Glm4MoeLiteConfig: the first layer dense, the rest sparse. It has no
    # first_k_dense_replace (a release's is ignored), so neither does the default here.
    layers = _size(c, "num_hidden_layers")
    return {"mlp_layer_types": layers and ["dense"] + ["sparse"] * (layers - 1), **c}


def _minicpm3(c: dict) -> dict:
    hidden, heads = _size(c, "hidden_size"), _size(c, "num_attention_heads")
    return {"v_head_dim": hidden and heads and hidden // heads, **c}  # the release has no v_head_dim


def _sarvam_mla(c: dict) -> dict:
    c = dict(c)
    # Sarvam's release config (written for its remote code) names two keys its own way.
    for old, new in (("num_experts", "n_routed_experts"), ("num_shared_experts", "n_shared_experts")):
        if old in c:
            if c.get(new) is not None and c[new] != c[old]:
                raise ValueError(f"config.json has {old}={c[old]!r} and {new}={c[new]!r}: they name the same value")
            c[new] = c.pop(old)
    scaling = c.get("rope_scaling")  # its YaRN is "deepseek_yarn" (SarvamMLAConfig reads it as "yarn")
    if isinstance(scaling, dict) and "deepseek_yarn" in (scaling.get("type"), scaling.get("rope_type")):
        c["rope_scaling"] = {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "yarn"}
    return c


def _axk1(c: dict) -> dict:
    # AXK1's attention always has q_a_proj / q_b_proj: q_lora_rank an int, null refused.
    if "q_lora_rank" in c and c["q_lora_rank"] is None:
        raise ValueError("config.json sets q_lora_rank=null: A.X-K1's attention always has a q_lora_rank "
                         "(q_a_proj / q_b_proj)")
    return c


# LongCat-Flash's names of four keys (LongcatFlashConfig's attribute_map) -> DeepSeek's.
_LONGCAT_KEYS = {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size",
                 "expert_ffn_hidden_size": "moe_intermediate_size", "moe_topk": "num_experts_per_tok"}


def _longcat_flash(c: dict) -> dict:
    c = dict(c)
    for old, new in _LONGCAT_KEYS.items():
        if c.get(old) is None:  # LongCat's own key named, not the DeepSeek key it becomes
            raise ValueError(f"config.json lacks {old!r}, which a LongCat-Flash model needs")
        c[new] = c.pop(old)
    return c


def _longcat_flash_keys(c: dict) -> dict:
    """LongCat-Flash's layer structure and its keys, after those its layers do not read are checked."""
    if _checks.check_bool(c.get("router_bias") or False, "router_bias"):
        raise ValueError("config.json sets router_bias=true: transformers' LongCat-Flash router ignores the bias "
                         "and no release has one; it is not supported")
    kind = _checks.check_str(c.get("zero_expert_type") or "identity", "zero_expert_type")
    if kind != "identity":
        raise ValueError(f"zero_expert_type must be 'identity' (the only zero-computation expert), got {kind!r}")
    rope = _checks.check_int(c.get("qk_rope_head_dim"), "qk_rope_head_dim", 1)
    nope = _checks.check_int(c.get("qk_nope_head_dim"), "qk_nope_head_dim", 1)
    for key, expect, meaning in (("head_dim", rope, "qk_rope_head_dim"),  # transformers' rotary dim
                                 ("qk_head_dim", nope + rope, "qk_nope_head_dim + qk_rope_head_dim")):
        if c.get(key) is not None and c[key] != expect:
            raise ValueError(f"{key} must equal {meaning} ({expect}), got {c[key]!r}")
    # The release's mla_scale_* flags (transformers applies both scalings always).
    scales = {name: True if c.get(name) is None else c[name] for name in ("mla_scale_q_lora", "mla_scale_kv_lora")}
    return dict(decoder_layer="longcat", zero_expert_num=c["zero_expert_num"], **scales)


def _glm_indexer_types(c: dict) -> dict:  # GLM-5's and Mistral Large 4's shared layers
    return {**c, "indexer_types": _indexer_types(c)}


def _indexer_types(c: dict):
    """GlmMoeDsaConfig.__post_init__'s ``indexer_types``: given, else from ``index_topk_pattern`` ("FSS...")
    or the ``index_topk_freq`` / ``index_skip_topk_offset`` schedule (defaults 1 and 2: every layer full)."""
    if c.get("indexer_types") is not None:
        return c["indexer_types"]
    pattern = c.get("index_topk_pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            return pattern  # a list: MLAConfig checks its entries
        kinds = {"F": "full", "S": "shared"}
        if set(pattern) - set(kinds):
            raise ValueError(f"index_topk_pattern must be a string of 'F' (full) and 'S' (shared), got {pattern!r}")
        return [kinds[ch] for ch in pattern]
    layers = _size(c, "num_hidden_layers")
    if layers is None:
        return None  # MLAConfig names num_hidden_layers
    freq = _checks.check_int(c.get("index_topk_freq", 1), "index_topk_freq", 0)
    offset = _checks.check_int(c.get("index_skip_topk_offset", 2), "index_skip_topk_offset")
    freq = max(freq, 1)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


# DeepseekV32Config: V3's gate groups, 3 dense layers, its indexer's sizes; its attention always interleaves
# the main RoPE rows (the config has no rope_interleave), its indexer rotates halves.
_V32_DEFAULTS = {"n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "index_topk": 2048, "index_n_heads": 64,
                 "index_head_dim": 128}

# HYV4Config's defaults where hf_config's differ.
_HY_V4_DEFAULTS = {"n_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5, "q_lora_rank": 1536, "initializer_range": 0.006,
                   "max_position_embeddings": 262144, "index_topk": 2048, "index_n_heads": 16, "index_head_dim": 128}

FAMILIES = {
    "deepseek_v2": Family(gate=V2_GATE),
    "deepseek_v3": Family(gate=V3_GATE),
    "kimi_k2": Family(gate=V3_GATE),  # Kimi K2's remote-code name for DeepSeek-V3, as transformers reads it
    "deepseek_v32": Family(gate=V3_GATE, defaults=_V32_DEFAULTS, indexer_interleaved=False,
                           fixed=dict(rope_interleave=True)),
    # GLM-5: V3.2's layers in one gate group, eps 1e-5, 32 indexer heads, its indexer's RoPE rows interleaved
    "glm_moe_dsa": Family(gate=V3_GATE, prepare=_glm_indexer_types, indexer_interleaved=True,
                          defaults={**_V32_DEFAULTS, "n_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5,
                                    "index_n_heads": 32},
                          fixed=dict(rope_interleave=True)),
    "glm4_moe_lite": Family(gate=Gate("sigmoid", "noaux_tc", True, 1.8), prepare=_glm4_moe_lite,
                            defaults={"rms_norm_eps": 1e-5}),
    # MiniCPM3: transformers always rotates halves, whatever the file says
    "minicpm3": Family(prepare=_minicpm3, fixed=dict(rope_interleave=False),
                       defaults={"rms_norm_eps": 1e-5, "tie_word_embeddings": True, "q_lora_rank": 768,
                                 "scale_emb": 12, "scale_depth": 1.4, "dim_model_base": 256}),
    "youtu": Family(defaults={"tie_word_embeddings": True}),
    "sarvam_mla": Family(gate=V3_GATE, prepare=_sarvam_mla,
                         defaults={"first_k_dense_replace": 1, "n_shared_experts": 1}),
    # LongcatFlashConfig's defaults (its num_hidden_layers is 2 * num_layers attentions, ours num_layers). Gate:
    # softmax over routed + identity experts, top-k of the bias-corrected scores (one group), weights the
    # uncorrected scores times the factor (LongcatFlashTopkRouter).
    "longcat_flash": Family(gate=Gate("softmax", "noaux_tc", False, 6.0), prepare=_longcat_flash,
                            defaults={"rms_norm_eps": 1e-5, "rope_theta": 1e7, "max_position_embeddings": 131072,
                                      "zero_expert_num": 256},
                            keys=(_longcat_flash_keys,)),
    # AXK1Config: without mlp_layer_types, layers from first_k_dense_replace (default 1) on are sparse; an RMSNorm
    # on the MoE output, and releases without e_score_correction_bias.
    "axk1": Family(gate=V3_GATE, prepare=_axk1,
                   defaults={"q_lora_rank": 1536, "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 8,
                             "topk_group": 4, "max_position_embeddings": 32768},
                   fixed=dict(post_mlp_layernorm=True, optional_correction_bias=True)),
    # Mistral 4's partial_rotary_factor is over the whole q/k head, and its query scale its own.
    "mistral4": Family(gate=MISTRAL4_GATE, keys=(mistral4.config_kwargs,)),
    # Mistral Large 4's text model: its defaults (mla_ops.models.mistral_large4), GLM-5's indexer_types schedule;
    # Mistral 4's gate in float32, whose MistralLarge4TopkRouter always normalizes its top-k weights (config.json's
    # norm_topk_prob is read by nothing); GLM-5's indexer with keys of its own.
    "mistral_large4_text": Family(gate=MISTRAL4_GATE, fixed=dict(norm_topk_prob=True),
                                  prepare=lambda c: _glm_indexer_types(mistral_large4.defaults(c)),
                                  keys=(shared_keys, mistral_large4.config_kwargs), indexer_interleaved=True),
    # A.X-K2 (mla_ops.models.axk2): V3.2's sparse layers, a query fused with an output gate, gated norms; AXK2Config's
    # defaults (its router over no groups when n_group is null, dropped groups' experts scored 0)
    "axk2": Family(gate=Gate("sigmoid", "noaux_tc_zero", True, 2.5), prepare=axk2.prepare, indexer_interleaved=False,
                   defaults={"q_lora_rank": 384, "first_k_dense_replace": 1, "n_shared_experts": 1,
                             "max_position_embeddings": 131072, "index_topk": 2048, "index_n_heads": 16,
                             "index_head_dim": 128},
                   keys=(shared_keys, axk2.config_kwargs), fixed=dict(rope_interleave=True, output_gate="query")),
    # HY-V4 (mla_ops.models.hy_v4): GLM-5's sparse layers with an output gate, sinks, hyper-connections, clamped
    # SwiGLU experts; HYV4Config's defaults (one gate group, its scaling factor, 16 indexer heads) and per-layer
    # kinds; the multimodal model's text config (32 indexer heads, latent norms at rms_norm_eps).
    "hy_v4": Family(gate=Gate("sigmoid", "noaux_tc", True, 2.827), prepare=hy_v4.defaults, indexer_interleaved=True,
                    defaults=_HY_V4_DEFAULTS, keys=(shared_keys, hy_v4.config_kwargs), fixed=hy_v4.FIXED),
    "hy_v4_vl_text": Family(gate=Gate("sigmoid", "noaux_tc", True, 2.827), prepare=hy_v4.defaults,
                            indexer_interleaved=True,
                            defaults={**_HY_V4_DEFAULTS, "q_lora_rank": 2048, "index_n_heads": 32},
                            keys=(shared_keys, hy_v4.vl_text_config_kwargs), fixed=hy_v4.FIXED),
    # HY-V4-VL: a vision tower (vit.*, skipped) around a hy_v4_vl_text model written at model.* and lm_head.*
    "hy_v4_vl": Family(wrapper=Wrapper(
        text_config="text_config", text_model_type="hy_v4_vl_text", names=(), tie_word_embeddings=False,
        rename=hy_v4.vl_text_name,
    )),
    # Hub release: language_model.model.layers.{i}; transformers' save_pretrained reverts its "blocks" ->
    # "layers" rename (meant for the vision tower's blocks) on every name, so it writes ...model.blocks.{i}.
    "kimi_k25": Family(wrapper=Wrapper(
        text_config="text_config", text_model_type="deepseek_v3",
        names=(("language_model.model.layers.", "model.layers."), ("language_model.model.blocks.", "model.layers."),
               ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
        tie_word_embeddings=True,
    )),
    # Mistral Small 4: Mistral3ForConditionalGeneration around a mistral4 text model (a Pixtral vision tower);
    # save_pretrained reverts llava's renames, writing language_model.model.* and language_model.lm_head.*.
    # A text config naming no model type is Mistral3Config's default, a plain Mistral (no MLA): refused by name.
    "mistral3": Family(wrapper=Wrapper(
        text_config="text_config", text_model_type="mistral",
        names=(("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
        tie_word_embeddings=True,
    )),
    # dots3_note's text model (transformers' Dots3NoteTextConfig): DSA layers (GLM-5's interleaved indexer) and
    # sliding-window layers of a second geometry (mla_ops.models.dots3_note reads both), V3's gate without a
    # scaling factor, latent scales, an RMSNorm on k_pe, a per-head output gate; its LoRA norms take rms_norm_eps.
    "dots3_note_text": Family(gate=Gate("sigmoid", "noaux_tc", True, 1.0), prepare=dots3_note.prepare,
                              keys=(shared_keys, dots3_note.config_kwargs),
                              fixed=dict(rope_interleave=True, k_rope_norm=True, head_gate=True,
                                         lora_latent_scales=True)),
    # dots3_note: vision and audio towers around a dots3_note_text model. transformers' save_pretrained writes
    # model.language_model.*; the release keeps the text model's names (model.layers.*) and its keys at the top
    # level; the towers (vision_encoder / audio_encoder / model.vision_tower / ...) and the MTP layers are left out.
    "dots3_note": Family(wrapper=Wrapper(
        text_config="text_config", text_model_type="dots3_note_text",
        names=(("model.language_model.", "model."), ("model.layers.", "model.layers."),
               ("model.embed_tokens.", "model.embed_tokens."), ("model.norm.", "model.norm."),
               ("lm_head.", "lm_head.")),
        tie_word_embeddings=False,
        top_level_text=("model_type", "architectures", "vision_config", "audio_config", "image_token_id",
                        "video_token_id", "audio_token_id"),
    )),
    # Mistral Large 4: a Pixtral vision tower around a mistral_large4_text model; the release and transformers'
    # save_pretrained both write Mistral's native names (tok_embeddings, layers.{i}.attention.wq, ...).
    "mistral_large4": Family(wrapper=Wrapper(
        text_config="text_config", text_model_type="mistral_large4_text", names=(), tie_word_embeddings=False,
        rename=mistral_large4.native_name,
    )),
}
