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
  and its query scale is its own; ``mla_ops.models.mistral4``).

The gate a model type implies stays in ``hf_config.MODEL_TYPES``.
"""

from __future__ import annotations

import math

from .. import _checks
from . import mistral4


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


# model_type -> (config.json dict -> a copy with what its transformers config fills in for absent keys)
FAMILIES = {
    "glm4_moe_lite": _glm4_moe_lite,
    "minicpm3": _minicpm3,
    "youtu": lambda c: {"tie_word_embeddings": True, **c},
    "sarvam_mla": _sarvam_mla,
}


def family_defaults(c: dict) -> dict:
    """config.json's dict as its model type's transformers config reads it (``FAMILIES``; others unchanged)."""
    model_type = c.get("model_type")
    return FAMILIES[model_type](c) if isinstance(model_type, str) and model_type in FAMILIES else c


# model_type -> a reader of the keys only that family has: config.json -> MLAConfig keyword arguments.
FAMILY_KEYS = {"mistral4": mistral4.config_kwargs}


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
    out = {}
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
