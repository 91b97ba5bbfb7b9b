"""``MLAConfig``: a DeepSeek-V2/V3 model's shape, with DeepSeek's field names, presets and ``from_hf``.

``MLAConfig.from_hf`` reads a config.json (a dict, a file or the checkpoint directory) in both forms
that exist: the released one (``rope_theta`` + ``rope_scaling``, ``torch_dtype``, ``scoring_func``,
``topk_method``) and the one transformers 5 writes (``rope_parameters`` holding ``rope_theta`` and
the scaling, ``dtype``, and for V3 no ``scoring_func`` / ``topk_method``: its gate is always sigmoid
with group-limited top-k over ``e_score_correction_bias``-corrected scores, "noaux_tc").

Every value is checked when an ``MLAConfig`` is made (directly or from config.json), and an error
names the key: a TypeError for a value of the wrong type, a ValueError for one out of range.

* integers must be integers: not ``"4"``, ``4.5``, ``4.0`` or ``true``. At least 1: ``hidden_size``,
  ``num_attention_heads``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim`` (also even),
  ``v_head_dim``, ``intermediate_size``, ``num_hidden_layers``, ``vocab_size``, ``max_position_embeddings``,
  ``num_experts_per_tok``, ``moe_layer_freq``, ``n_group``, ``topk_group``; at least 0:
  ``moe_intermediate_size`` (at least 1 with experts), ``n_shared_experts``, ``first_k_dense_replace``.
  ``q_lora_rank``: None (a plain ``q_proj``, DeepSeek-V2-Lite) or at least 1; ``n_routed_experts``: None
  (dense) or at least 1 (config.json's 0 or null both mean dense, as before).
* real numbers (an int or a float, not a string or a bool, finite): ``rope_theta``, ``rms_norm_eps``,
  ``lora_norm_eps``, ``routed_scaling_factor`` > 0; ``initializer_range`` >= 0.
* booleans must be booleans (``"false"`` is refused, not read as true): ``rope_interleave``,
  ``tie_word_embeddings``, ``norm_topk_prob`` and config.json's ``attention_bias`` / ``mlp_bias``.
* ``scoring_func`` / ``topk_method`` / ``hidden_act`` / ``model_type``: strings (known values);
  ``dtype`` (config.json's ``dtype`` or ``torch_dtype``): None or one of float16, bfloat16, float32,
  float64 (``"torch.bfloat16"`` too).
* ``rope_scaling`` (config.json's ``rope_scaling``, or transformers' ``rope_parameters``): an object;
  for YaRN ``factor`` > 0, ``original_max_position_embeddings`` >= 1, ``beta_fast`` / ``beta_slow`` > 0,
  ``mscale`` / ``mscale_all_dim`` real, ``attention_factor`` > 0, ``truncate`` a boolean.

In config.json a key that is absent or null takes its default (required keys have none and are
reported missing). ``from_hf`` of a file or directory puts the file's path in front of every message;
a file that is not JSON, or not a JSON object, is one ValueError naming it.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass
from typing import Optional

from .rope import YarnScaling

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
MODEL_DTYPES = ("float16", "bfloat16", "float32", "float64")

# MLAConfig's integer fields and their least value.
_INTS = dict(hidden_size=1, num_attention_heads=1, kv_lora_rank=1, qk_nope_head_dim=1, qk_rope_head_dim=1,
             v_head_dim=1, intermediate_size=1, num_hidden_layers=1, vocab_size=1, max_position_embeddings=1,
             num_experts_per_tok=1, moe_intermediate_size=0, n_shared_experts=0, first_k_dense_replace=0,
             moe_layer_freq=1, n_group=1, topk_group=1)
_OPTIONAL_INTS = ("q_lora_rank", "n_routed_experts")  # None, or at least 1
# Real fields: True if they must be > 0, False if >= 0.
_REALS = dict(rope_theta=True, rms_norm_eps=True, lora_norm_eps=True, routed_scaling_factor=True,
              initializer_range=False)
_BOOLS = ("rope_interleave", "tie_word_embeddings", "norm_topk_prob")


def _type_name(value) -> str:
    return type(value).__name__


def check_int(key: str, value, least: int | None = 1, optional: bool = False) -> int | None:
    """``value`` as an int (a bool, float or string is a TypeError naming ``key``), >= ``least``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{key} must be an integer{' or null' if optional else ''}, got {value!r} "
                        f"({_type_name(value)})")
    value = int(value)
    if least is not None and value < least:
        raise ValueError(f"{key} must be >= {least}{' (or null)' if optional else ''}, got {value}")
    return value


def check_real(key: str, value, positive: bool | None = True, optional: bool = False) -> float | None:
    """``value`` as a finite float (ints too; a bool or string is a TypeError naming ``key``);
    positive: True for > 0, False for >= 0, None for any sign."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{key} must be a number{' or null' if optional else ''}, got {value!r} "
                        f"({_type_name(value)})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{key} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{key} must be > 0, got {value}")
    if positive is False and value < 0:
        raise ValueError(f"{key} must be >= 0, got {value}")
    return value


def check_bool(key: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{key} must be true or false, got {value!r} ({_type_name(value)})")
    return value


def check_str(key: str, value, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{key} must be a string, got {value!r} ({_type_name(value)})")
    if choices is not None and value not in choices:
        raise ValueError(f"{key} must be one of {choices}, got {value!r}")
    return value


def model_dtype(name, key: str = "dtype"):
    """A model dtype (``torch.bfloat16``, ``"bfloat16"``, ``"torch.bfloat16"``) as a torch.dtype; None stays
    None. Only float16, bfloat16, float32 and float64: anything else is an error naming ``key``."""
    import torch

    if name is None:
        return None
    if isinstance(name, torch.dtype):
        dtype = name
    elif isinstance(name, str):
        dtype = getattr(torch, name.removeprefix("torch."), None)
    else:
        raise TypeError(f"{key} must be a torch.dtype or its name (one of {MODEL_DTYPES}), got {name!r} "
                        f"({_type_name(name)})")
    allowed = {getattr(torch, d) for d in MODEL_DTYPES}
    if dtype not in allowed:
        raise ValueError(f"{key} must be one of {MODEL_DTYPES}, got {name!r}")
    return dtype


def read_json_object(path: str, what: str = "config.json") -> dict:
    """The JSON object in file ``path``: a missing or unreadable file, text that is not JSON, or JSON
    that is not an object is one ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"no {what}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {what} {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got a JSON {_json_kind(value)}")
    return value


def _json_kind(value) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "boolean" if isinstance(value, bool) else "number"


def _check_yarn(y: YarnScaling, key: str) -> None:
    check_real(f"{key}.factor", y.factor)
    check_int(f"{key}.original_max_position_embeddings", y.original_max_position_embeddings)
    check_real(f"{key}.beta_fast", y.beta_fast)
    check_real(f"{key}.beta_slow", y.beta_slow)
    check_real(f"{key}.mscale", y.mscale, positive=None, optional=True)
    check_real(f"{key}.mscale_all_dim", y.mscale_all_dim, positive=None, optional=True)
    check_real(f"{key}.attention_factor", y.attention_factor, optional=True)
    check_bool(f"{key}.truncate", y.truncate)


def yarn_from_dict(scaling, max_position_embeddings: int, key: str = "rope_scaling") -> YarnScaling | None:
    """config.json's ``rope_scaling`` (or ``rope_parameters``) checked and read; None for plain RoPE.
    A null entry takes its default."""
    if not isinstance(scaling, dict):
        raise TypeError(f"{key} must be an object, got {scaling!r} ({_type_name(scaling)})")
    for name in ("rope_type", "type"):
        if scaling.get(name) is not None:
            check_str(f"{key}.{name}", scaling[name])
    clean = {k: v for k, v in scaling.items() if v is not None}
    kind = clean.get("rope_type", clean.get("type", "default"))
    if kind == "yarn":
        for name, least in (("factor", True), ("beta_fast", True), ("beta_slow", True), ("attention_factor", True),
                            ("mscale", None), ("mscale_all_dim", None)):
            if name in clean:
                clean[name] = check_real(f"{key}.{name}", clean[name], positive=least)
        if "original_max_position_embeddings" in clean:
            check_int(f"{key}.original_max_position_embeddings", clean["original_max_position_embeddings"])
        if "truncate" in clean:
            check_bool(f"{key}.truncate", clean["truncate"])
    y = YarnScaling.from_dict(clean, max_position_embeddings)  # an unknown type: a ValueError naming it
    if y is not None:
        _check_yarn(y, key)
    return y


@dataclass
class MLAConfig:
    hidden_size: int
    num_attention_heads: int
    q_lora_rank: Optional[int]  # None: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rms_norm_eps: float
    intermediate_size: int  # the dense MLP's (first_k_dense_replace layers, or all without experts)
    num_hidden_layers: int
    vocab_size: int
    initializer_range: float = 0.02
    max_position_embeddings: int = 4096
    rope_scaling: Optional[YarnScaling] = None  # YaRN; a dict is read as config.json's rope_scaling
    rope_interleave: bool = True  # the checkpoint's rope rows are interleaved pairs (converted at load)
    lora_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepSeek's and transformers' code fix 1e-6
    # Mixture of experts; n_routed_experts None: every layer has the dense MLP.
    n_routed_experts: Optional[int] = None
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0  # layers before this one are dense
    moe_layer_freq: int = 1  # after them, every moe_layer_freq-th layer has experts
    scoring_func: str = "softmax"  # "softmax" (V2) or "sigmoid" (V3)
    topk_method: str = "greedy"  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    tie_word_embeddings: bool = False
    dtype: Optional[str] = None  # the checkpoint's dtype ("bfloat16"): from_pretrained's default

    def __post_init__(self):
        # Types and ranges of every field (normalized: numpy integers -> int, ints -> float where real).
        for name, least in _INTS.items():
            setattr(self, name, check_int(name, getattr(self, name), least))
        for name in _OPTIONAL_INTS:
            setattr(self, name, check_int(name, getattr(self, name), 1, optional=True))
        for name, positive in _REALS.items():
            setattr(self, name, check_real(name, getattr(self, name), positive))
        for name in _BOOLS:
            check_bool(name, getattr(self, name))
        check_str("scoring_func", self.scoring_func)
        check_str("topk_method", self.topk_method)
        model_dtype(self.dtype, "dtype")
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = yarn_from_dict(self.rope_scaling, self.max_position_embeddings)
        elif isinstance(self.rope_scaling, YarnScaling):
            _check_yarn(self.rope_scaling, "rope_scaling")
        elif self.rope_scaling is not None:
            raise TypeError(f"rope_scaling must be None, a dict (config.json's) or a YarnScaling, got "
                            f"{_type_name(self.rope_scaling)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.n_routed_experts is None:
            return
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, n_routed_experts={self.n_routed_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size must be positive with experts, got {self.moe_intermediate_size}")
        if self.topk_method != "greedy":
            if self.n_routed_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
                raise ValueError(
                    f"group-limited top-k needs n_routed_experts ({self.n_routed_experts}) divisible by n_group "
                    f"({self.n_group}) and 1 <= topk_group ({self.topk_group}) <= n_group"
                )
            if self.topk_group * (self.n_routed_experts // self.n_group) < self.num_experts_per_tok:
                raise ValueError(
                    f"topk_group={self.topk_group} groups of {self.n_routed_experts // self.n_group} experts hold "
                    f"fewer than num_experts_per_tok={self.num_experts_per_tok}"
                )
        if self.topk_method == "noaux_tc" and self.n_routed_experts // self.n_group < 2:
            raise ValueError("topk_method 'noaux_tc' scores a group by its top-2 experts: needs >= 2 experts per group")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(P+R), times YaRN's mscale correction where the checkpoint has one."""
        scale = self.qk_head_dim ** -0.5
        return scale if self.rope_scaling is None else scale * self.rope_scaling.softmax_scale_factor()

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.n_routed_experts is not None and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

    @classmethod
    def from_name(cls, name: str) -> MLAConfig:
        if name not in mla_configs:
            raise ValueError(f"unknown MLAConfig name {name!r}; known: {sorted(mla_configs)}")
        return cls(**mla_configs[name])

    @classmethod
    def from_hf(cls, config) -> MLAConfig:
        """From a Hugging Face config: a dict, a config.json path, or a checkpoint directory."""
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            path = os.path.join(path, "config.json") if os.path.isdir(path) else path
            return cls._from_hf_dict(read_json_object(path), path)
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict, a config.json path or a directory, got {type(config).__name__}")
        return cls._from_hf_dict(config, None)

    @classmethod
    def _from_hf_dict(cls, config: dict, source: str | None) -> MLAConfig:
        """``from_hf`` of a dict; ``source``: the file it was read from, put in front of any error."""
        if source is None:
            return cls(**_read_hf(config))
        try:
            return cls(**_read_hf(config))
        except (TypeError, ValueError) as e:
            raise (ValueError if isinstance(e, ValueError) else TypeError)(f"{source}: {e}") from e


def _read_hf(c: dict) -> dict:
    """MLAConfig keyword arguments from config.json's keys; the values are checked by MLAConfig
    (same names), the rest here with the key's name."""
    def get(name, default=None):
        value = c.get(name)
        return default if value is None else value

    def need(name):
        if c.get(name) is None:
            raise ValueError(f"config.json lacks {name!r}, which a DeepSeek-V2/V3 model needs")
        return c[name]

    for flag in ("attention_bias", "mlp_bias"):
        if check_bool(flag, get(flag, False)):
            raise ValueError(f"config.json sets {flag}=true: biases are not supported (no DeepSeek release has them)")
    if check_str("hidden_act", get("hidden_act", "silu")) != "silu":
        raise ValueError(f"hidden_act must be 'silu', got {c['hidden_act']!r}")

    model_type = c.get("model_type")
    if model_type is not None:
        check_str("model_type", model_type)
    # transformers 5 puts rope_theta and the scaling into rope_parameters; releases keep them apart.
    rope = get("rope_parameters", {})
    if not isinstance(rope, dict):
        raise TypeError(f"rope_parameters must be an object, got {rope!r} ({_type_name(rope)})")
    if rope.get("rope_theta") is not None:
        rope_theta = check_real("rope_parameters.rope_theta", rope["rope_theta"])
    else:
        rope_theta = check_real("rope_theta", get("rope_theta", 10000.0))
    scaling_key, scaling = "rope_scaling", get("rope_scaling", {})
    if not isinstance(scaling, dict):
        raise TypeError(f"rope_scaling must be an object, got {scaling!r} ({_type_name(scaling)})")
    if not scaling:
        scaling_key, scaling = "rope_parameters", rope
    max_positions = check_int("max_position_embeddings", get("max_position_embeddings", 4096))
    dtype_key = "dtype" if c.get("dtype") is not None else "torch_dtype"
    dtype = c.get(dtype_key)
    model_dtype(dtype, dtype_key)
    out = dict(
        hidden_size=need("hidden_size"), num_attention_heads=need("num_attention_heads"),
        q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"), rope_theta=rope_theta, rms_norm_eps=get("rms_norm_eps", 1e-6),
        intermediate_size=need("intermediate_size"), num_hidden_layers=need("num_hidden_layers"),
        vocab_size=need("vocab_size"), initializer_range=get("initializer_range", 0.02),
        max_position_embeddings=max_positions,
        rope_scaling=yarn_from_dict(scaling, max_positions, scaling_key) if scaling else None,
        rope_interleave=get("rope_interleave", True),  # V2 always interleaves; V3 says so, default true
        tie_word_embeddings=get("tie_word_embeddings", False),
        dtype=dtype,
    )
    experts = check_int("n_routed_experts", c.get("n_routed_experts"), 0, optional=True)
    if experts:  # null or 0: every layer dense
        v3 = model_type == "deepseek_v3"
        if model_type not in ("deepseek_v2", "deepseek_v3") and not (c.get("scoring_func") and c.get("topk_method")):
            raise ValueError(
                f"config.json has model_type {model_type!r}: without 'scoring_func' and 'topk_method' the gate is "
                "known only for 'deepseek_v2' (softmax) and 'deepseek_v3' (sigmoid, noaux_tc)"
            )
        out.update(
            n_routed_experts=experts, num_experts_per_tok=need("num_experts_per_tok"),
            moe_intermediate_size=need("moe_intermediate_size"), n_shared_experts=get("n_shared_experts", 0),
            first_k_dense_replace=get("first_k_dense_replace", 0), moe_layer_freq=get("moe_layer_freq", 1),
            scoring_func=get("scoring_func", "sigmoid" if v3 else "softmax"),
            topk_method=get("topk_method", "noaux_tc" if v3 else "greedy"),
            n_group=get("n_group", 1), topk_group=get("topk_group", 1),
            norm_topk_prob=get("norm_topk_prob", v3),
            routed_scaling_factor=get("routed_scaling_factor", 2.5 if v3 else 1.0),
        )
    return out


# MLAConfig keyword arguments: the released config.json values (MLAConfig(**mla_configs[name]) works).
_YARN_40 = dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1)
mla_configs = {
    "deepseek-v2-lite": dict(
        hidden_size=2048, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000, rms_norm_eps=1e-6,
        intermediate_size=10944, num_hidden_layers=27, vocab_size=102400, max_position_embeddings=163840,
        rope_scaling=dict(_YARN_40, mscale=0.707, mscale_all_dim=0.707),
        n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408, n_shared_experts=2,
        first_k_dense_replace=1, moe_layer_freq=1, scoring_func="softmax", topk_method="greedy", n_group=1,
        topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, tie_word_embeddings=False,
        dtype="bfloat16",
    ),
    "deepseek-v2": dict(
        hidden_size=5120, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000, rms_norm_eps=1e-6,
        intermediate_size=12288, num_hidden_layers=60, vocab_size=102400, max_position_embeddings=163840,
        rope_scaling=dict(_YARN_40, mscale=0.707, mscale_all_dim=0.707),
        n_routed_experts=160, num_experts_per_tok=6, moe_intermediate_size=1536, n_shared_experts=2,
        first_k_dense_replace=1, moe_layer_freq=1, scoring_func="softmax", topk_method="group_limited_greedy",
        n_group=8, topk_group=3, norm_topk_prob=False, routed_scaling_factor=16.0, tie_word_embeddings=False,
        dtype="bfloat16",
    ),
    "deepseek-v3": dict(
        hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000, rms_norm_eps=1e-6,
        intermediate_size=18432, num_hidden_layers=61, vocab_size=129280, max_position_embeddings=163840,
        rope_scaling=dict(_YARN_40, mscale=1.0, mscale_all_dim=1.0),
        n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
        first_k_dense_replace=3, moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc", n_group=8,
        topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, tie_word_embeddings=False,
        dtype="bfloat16",
    ),
    "tiny": dict(  # for tests: dense, no YaRN
        hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_theta=10000.0,
        rms_norm_eps=1e-6, intermediate_size=128, num_hidden_layers=2, vocab_size=256,
    ),
}
