"""What config.json says for the MLA families past DeepSeek-V2/V3 (DESIGN §11), in two parts:

* ``family_defaults``: what a model type's transformers config fills in where its file is silent (an absent
  key; an explicit null stays null, as transformers reads it), and the renamed keys of releases written
  for remote code: one entry of ``FAMILIES`` per model type;
* ``family_kwargs``: the keys that only some families have, read into ``MLAConfig`` fields, whatever the
  model type: ``mlp_layer_types`` (GLM-4.7-Flash: "dense" / "sparse" per layer), MiniCPM3's ``scale_emb``
  (-> ``embedding_scale``), ``scale_depth`` (-> ``residual_scale = scale_depth / sqrt(num_hidden_layers)``;
  null: none) and ``dim_model_base`` (-> ``logits_scaling = hidden_size / dim_model_base``; null: none).
  A ``partial_rotary_factor`` other than 1 is refused, naming the key (every MLA model here rotates all R),
  but by a family that reads its own keys: ``FAMILY_KEYS`` (Mistral 4's factor is over the whole q/k head,
  and its query scale is its own; ``mla_ops.models.mistral4``; LongCat-Flash's layer structure, identity
  experts and LoRA scalings: ``_longcat_flash_kwargs``). What a model type implies that no key says (A.X-K1's
  MoE output norm and its optional correction bias) is ``FAMILY_FIXED``.
* DeepSeek Sparse Attention's keys (``SPARSE_TYPES``: ``deepseek_v32``, ``glm_moe_dsa``): ``index_topk``,
  ``index_n_heads``, ``index_head_dim``, GLM-5's ``indexer_types`` (or the ``index_topk_pattern`` /
  ``index_topk_freq`` / ``index_skip_topk_offset`` it is derived from, as GlmMoeDsaConfig does) and the
  indexer's RoPE layout the model type implies (V3.2: halves; GLM-5: interleaved pairs); ``layer_types``, if
  given, must say "indexed_attention" for every layer.

The gate a model type implies stays in ``hf_config.MODEL_TYPES``.
"""

from __future__ import annotations

import math

from .. import _checks
from . import mistral4, mistral_large4


def _size(c: dict, key: str) -> int | None:
    """A size a default derives from; None where it is absent or bad (MLAConfig then names the key)."""
    value = c.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _glm4_moe_lite(c: dict) -> dict:
    # transformers' Glm4MoeLiteConfig: the first layer dense, the rest sparse. It has no
    # first_k_dense_replace (a release's is ignored), so neither does the default here.
    layers = _size(c, "num_hidden_layers")
    return {"rms_norm_eps": 1e-5, "mlp_layer_types": layers and ["dense"] + ["sparse"] * (layers - 1), **c}


def _minicpm3(c: dict) -> dict:
    hidden, heads = _size(c, "hidden_size"), _size(c, "num_attention_heads")
    return {
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "q_lora_rank": 768, "scale_emb": 12, "scale_depth": 1.4,
        "dim_model_base": 256, "v_head_dim": hidden and heads and hidden // heads,  # the release has no v_head_dim
        **c,
        "rope_interleave": False,  # transformers' MiniCPM3 always rotates halves, whatever the file says
    }


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
    return {"first_k_dense_replace": 1, "n_shared_experts": 1, **c}


def _axk1(c: dict) -> dict:
    # transformers' AXK1Config: without mlp_layer_types, layers from first_k_dense_replace (default 1) on are
    # sparse; its attention always has q_a_proj / q_b_proj (q_lora_rank an int, null refused).
    if "q_lora_rank" in c and c["q_lora_rank"] is None:
        raise ValueError("config.json sets q_lora_rank=null: A.X-K1's attention always has a q_lora_rank "
                         "(q_a_proj / q_b_proj)")
    return {"q_lora_rank": 1536, "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
            "max_position_embeddings": 32768, **c}


# LongCat-Flash's names of four keys (LongcatFlashConfig's attribute_map) -> DeepSeek's.
_LONGCAT_KEYS = {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size",
                 "expert_ffn_hidden_size": "moe_intermediate_size", "moe_topk": "num_experts_per_tok"}


def _longcat_flash(c: dict) -> dict:
    c = dict(c)
    for old, new in _LONGCAT_KEYS.items():
        if c.get(old) is None:  # LongCat's own key named, not the DeepSeek key it becomes
            raise ValueError(f"config.json lacks {old!r}, which a LongCat-Flash model needs")
        c[new] = c.pop(old)
    # LongcatFlashConfig's defaults; its num_hidden_layers is 2 * num_layers (attentions), ours num_layers.
    return {"rms_norm_eps": 1e-5, "rope_theta": 1e7, "max_position_embeddings": 131072, "zero_expert_num": 256, **c}


def _longcat_flash_kwargs(c: dict) -> dict:
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


def _deepseek_v32(c: dict) -> dict:
    # DeepseekV32Config: V3's sizes and gate groups, 3 dense layers; its attention always interleaves the
    # main RoPE rows (the config has no rope_interleave), its indexer rotates halves.
    return {"n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "index_topk": 2048, "index_n_heads": 64,
            "index_head_dim": 128, **c, "rope_interleave": True}


def _glm_moe_dsa(c: dict) -> dict:
    # GlmMoeDsaConfig: GLM-5's (DeepseekV32Config's, with one group, eps 1e-5 and 32 indexer heads).
    return {**_deepseek_v32({"n_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5, "index_n_heads": 32, **c}),
            "indexer_types": _glm_indexer_types(c)}


def _glm_indexer_types(c: dict):
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


def _mistral_large4_text(c: dict) -> dict:
    # MistralLarge4TextConfig: its defaults (mla_ops.models.mistral_large4) and GLM-5's indexer_types schedule
    c = mistral_large4.defaults(c)
    return {**c, "indexer_types": _glm_indexer_types(c)}


# model_type -> (config.json dict -> a copy with what its transformers config fills in for absent keys)
FAMILIES = {
    "deepseek_v32": _deepseek_v32,
    "glm_moe_dsa": _glm_moe_dsa,
    "glm4_moe_lite": _glm4_moe_lite,
    "minicpm3": _minicpm3,
    "youtu": lambda c: {"tie_word_embeddings": True, **c},
    "sarvam_mla": _sarvam_mla,
    "longcat_flash": _longcat_flash,
    "axk1": _axk1,
    "mistral_large4_text": _mistral_large4_text,
}


def family_defaults(c: dict) -> dict:
    """config.json's dict as its model type's transformers config reads it (``FAMILIES``; others unchanged)."""
    model_type = c.get("model_type")
    return FAMILIES[model_type](c) if isinstance(model_type, str) and model_type in FAMILIES else c


# model_type -> the MLAConfig values it implies that no config.json key says
FAMILY_FIXED = {"axk1": dict(post_mlp_layernorm=True, optional_correction_bias=True)}  # A.X-K1's MoE output norm


# model_type -> a reader of the keys only that family has: config.json -> MLAConfig keyword arguments.
FAMILY_KEYS = {"mistral4": mistral4.config_kwargs, "longcat_flash": _longcat_flash_kwargs}


# DeepSeek Sparse Attention's model types -> whether the indexer's RoPE rows are interleaved pairs.
SPARSE_TYPES = {"deepseek_v32": False, "glm_moe_dsa": True, "mistral_large4_text": True}

# model_type -> a reader of the keys only that sparse family has, read besides the DSA keys above.
SPARSE_FAMILY_KEYS = {"mistral_large4_text": mistral_large4.config_kwargs}


def _sparse_kwargs(c: dict, model_type: str) -> dict:
    layer_types = c.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or any(kind != "indexed_attention" for kind in layer_types):
            raise ValueError(f"layer_types must list 'indexed_attention' for every layer (a {model_type} model's "
                             f"attention), got {layer_types!r}")
    if c.get("index_topk") is None:
        raise ValueError(f"config.json sets index_topk=null: a {model_type} model's indexer selects index_topk keys")
    return dict(index_topk=c.get("index_topk"), index_n_heads=c.get("index_n_heads"),
                index_head_dim=c.get("index_head_dim"), indexer_rope_interleave=SPARSE_TYPES[model_type],
                indexer_types=c.get("indexer_types"))


def family_kwargs(keys, model_type) -> dict:
    """MLAConfig's ``mlp_layer_types`` and scalings from config.json (``keys``: ``hf_config._Keys``), and
    what a ``FAMILY_KEYS`` family reads itself."""
    if model_type in FAMILY_KEYS:
        return FAMILY_KEYS[model_type](keys.c)
    for where, scaling in (("", keys.c), ("rope_parameters.", keys.get("rope_parameters")),
                           ("rope_scaling.", keys.get("rope_scaling"))):
        factor = scaling.get("partial_rotary_factor") if isinstance(scaling, dict) else None
        if factor is not None and _checks.check_real(factor, f"{where}partial_rotary_factor") != 1:
            raise ValueError(f"config.json sets {where}partial_rotary_factor={factor}: only 1 (RoPE over all "
                             "qk_rope_head_dim) is supported")
    out = dict(FAMILY_FIXED.get(model_type, {}))
    if model_type in SPARSE_TYPES:
        out.update(_sparse_kwargs(keys.c, model_type))
        if model_type in SPARSE_FAMILY_KEYS:
            out.update(SPARSE_FAMILY_KEYS[model_type](keys.c))
    if keys.get("mlp_layer_types") is not None:
        out["mlp_layer_types"] = keys.get("mlp_layer_types")
    if keys.get("scale_emb") is not None:
        out["embedding_scale"] = _checks.check_real(keys.get("scale_emb"), "scale_emb")
    if keys.get("scale_depth") is not None:
        layers = _checks.check_int(keys.need("num_hidden_layers"), "num_hidden_layers", 1)
        out["residual_scale"] = _checks.check_real(keys.get("scale_depth"), "scale_depth") / math.sqrt(layers)
    if keys.get("dim_model_base") is not None:
        hidden = _checks.check_int(keys.need("hidden_size"), "hidden_size", 1)
        out["logits_scaling"] = hidden / _checks.check_real(keys.get("dim_model_base"), "dim_model_base")
    return out
