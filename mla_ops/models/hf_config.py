"""config.json (a Hugging Face config) -> ``MLAConfig``: ``from_hf`` (``MLAConfig.from_hf``'s reader).

Both forms that exist are read: the released one (``rope_theta`` + ``rope_scaling``, ``torch_dtype``,
``scoring_func``, ``topk_method``) and the one transformers 5 writes (``rope_parameters`` holding
``rope_theta`` and the scaling, ``dtype``, and for V3 no ``scoring_func`` / ``topk_method``: its gate
is always sigmoid with group-limited top-k over ``e_score_correction_bias``-corrected scores,
"noaux_tc"). What a ``model_type`` means beyond those keys (the gate and other defaults its config.json leaves
out, renamed keys, the keys only some families have) is its record in ``families.FAMILIES``.

A key that is absent or null takes its default (required keys have none and are reported missing).
The values are checked by ``MLAConfig`` (same names) and the rest here, each error naming the key:
config.json's ``attention_bias`` / ``mlp_bias`` must be false, ``hidden_act`` "silu", ``dtype`` (or
``torch_dtype``) None or a float dtype's name; ``rope_scaling`` (or ``rope_parameters``) an object, read by
``scalings.read_rope_scaling``: for YaRN ``factor`` > 0, ``original_max_position_embeddings`` >= 1, ``beta_fast`` /
``beta_slow`` > 0, ``mscale`` / ``mscale_all_dim`` real, ``attention_factor`` > 0, ``truncate`` a boolean.
"""

from __future__ import annotations

import dataclasses
import os

from .. import _checks
from .checkpoint_files import read_json_object
from .config import MLAConfig, grouped
from .families import FAMILIES, UNNAMED, V2_GATE
from .scalings import read_rope_scaling
from .wrappers import text_config_key, unwrap


def from_hf(config) -> MLAConfig:
    """From a Hugging Face config: a dict, a config.json path, or a checkpoint directory."""
    return from_hf_dict(*read_config(config))


def from_hf_dict(config: dict, source: str | None) -> MLAConfig:
    """``from_hf`` of a dict; ``source``: the file it was read from, put in front of any error (and for
    a multimodal wrapper the key of its text model's config)."""
    where = [w for w in (source, text_config_key(config)) if w]
    if not where:
        return MLAConfig(**grouped(mla_config_kwargs(config)))
    try:
        return MLAConfig(**grouped(mla_config_kwargs(config)))
    except (TypeError, ValueError) as e:
        raise (ValueError if isinstance(e, ValueError) else TypeError)(f"{': '.join(where)}: {e}") from e


def read_config(config) -> tuple[dict, str | None]:
    """config.json's object and the file it came from: ``config`` a dict (no file), a config.json path
    or a checkpoint directory."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        return read_json_object(path), path
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, a config.json path or a directory, got {type(config).__name__}")
    return config, None


class _Keys:
    """config.json's values: an absent or null key takes its default, a required one has none."""

    def __init__(self, c: dict):
        self.c = c

    def get(self, name, default=None):
        value = self.c.get(name)
        return default if value is None else value

    def need(self, name):
        if self.c.get(name) is None:
            raise ValueError(f"config.json lacks {name!r}, which an MLA model needs")
        return self.c[name]


def mla_config_kwargs(c: dict) -> dict:
    """MLAConfig keyword arguments from config.json's keys; the values are checked by MLAConfig
    (same names), the rest here with the key's name. A multimodal wrapper's (``models.wrappers``): its
    text model's."""
    c, wrapper = unwrap(c)
    return _text_model_kwargs(c) if wrapper is None else dict(_text_model_kwargs(c), wrapper=wrapper)


def _text_model_kwargs(c: dict) -> dict:
    model_type = c.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    c = c if family is None else family.read(c)  # what its transformers config fills in where the file is silent
    keys = _Keys(c)
    for flag in ("attention_bias", "mlp_bias"):
        if _checks.check_bool(keys.get(flag, False), flag):
            raise ValueError(f"config.json sets {flag}=true: biases are not supported (no DeepSeek release has them)")
    if _checks.check_str(keys.get("hidden_act", "silu"), "hidden_act") != "silu":
        raise ValueError(f"hidden_act must be 'silu', got {c['hidden_act']!r}")
    if model_type is not None:
        _checks.check_str(model_type, "model_type")
        if family is None or family.wrapper is not None:  # a wrapper's text model is no wrapper
            raise ValueError(f"model_type {model_type!r} is not one mla_ops reads (it reads "
                             f"{', '.join(map(repr, sorted(FAMILIES)))})")
    family = family or UNNAMED
    dtype_key = "dtype" if c.get("dtype") is not None else "torch_dtype"
    _checks.model_dtype(c.get(dtype_key), dtype_key)
    kwargs = dict(
        hidden_size=keys.need("hidden_size"), num_attention_heads=keys.need("num_attention_heads"),
        q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=keys.need("kv_lora_rank"),
        qk_nope_head_dim=keys.need("qk_nope_head_dim"), qk_rope_head_dim=keys.need("qk_rope_head_dim"),
        v_head_dim=keys.need("v_head_dim"), rms_norm_eps=keys.get("rms_norm_eps", 1e-6),
        intermediate_size=keys.need("intermediate_size"), num_hidden_layers=keys.need("num_hidden_layers"),
        vocab_size=keys.need("vocab_size"), initializer_range=keys.get("initializer_range", 0.02),
        rope_interleave=keys.get("rope_interleave", True),  # V2 always interleaves; V3 says so, default true
        tie_word_embeddings=keys.get("tie_word_embeddings", False),
        dtype=c.get(dtype_key),
        **_rope(keys), **_experts(keys, model_type, family.gate),
        **family.kwargs(c),  # after the sizes above: a family's readers may take them as checked present
    )
    return {**kwargs, **family.fixed}


def _rope(keys: _Keys) -> dict:
    """rope_theta, max_position_embeddings and the scaling: transformers 5 puts rope_theta and the
    scaling into rope_parameters; releases keep them apart."""
    rope = _checks.check_object(keys.get("rope_parameters", {}), "rope_parameters")
    if rope.get("rope_theta") is not None:
        rope_theta = _checks.check_real(rope["rope_theta"], "rope_parameters.rope_theta")
    else:
        rope_theta = _checks.check_real(keys.get("rope_theta", 10000.0), "rope_theta")
    scaling_key, scaling = "rope_scaling", _checks.check_object(keys.get("rope_scaling", {}), "rope_scaling")
    if not scaling:
        scaling_key, scaling = "rope_parameters", rope
    max_positions = _checks.check_int(keys.get("max_position_embeddings", 4096), "max_position_embeddings", 1)
    return dict(rope_theta=rope_theta, max_position_embeddings=max_positions,
                rope_scaling=read_rope_scaling(scaling, max_positions, scaling_key) if scaling else None)


def _experts(keys: _Keys, model_type: str | None, gate) -> dict:
    """The mixture of experts; none (every layer dense) for a null or 0 ``n_routed_experts``."""
    experts = _checks.check_int(keys.c.get("n_routed_experts"), "n_routed_experts", 0, optional=True)
    if not experts:
        return {}
    if gate is None:
        if not (keys.c.get("scoring_func") and keys.c.get("topk_method")):
            known = sorted(name for name, family in FAMILIES.items() if family.gate is not None)
            raise ValueError(
                f"config.json has model_type {model_type!r}: without 'scoring_func' and 'topk_method' the gate is "
                f"known only for {', '.join(map(repr, known))}"
            )
        gate = V2_GATE  # the file names its gate; the rest defaults as V2's
    return dict(
        n_routed_experts=experts, num_experts_per_tok=keys.need("num_experts_per_tok"),
        moe_intermediate_size=keys.need("moe_intermediate_size"), n_shared_experts=keys.get("n_shared_experts", 0),
        first_k_dense_replace=keys.get("first_k_dense_replace", 0), moe_layer_freq=keys.get("moe_layer_freq", 1),
        n_group=keys.get("n_group", 1), topk_group=keys.get("topk_group", 1),
        **{name: keys.get(name, default) for name, default in dataclasses.asdict(gate).items()},
    )
