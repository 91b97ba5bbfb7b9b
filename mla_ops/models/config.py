"""``MLAConfig``: a DeepSeek-V2/V3 model's shape, with DeepSeek's field names, presets and ``from_hf``.

``MLAConfig.from_hf`` reads a config.json (a dict, a file or the checkpoint directory) in both forms
that exist: the released one (``rope_theta`` + ``rope_scaling``, ``torch_dtype``, ``scoring_func``,
``topk_method``) and the one transformers 5 writes (``rope_parameters`` holding ``rope_theta`` and
the scaling, ``dtype``, and for V3 no ``scoring_func`` / ``topk_method``: its gate is always sigmoid
with group-limited top-k over ``e_score_correction_bias``-corrected scores, "noaux_tc").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from .rope import YarnScaling

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


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
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = YarnScaling.from_dict(self.rope_scaling, self.max_position_embeddings)
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
            path = os.path.join(config, "config.json") if os.path.isdir(config) else config
            with open(path) as f:
                config = json.load(f)
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict, a config.json path or a directory, got {type(config).__name__}")
        return cls(**_read_hf(config))


def _read_hf(c: dict) -> dict:
    def need(name):
        if c.get(name) is None:
            raise ValueError(f"config.json lacks {name!r}, which a DeepSeek-V2/V3 model needs")
        return c[name]

    for flag in ("attention_bias", "mlp_bias"):
        if c.get(flag):
            raise ValueError(f"config.json sets {flag}=true: biases are not supported (no DeepSeek release has them)")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act must be 'silu', got {c['hidden_act']!r}")

    model_type = c.get("model_type")
    # transformers 5 puts rope_theta and the scaling into rope_parameters; releases keep them apart.
    rope = dict(c.get("rope_parameters") or {})
    rope_theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    scaling = c.get("rope_scaling") or rope
    max_positions = int(c.get("max_position_embeddings") or 4096)
    out = dict(
        hidden_size=need("hidden_size"), num_attention_heads=need("num_attention_heads"),
        q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"), rope_theta=float(rope_theta), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        intermediate_size=need("intermediate_size"), num_hidden_layers=need("num_hidden_layers"),
        vocab_size=need("vocab_size"), initializer_range=float(c.get("initializer_range", 0.02)),
        max_position_embeddings=max_positions,
        rope_scaling=YarnScaling.from_dict(scaling, max_positions) if scaling else None,
        rope_interleave=bool(c.get("rope_interleave", True)),  # V2 always interleaves; V3 says so, default true
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        dtype=c.get("dtype") or c.get("torch_dtype"),
    )
    if c.get("n_routed_experts"):
        v3 = model_type == "deepseek_v3"
        if model_type not in ("deepseek_v2", "deepseek_v3") and not (c.get("scoring_func") and c.get("topk_method")):
            raise ValueError(
                f"config.json has model_type {model_type!r}: without 'scoring_func' and 'topk_method' the gate is "
                "known only for 'deepseek_v2' (softmax) and 'deepseek_v3' (sigmoid, noaux_tc)"
            )
        out.update(
            n_routed_experts=int(c["n_routed_experts"]), num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")), n_shared_experts=int(c.get("n_shared_experts") or 0),
            first_k_dense_replace=int(c.get("first_k_dense_replace") or 0), moe_layer_freq=int(c.get("moe_layer_freq") or 1),
            scoring_func=c.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
            topk_method=c.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
            n_group=int(c.get("n_group") or 1), topk_group=int(c.get("topk_group") or 1),
            norm_topk_prob=bool(c.get("norm_topk_prob", v3)),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
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
