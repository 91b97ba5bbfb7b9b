"""``MLAConfig``: a DeepSeek-V2/V3 model's shape, with DeepSeek's field names, and its presets.

Every value is checked when an ``MLAConfig`` is made (directly, from a preset or from config.json:
``from_hf``, read by ``mla_ops.models.hf_config``), and an error names the field: a TypeError for a
value of the wrong type, a ValueError for one out of range.

* integers must be integers: not ``"4"``, ``4.5``, ``4.0`` or ``true``. At least 1: ``hidden_size``,
  ``num_attention_heads``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim`` (also even),
  ``v_head_dim``, ``intermediate_size``, ``num_hidden_layers``, ``vocab_size``, ``max_position_embeddings``,
  ``num_experts_per_tok``, ``moe_layer_freq``, ``n_group``, ``topk_group``; at least 0:
  ``moe_intermediate_size`` (at least 1 with experts), ``n_shared_experts``, ``first_k_dense_replace``,
  ``zero_expert_num``.
  ``q_lora_rank``: None (a plain ``q_proj``, DeepSeek-V2-Lite) or at least 1; ``n_routed_experts``: None
  (dense) or at least 1 (config.json's 0 or null both mean dense).
* real numbers (an int or a float, not a string or a bool, finite): ``rope_theta``, ``rms_norm_eps``,
  ``lora_norm_eps``, ``routed_scaling_factor`` > 0; ``initializer_range`` >= 0.
* booleans must be booleans (``"false"`` is refused, not read as true): ``rope_interleave``,
  ``tie_word_embeddings``, ``norm_topk_prob``, ``post_mlp_layernorm``, ``optional_correction_bias``,
  ``learned_rope_frequencies``.
* ``scoring_func`` / ``topk_method`` / ``decoder_layer``: strings (known values); ``dtype``: None or one of float16,
  bfloat16, float32, float64 (``"torch.bfloat16"`` too); ``rope_scaling``: None, a ``YarnScaling``, a
  ``LongRopeScaling`` (its ``short_factor`` of R/2 entries; both ``mla_ops.models.scalings``) or config.json's
  dict; ``wrapper``: None or a string, the multimodal wrapper's model type ``from_hf`` found (checked against
  the registry where the checkpoint's names are read, ``models.wrappers``: this record sits below the readers).

The optional parts are small records, each field named as its config.json key (``grouped`` gathers flat
keys into them; ``from_hf`` does): ``indexer`` (``IndexerConfig``, None: dense MLA), ``scalings``
(``Scalings``: MiniCPM3's ``embedding_scale``, ``residual_scale``, ``logits_scaling`` > 0, LongCat's
``mla_scale_*``, Mistral 4's ``query_scale``, Mistral Large 4's ``learned_query_scale`` and
``final_logit_softcapping``) and ``layer_kinds`` (``LayerKinds``: one entry per layer, or None). A dict is
read as a record's fields. ``mlp_layer_types``: None, or one of "dense" / "sparse" per layer ("sparse"
needs experts).

DeepSeek Sparse Attention (DESIGN §12; ``mla_ops.models.indexer``): an ``indexer`` (its ``index_topk`` in
1 .. 2**31 - 1, a step plan's bound) turns on each layer's lightning indexer, of ``index_n_heads`` heads of width
``index_head_dim`` (at least 1;
the first ``qk_rope_head_dim`` rotated, so at least that wide), reading the q-LoRA latent (``q_lora_rank``
required); ``indexer_rope_interleave`` (bool): GLM-5's indexer rows are interleaved pairs (converted at load);
``layer_kinds.indexer_types``: None (every layer "full") or one of "full" / "shared" per layer, layer 0 "full" (a shared
layer reuses the previous full layer's top-k, and has no indexer of its own). Only the deepseek layer has one.

Two kinds of attention layer (dots3_note's): ``sliding_attention`` (``SlidingAttention``: a ``sliding_window`` and,
where set, the layers' own ``num_attention_heads``, ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
``qk_rope_head_dim`` (even), ``v_head_dim``, ``rope_theta``) on the layers ``layer_kinds.attention_types`` marks
"sliding" (the others "full"); both or neither, DeepSeek's layer only, without NoPE or KV-sharing layers. A sliding
layer has no indexer; ``attention_dims(i)`` is each layer's geometry, its caches ``L + R`` of its kind.
``k_rope_norm`` / ``head_gate`` (bool) / ``shared_expert_intermediate_size`` (None or at least 1) and
``Scalings.lora_latent_scales`` (needs ``q_lora_rank``) are dots3_note's attention and experts.

LongCat-Flash's layer (``decoder_layer="longcat"``, ``mla_ops.models.longcat``) needs experts; identity
experts (``zero_expert_num``) need ``n_group`` 1; ``mla_scale_q_lora`` (which needs ``q_lora_rank``) and
``mla_scale_kv_lora`` are its layer's only.

The autumn-2026 DSA families' parts (DESIGN §11): ``output_gate`` None, "hidden" (HY-V4) or "query" (A.X-K2, needs
``q_lora_rank``); ``attention_sinks`` a bool; ``swiglu_limit`` None or > 0; ``gated_norm_rank`` None or at least 1;
``hyper_connections`` (``HyperConnections``: ``hc_mult`` at least 1, ``hc_magnitude`` > 0, ``hc_eps`` >= 0) set
exactly when ``decoder_layer`` is "hyper" (``mla_ops.models.hyper_connections``, which may have an indexer).

A config's dict form is ``dataclasses.asdict(config)``: ``MLAConfig(**that)``, also after JSON, is an equal config
(the rope records carry their ``rope_type``, so the dict reads back as YaRN or LongRoPE, not plain RoPE).

``from_hf`` of a file or directory puts the file's path in front of every message; a file that is not
JSON, or not a JSON object, is one ValueError naming it.

This module is the floor of ``models/``: it imports only the scaling records (``scalings``) and the routing
default's formula; the readers of config.json (``hf_config``, ``families``) and every part stand on it, and
``from_hf`` reaches its reader only when called.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from .. import _checks
from ..planning.routing import default_threshold
from .scalings import LongRopeScaling, QueryScale, YarnScaling, check_yarn, read_rope_scaling

SCORING_FUNCS = ("softmax", "sigmoid")
# "noaux_tc_zero": noaux_tc with the experts of dropped groups scored 0, not -inf (A.X-K2's router)
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc", "group_top2", "noaux_tc_zero")
_TOP2_GROUPS = ("noaux_tc", "group_top2", "noaux_tc_zero")  # groups ranked by their two best scores
MLP_LAYER_TYPES = ("dense", "sparse")  # mlp_layer_types' entries: the dense MLP, or the experts
DECODER_LAYERS = ("deepseek", "longcat", "hyper")  # the layer structures (decoder.LAYER_CLASSES)
OUTPUT_GATES = ("hidden", "query")  # output_gate: from the attention's input (HY-V4), fused with the query (A.X-K2)
INDEXER_TYPES = ("full", "shared")  # indexer_types' entries: a layer's own indexer, or the previous full one's top-k
ATTENTION_TYPES = ("full", "sliding")  # attention_types' entries: the config's own attention, or sliding_attention's

# MLAConfig's integer fields and their least value.
_INTS = dict(hidden_size=1, num_attention_heads=1, kv_lora_rank=1, qk_nope_head_dim=1, qk_rope_head_dim=1,
             v_head_dim=1, intermediate_size=1, num_hidden_layers=1, vocab_size=1, max_position_embeddings=1,
             num_experts_per_tok=1, moe_intermediate_size=0, n_shared_experts=0, first_k_dense_replace=0,
             moe_layer_freq=1, n_group=1, topk_group=1, zero_expert_num=0)
_OPTIONAL_INTS = ("q_lora_rank", "n_routed_experts", "shared_expert_intermediate_size")  # None, or at least 1
# Real fields: True if they must be > 0, False if >= 0.
_REALS = dict(rope_theta=True, rms_norm_eps=True, lora_norm_eps=True, routed_scaling_factor=True,
              initializer_range=False)
_BOOLS = ("rope_interleave", "tie_word_embeddings", "norm_topk_prob", "post_mlp_layernorm", "optional_correction_bias",
          "learned_rope_frequencies", "k_rope_norm", "head_gate")


@dataclass
class IndexerConfig:
    """DeepSeek Sparse Attention's lightning indexer (``mla_ops.models.indexer``): each query's MLA sees the
    ``index_topk`` (K_I) keys of highest score. V3.2's defaults."""

    index_topk: int
    index_n_heads: int = 64  # H_I
    index_head_dim: int = 128  # D_I; its first qk_rope_head_dim are rotated
    indexer_rope_interleave: bool = False  # its rope rows are interleaved pairs (GLM-5's; V3.2 rotates halves)
    indexer_q_norm: bool = False  # queries from a LayerNorm of the layer input, no q-LoRA latent (Mistral Large 4)
    indexer_rope_last: bool = False  # the rotated dims are the last R of each head, not the first (HY-V4's)
    indexer_norm_eps: float = 1e-6  # k_norm's eps (HY-V4's: its rms_norm_eps)

    def __post_init__(self):
        self.index_topk = _checks.check_int32_size(self.index_topk, "index_topk")  # PlanOptions' bound, checked early
        self.index_n_heads = _checks.check_int(self.index_n_heads, "index_n_heads", 1)
        self.index_head_dim = _checks.check_int(self.index_head_dim, "index_head_dim", 1)
        _checks.check_bool(self.indexer_rope_interleave, "indexer_rope_interleave")
        _checks.check_bool(self.indexer_q_norm, "indexer_q_norm")
        _checks.check_bool(self.indexer_rope_last, "indexer_rope_last")
        self.indexer_norm_eps = _checks.check_real(self.indexer_norm_eps, "indexer_norm_eps")


@dataclass
class Scalings:
    """Factors some families put around the standard block (the defaults: none)."""

    # MiniCPM3's: the token embeddings times embedding_scale, each attention and MLP output times residual_scale
    # before its residual add, the final hidden states divided by logits_scaling.
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    logits_scaling: float = 1.0
    final_logit_softcapping: Optional[float] = None  # logits = c * tanh(logits / c) (Mistral Large 4's)
    mla_scale_q_lora: bool = False  # q times sqrt(hidden_size / q_lora_rank) (LongCat-Flash)
    mla_scale_kv_lora: bool = False  # the latent kv_c times sqrt(hidden_size / kv_lora_rank) (LongCat-Flash)
    query_scale: Optional[QueryScale] = None  # Mistral 4's per-position query scale; a dict is read as its fields
    # Mistral Large 4's learned per-head query scale s * log(position + 1) + b, in the attention and the indexer
    learned_query_scale: bool = False
    # dots3_note's: the q-LoRA latent times sqrt(hidden_size / q_lora_rank) (before q_b_proj and the indexer's
    # wq_b) and the latent kv_c times sqrt(hidden_size / kv_lora_rank) (before it is cached), at each layer's ranks
    lora_latent_scales: bool = False

    def __post_init__(self):
        for name in ("embedding_scale", "residual_scale", "logits_scaling"):
            setattr(self, name, _checks.check_real(getattr(self, name), name))
        self.final_logit_softcapping = _checks.check_real(self.final_logit_softcapping, "final_logit_softcapping",
                                                          optional=True)
        for name in ("mla_scale_q_lora", "mla_scale_kv_lora", "learned_query_scale", "lora_latent_scales"):
            _checks.check_bool(getattr(self, name), name)
        self.query_scale = _record(self.query_scale, QueryScale, "query_scale")


@dataclass
class LayerKinds:
    """What differs from layer to layer: one entry per layer in each list; None: every layer alike."""

    # "dense" / "sparse" MLP (GLM-4.7-Flash's); None: by first_k_dense_replace and moe_layer_freq
    mlp_layer_types: Optional[tuple[str, ...]] = None
    # "full" (its own indexer) / "shared" (the previous full layer's top-k), GLM-5's; None: all full
    indexer_types: Optional[tuple[str, ...]] = None
    no_rope_layers: Optional[tuple[int, ...]] = None  # 1: RoPE, 0: NoPE (Mistral Large 4's, transformers' convention)
    kv_source_layers: Optional[tuple[int, ...]] = None  # the layer whose latent cache each layer attends
    # "full" (the config's own attention) / "sliding" (MLAConfig.sliding_attention's), dots3_note's; None: all full
    attention_types: Optional[tuple[str, ...]] = None


@dataclass
class SlidingAttention:
    """The attention of the "sliding" layers (``layer_kinds.attention_types``; dots3_note's): query ``c_r + j``
    sees the last ``sliding_window`` keys, with a geometry of its own where a field is set (None: the config's).
    Its caches are ``kv_lora_rank + qk_rope_head_dim`` wide; it has no indexer, plain RoPE of its ``rope_theta``
    (no scaling) and a softmax scale of 1/sqrt(P+R)."""

    sliding_window: int
    num_attention_heads: Optional[int] = None
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    rope_theta: Optional[float] = None

    def __post_init__(self):
        self.sliding_window = _checks.check_int(self.sliding_window, "sliding_window", 1)
        for name in ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim"):
            setattr(self, name, _checks.check_int(getattr(self, name), f"sliding_attention.{name}", 1, optional=True))
        self.rope_theta = _checks.check_real(self.rope_theta, "sliding_attention.rope_theta", optional=True)


class AttentionDims(NamedTuple):
    """One layer's attention geometry (``MLAConfig.attention_dims``)."""

    num_heads: int  # N
    q_lora_rank: Optional[int]
    kv_lora_rank: int  # L
    qk_nope_head_dim: int  # P (P + R for a NoPE layer)
    qk_rope_head_dim: int  # R (0 for a NoPE layer)
    v_head_dim: int  # V
    cache_width: int  # its cache rows: L + R (a NoPE layer's keep the R columns it does not read)
    sliding_window: int  # 0: none
    kind: int  # 0: the config's own attention, 1: sliding_attention's (its steps are planned apart)


@dataclass
class HyperConnections:
    """Hyper-connections (HY-V4's, ``mla_ops.models.hyper_connections``): the residual stream is ``hc_mult`` streams,
    mixed into each sublayer's input and fed its output by learned sigmoid weights (no Sinkhorn mixing)."""

    hc_mult: int = 4  # streams
    hc_magnitude: float = 2.0  # the output weights' range: magnitude * sigmoid(...)
    hc_eps: float = 1e-6  # added to every sigmoid weight

    def __post_init__(self):
        self.hc_mult = _checks.check_int(self.hc_mult, "hc_mult", 1)
        self.hc_magnitude = _checks.check_real(self.hc_magnitude, "hc_magnitude")
        self.hc_eps = _checks.check_real(self.hc_eps, "hc_eps", False)


def _record(value, cls, name: str):
    """An optional part: None, a ``cls`` or a dict of its fields (config.json's)."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return cls(**value)
    raise TypeError(f"{name} must be None, a dict or {cls.__name__}, got {type(value).__name__}")


# Where each optional part's config.json keys go (the records' field names are the keys).
_PARTS = {part: tuple(f.name for f in dataclasses.fields(cls))
          for part, cls in (("indexer", IndexerConfig), ("scalings", Scalings), ("layer_kinds", LayerKinds),
                            ("hyper_connections", HyperConnections))}


def grouped(kwargs: dict) -> dict:
    """``MLAConfig`` keyword arguments from flat ones: the optional parts' keys (``index_topk``,
    ``embedding_scale``, ``kv_source_layers``, ...) gathered into their records."""
    out = dict(kwargs)
    for part, keys in _PARTS.items():
        values = {key: out.pop(key) for key in keys if key in out}
        if values:
            if part in out:
                raise TypeError(f"{part} and its fields {sorted(values)} both given: pass one")
            out[part] = values
    return out


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
    topk_method: str = "greedy"  # "greedy", "group_limited_greedy" (V2), "noaux_tc" (V3), "group_top2" (Mistral 4)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    tie_word_embeddings: bool = False
    dtype: Optional[str] = None  # the checkpoint's dtype ("bfloat16"): from_pretrained's default
    wrapper: Optional[str] = None  # the text model of this multimodal model type ("kimi_k25"): its checkpoint names
    learned_rope_frequencies: bool = False  # Mistral Large 4's: inv_freq * exp(model.rotary_emb.alpha)
    # The layer structure: "deepseek" (attention + MLP or MoE) or "longcat" (LongCat-Flash: two attention
    # sublayers, two dense MLPs and a shortcut MoE per layer; mla_ops.models.longcat).
    decoder_layer: str = "deepseek"
    zero_expert_num: int = 0  # identity experts routed after the n_routed_experts (LongCat-Flash)
    # A.X-K1's: an RMSNorm (the layer's post_mlp_layernorm) on the MoE layers' MLP output, before its
    # residual add; and a checkpoint may leave out e_score_correction_bias (zeros: its releases have none).
    post_mlp_layernorm: bool = False
    optional_correction_bias: bool = False
    # dots3_note's attention: an RMSNorm (self_attn.k_rope_only_layernorm, eps rms_norm_eps) on k_pe before RoPE,
    # and a per-head sigmoid gate on the attention output (self_attn.g_proj: hidden_size -> N), before o_proj
    k_rope_norm: bool = False
    head_gate: bool = False
    # The shared experts' intermediate size, times n_shared_experts (None: moe_intermediate_size; dots3_note's own)
    shared_expert_intermediate_size: Optional[int] = None
    # A second kind of attention layer (layer_kinds.attention_types "sliding"): a window and its own geometry
    sliding_attention: Optional[SlidingAttention] = None
    # The optional parts, each a small record (a dict is read as its fields): DeepSeek Sparse Attention's
    # indexer (None: dense MLA), the families' scalings, and what differs from layer to layer.
    indexer: Optional[IndexerConfig] = None
    scalings: Scalings = field(default_factory=Scalings)
    layer_kinds: LayerKinds = field(default_factory=LayerKinds)
    # The autumn-2026 DSA families' model parts (DESIGN §11). output_gate: a per-head, per-dim sigmoid gate on the
    # attention output before o_proj, from the attention's input ("hidden": gate_proj, HY-V4) or from one fused
    # projection with the query ("query": q_gate_proj over [normed, raw] q-LoRA latent, no q_b_proj, A.X-K2);
    # attention_sinks: a learned sink logit per head (self_attn.sinks, HY-V4); swiglu_limit: the routed experts'
    # SwiGLU clamps gate <= limit, |up| <= limit (HY-V4); gated_norm_rank: the input norm of every layer and the
    # post-attention norm of MoE layers are RMSNorms times a rank-r sigmoid gate (A.X-K2); hyper_connections: the
    # residual streams of decoder_layer "hyper" (HY-V4).
    output_gate: Optional[str] = None
    attention_sinks: bool = False
    swiglu_limit: Optional[float] = None
    gated_norm_rank: Optional[int] = None
    hyper_connections: Optional[HyperConnections] = None

    def __post_init__(self):
        # Types and ranges of every field (normalized: numpy integers -> int, ints -> float where real).
        for name, least in _INTS.items():
            setattr(self, name, _checks.check_int(getattr(self, name), name, least))
        for name in _OPTIONAL_INTS:
            setattr(self, name, _checks.check_int(getattr(self, name), name, 1, optional=True))
        for name, positive in _REALS.items():
            setattr(self, name, _checks.check_real(getattr(self, name), name, positive))
        for name in _BOOLS:
            _checks.check_bool(getattr(self, name), name)
        _checks.check_str(self.scoring_func, "scoring_func")
        _checks.check_str(self.topk_method, "topk_method")
        _checks.check_str(self.decoder_layer, "decoder_layer", DECODER_LAYERS)
        _checks.model_dtype(self.dtype, "dtype")
        if self.wrapper is not None:
            _checks.check_str(self.wrapper, "wrapper")  # a known one: where its names are read (models.wrappers)
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = read_rope_scaling(self.rope_scaling, self.max_position_embeddings)
        elif isinstance(self.rope_scaling, YarnScaling):
            check_yarn(self.rope_scaling, "rope_scaling")
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, LongRopeScaling):
            raise TypeError(f"rope_scaling must be None, a dict (config.json's), a YarnScaling or a LongRopeScaling, "
                            f"got {type(self.rope_scaling).__name__}")
        self.indexer = _record(self.indexer, IndexerConfig, "indexer")
        self.scalings = _record(self.scalings, Scalings, "scalings")
        self.layer_kinds = _record(self.layer_kinds, LayerKinds, "layer_kinds")
        self.hyper_connections = _record(self.hyper_connections, HyperConnections, "hyper_connections")
        self._check_dsa_family_parts()
        if self.scalings is None or self.layer_kinds is None:
            raise TypeError(f"{'scalings' if self.scalings is None else 'layer_kinds'} must be a dict or a record, "
                            "not None (its defaults: none)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if isinstance(self.rope_scaling, LongRopeScaling):
            self.rope_scaling.check_rope_dim(self.qk_rope_head_dim)
        _check_mlp_layer_types(self)
        self._check_layer_structure()
        self._check_indexer()
        _check_mistral_large4_layers(self)
        _check_sliding_attention(self)
        if self.n_routed_experts is None:
            return
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        experts = self.n_routed_experts + self.zero_expert_num  # identity experts are routed to as well
        if not 1 <= self.num_experts_per_tok <= experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, n_routed_experts + zero_expert_num={experts}], "
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
        if self.topk_method in _TOP2_GROUPS and self.n_routed_experts // self.n_group < 2:
            raise ValueError(f"topk_method {self.topk_method!r} scores a group by its top-2 experts: needs >= 2 "
                             "experts per group")

    def _check_layer_structure(self) -> None:
        longcat = self.decoder_layer == "longcat"
        if longcat and self.n_routed_experts is None:
            raise ValueError("decoder_layer 'longcat' has a shortcut MoE in every layer: n_routed_experts must be set")
        for name in ("mla_scale_q_lora", "mla_scale_kv_lora"):
            if getattr(self.scalings, name) and not longcat:
                raise ValueError(f"{name}=True scales LongCat-Flash's attention: it needs decoder_layer 'longcat', "
                                 f"got {self.decoder_layer!r}")
        if self.post_mlp_layernorm and longcat:
            raise ValueError("post_mlp_layernorm=True norms the MoE output of decoder_layer 'deepseek' (A.X-K1's); "
                             "decoder_layer 'longcat' has none")
        if self.scalings.lora_latent_scales and (longcat or self.q_lora_rank is None):
            raise ValueError("lora_latent_scales=True scales the q-LoRA latent of decoder_layer 'deepseek': it needs "
                             "q_lora_rank set (LongCat-Flash's scalings are mla_scale_*)")
        if self.scalings.mla_scale_q_lora and self.q_lora_rank is None:
            raise ValueError("mla_scale_q_lora=True scales q by sqrt(hidden_size / q_lora_rank): q_lora_rank must be "
                             "set")
        if self.zero_expert_num and (self.n_routed_experts is None or self.n_group != 1):
            raise ValueError(f"zero_expert_num={self.zero_expert_num} identity experts need routed experts and "
                             f"n_group 1 (one group over all experts), got n_routed_experts={self.n_routed_experts}, "
                             f"n_group={self.n_group}")

    def _check_dsa_family_parts(self) -> None:
        """``output_gate``, ``attention_sinks``, ``swiglu_limit``, ``gated_norm_rank``, ``hyper_connections``."""
        if self.output_gate is not None:
            _checks.check_str(self.output_gate, "output_gate", OUTPUT_GATES)
            if self.output_gate == "query" and self.q_lora_rank is None:
                raise ValueError("output_gate 'query' is fused with the query's projection of the q-LoRA latent: "
                                 "q_lora_rank must be set")
        _checks.check_bool(self.attention_sinks, "attention_sinks")
        self.swiglu_limit = _checks.check_real(self.swiglu_limit, "swiglu_limit", optional=True)
        self.gated_norm_rank = _checks.check_int(self.gated_norm_rank, "gated_norm_rank", 1, optional=True)
        if (self.hyper_connections is not None) != (self.decoder_layer == "hyper"):
            raise ValueError("hyper_connections and decoder_layer 'hyper' go together: got hyper_connections="
                             f"{self.hyper_connections}, decoder_layer={self.decoder_layer!r}")

    def _check_indexer(self) -> None:
        kinds = self.layer_kinds
        if self.indexer is None:
            if kinds.indexer_types is not None:
                raise ValueError("indexer_types is set but index_topk is None (no indexer): set index_topk or "
                                 "leave indexer_types None")
            return
        if self.decoder_layer == "longcat":
            raise ValueError(f"index_topk: only decoder_layers 'deepseek' and 'hyper' have an indexer, got "
                             f"{self.decoder_layer!r}")
        if self.q_lora_rank is None and not self.indexer.indexer_q_norm:
            raise ValueError("index_topk is set but q_lora_rank is None: the indexer's wq_b reads the q-LoRA latent "
                             "(or, with indexer_q_norm, a LayerNorm of the layer input)")
        if self.indexer.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"index_head_dim ({self.indexer.index_head_dim}) must hold the qk_rope_head_dim "
                             f"({self.qk_rope_head_dim}) rotated dims")
        if not _check_layer_list(self, "indexer_types", INDEXER_TYPES):
            return
        if kinds.indexer_types[0] != "full":
            raise ValueError("indexer_types[0] must be 'full': a 'shared' layer reuses the top-k of a full layer "
                             "before it")

    @property
    def is_sparse(self) -> bool:
        """DeepSeek Sparse Attention: the layers select their keys with an indexer (``indexer``)."""
        return self.indexer is not None

    @property
    def index_topk(self) -> int | None:
        """K_I, the keys each query's MLA sees (``indexer.index_topk``); None: dense MLA."""
        return None if self.indexer is None else self.indexer.index_topk

    def has_indexer(self, layer_idx: int) -> bool:
        """Layer ``layer_idx`` runs its own indexer (a "full" layer of a sparse model; never a sliding layer)."""
        types = self.layer_kinds.indexer_types
        return self.is_sparse and not self.is_sliding(layer_idx) and (types is None or types[layer_idx] == "full")

    def reuses_topk(self, layer_idx: int) -> bool:
        """Layer ``layer_idx`` attends the last full layer's top-k (a "shared" layer of a sparse model)."""
        return self.is_sparse and not self.is_sliding(layer_idx) and not self.has_indexer(layer_idx)

    def is_sliding(self, layer_idx: int) -> bool:
        """Layer ``layer_idx`` is a sliding-window layer (``sliding_attention``'s geometry and window)."""
        types = self.layer_kinds.attention_types
        return types is not None and types[layer_idx] == "sliding"

    def attention_dims(self, layer_idx: int) -> AttentionDims:
        """Layer ``layer_idx``'s attention geometry: the config's own, or ``sliding_attention``'s where set."""
        s = self.sliding_attention if self.is_sliding(layer_idx) else None

        def pick(name):
            return getattr(self, name) if s is None or getattr(s, name) is None else getattr(s, name)

        L, R = pick("kv_lora_rank"), pick("qk_rope_head_dim")
        P, rope = (pick("qk_nope_head_dim"), R) if self.uses_rope(layer_idx) else (pick("qk_nope_head_dim") + R, 0)
        return AttentionDims(pick("num_attention_heads"), pick("q_lora_rank"), L, P, rope, pick("v_head_dim"), L + R,
                             0 if s is None else s.sliding_window, int(s is not None))

    def layer_softmax_scale(self, layer_idx: int) -> float:
        """Layer ``layer_idx``'s softmax scale: ``softmax_scale``, or 1/sqrt(P+R) of a sliding layer (no YaRN)."""
        if not self.is_sliding(layer_idx):
            return self.softmax_scale
        dims = self.attention_dims(layer_idx)
        return (dims.qk_nope_head_dim + dims.qk_rope_head_dim) ** -0.5

    @property
    def attention_kinds(self) -> tuple[int, ...]:
        """The kinds of attention the layers have (0: the config's own, 1: sliding): a step is planned per kind."""
        return tuple(sorted({self.attention_dims(i).kind for i in range(self.num_hidden_layers)}))

    @property
    def num_index_layers(self) -> int:
        """Index caches a sparse model keeps: one per full layer (a shared layer writes none)."""
        return sum(map(self.has_indexer, range(self.num_hidden_layers)))

    def uses_rope(self, layer_idx: int) -> bool:
        """Layer ``layer_idx`` rotates R dims of its queries and keys (False: a NoPE layer, R = 0)."""
        kinds = self.layer_kinds.no_rope_layers
        return kinds is None or bool(kinds[layer_idx])

    def layer_dims(self, layer_idx: int) -> tuple[int, int]:
        """(P, R) of layer ``layer_idx``: a NoPE layer's query and key heads are all nope, (P + R, 0)."""
        P, R = self.qk_nope_head_dim, self.qk_rope_head_dim
        return (P, R) if self.uses_rope(layer_idx) else (P + R, 0)

    def kv_source(self, layer_idx: int) -> int:
        """The layer whose latent cache layer ``layer_idx`` attends (itself unless it shares an earlier one's)."""
        sources = self.layer_kinds.kv_source_layers
        return layer_idx if sources is None else sources[layer_idx]

    @property
    def latent_layers(self) -> tuple[int, ...]:
        """The layers that write a latent cache of their own, in order (a KV-sharing layer writes none)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.kv_source(i) == i)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def default_absorb_max_query_len(self) -> int:
        """The routing default at this model's dims (``routing.default_threshold``): what its steps'
        ``absorb_max_query_len=None`` means in ``Generator`` and ``PrefillGraphs``."""
        return default_threshold(self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(P+R), times YaRN's mscale correction where the checkpoint has one."""
        scale = self.qk_head_dim ** -0.5
        return scale if self.rope_scaling is None else scale * self.rope_scaling.softmax_scale_factor()

    def is_moe_layer(self, layer_idx: int) -> bool:
        if self.layer_kinds.mlp_layer_types is not None:
            return self.layer_kinds.mlp_layer_types[layer_idx] == "sparse"
        return (self.n_routed_experts is not None and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

    @classmethod
    def from_name(cls, name: str) -> MLAConfig:
        if name not in mla_configs:
            raise ValueError(f"unknown MLAConfig name {name!r}; known: {sorted(mla_configs)}")
        return cls(**mla_configs[name])

    @classmethod
    def from_hf(cls, config) -> MLAConfig:
        """From a Hugging Face config: a dict, a config.json path, or a checkpoint directory (read by
        ``mla_ops.models.hf_config``)."""
        from .hf_config import from_hf  # the reader stands above the record it makes
        return from_hf(config)


def _int_list(value, name: str, num_layers: int) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be None or a list of one integer per layer, got {value!r}")
    if len(value) != num_layers:
        raise ValueError(f"{name} must have num_hidden_layers={num_layers} entries, got {len(value)}")
    return tuple(_checks.check_int(v, f"{name}[{i}]", 0) for i, v in enumerate(value))


def _check_mistral_large4_layers(c: MLAConfig) -> None:
    """``no_rope_layers`` and ``kv_source_layers`` (Mistral Large 4's)."""
    kinds = c.layer_kinds
    if (kinds.no_rope_layers is not None or kinds.kv_source_layers is not None) and not c.is_sparse:
        raise ValueError("no_rope_layers / kv_source_layers are Mistral Large 4's layer kinds, run by the sparse "
                         "layers (index_topk): set index_topk or leave them None")
    if kinds.no_rope_layers is not None:
        kinds.no_rope_layers = _int_list(kinds.no_rope_layers, "no_rope_layers", c.num_hidden_layers)
        for i, v in enumerate(kinds.no_rope_layers):
            if v not in (0, 1):
                raise ValueError(f"no_rope_layers[{i}] must be 1 (RoPE) or 0 (NoPE), got {v}")
    if kinds.kv_source_layers is None:
        return
    kinds.kv_source_layers = sources = _int_list(kinds.kv_source_layers, "kv_source_layers", c.num_hidden_layers)
    last_owner = {}  # RoPE kind -> the last layer so far that writes its own latent cache and is shared
    for i, s in enumerate(sources):
        if s > i or sources[s] != s:
            raise ValueError(f"kv_source_layers[{i}] is {s}: a layer shares the latent cache of itself or of an "
                             "earlier layer that owns its cache")
        if s == i:
            if i in sources[i + 1:]:
                last_owner[c.uses_rope(i)] = i
            continue
        # transformers hands a sharing layer the latest shared latent of its kind (RoPE or NoPE), whatever its
        # entry says: the two agree only if the entry names that layer.
        if last_owner.get(c.uses_rope(i)) != s:
            raise ValueError(f"kv_source_layers[{i}] is {s}, but the last shared layer of layer {i}'s kind "
                             f"({'RoPE' if c.uses_rope(i) else 'NoPE'}, no_rope_layers) before it is "
                             f"{last_owner.get(c.uses_rope(i))}: a layer shares the latest such layer's cache")


def _check_sliding_attention(c: MLAConfig) -> None:
    """``sliding_attention`` and ``layer_kinds.attention_types`` (dots3_note's): both or neither; only DeepSeek's
    layer without KV sharing or NoPE layers, and with a q-LoRA in both kinds if in one."""
    c.sliding_attention = _record(c.sliding_attention, SlidingAttention, "sliding_attention")
    has_types = _check_layer_list(c, "attention_types", ATTENTION_TYPES)
    if (c.sliding_attention is None) != (not has_types or "sliding" not in c.layer_kinds.attention_types):
        raise ValueError("sliding_attention and layer_kinds.attention_types go together: the 'sliding' layers take "
                         "sliding_attention's window and geometry (set both, or neither)")
    if c.sliding_attention is None:
        return
    kinds = c.layer_kinds
    if c.decoder_layer != "deepseek" or kinds.kv_source_layers is not None or kinds.no_rope_layers is not None:
        raise ValueError("sliding_attention: only decoder_layer 'deepseek' layers without kv_source_layers or "
                         "no_rope_layers have sliding layers")
    s = c.sliding_attention
    if s.qk_rope_head_dim is not None and s.qk_rope_head_dim % 2:
        raise ValueError(f"sliding_attention.qk_rope_head_dim must be even, got {s.qk_rope_head_dim}")
    if s.q_lora_rank is not None and c.q_lora_rank is None:
        raise ValueError("sliding_attention.q_lora_rank is set but q_lora_rank is None: both kinds of layer have a "
                         "q-LoRA, or neither")


def _check_layer_list(c: MLAConfig, name: str, choices) -> bool:
    """``c.layer_kinds.<name>``: None (False), or one of ``choices`` per layer, made a tuple (True)."""
    kinds = getattr(c.layer_kinds, name)
    if kinds is None:
        return False
    if not isinstance(kinds, (list, tuple)):
        raise TypeError(f"{name} must be None or a list of {choices}, got {kinds!r}")
    if len(kinds) != c.num_hidden_layers:
        raise ValueError(f"{name} must have num_hidden_layers={c.num_hidden_layers} entries, got {len(kinds)}")
    for i, kind in enumerate(kinds):
        _checks.check_str(kind, f"{name}[{i}]", choices)
    setattr(c.layer_kinds, name, tuple(kinds))
    return True


def _check_mlp_layer_types(c: MLAConfig) -> None:
    if not _check_layer_list(c, "mlp_layer_types", MLP_LAYER_TYPES):
        return
    types = c.layer_kinds.mlp_layer_types
    if c.n_routed_experts is None and "sparse" in types:
        raise ValueError(f"mlp_layer_types[{types.index('sparse')}] is 'sparse' but n_routed_experts is "
                         "None (no experts)")


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
    # transformers' Mistral4Config defaults, whose docstring names mistralai/Mistral-Small-4-119B-2603.
    "mistral-small-4": dict(
        hidden_size=4096, num_attention_heads=32, q_lora_rank=1024, kv_lora_rank=256,
        qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-6,
        intermediate_size=12288, num_hidden_layers=36, vocab_size=131072, max_position_embeddings=1048576,
        rope_scaling=dict(type="yarn", factor=128, original_max_position_embeddings=8192, beta_fast=32, beta_slow=1,
                          mscale=1.0, mscale_all_dim=1.0),
        n_routed_experts=128, num_experts_per_tok=4, moe_intermediate_size=2048, n_shared_experts=1,
        first_k_dense_replace=0, moe_layer_freq=1, scoring_func="softmax", topk_method="group_top2", n_group=1,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, tie_word_embeddings=False,
        dtype="bfloat16", scalings=dict(query_scale=dict(beta=0.1, original_max_position_embeddings=8192)),
    ),
    # dots3_note's layer kinds at tiny dims (tests, examples): DSA layers 0, 1, 5 (N 4, L 32, P 16, R 8, an indexer
    # of 16 x 16 selecting 8 keys) and sliding-window layers 2-4 (window 6, N 2, q-LoRA 24, L 48, P 24, V 8, theta
    # 50,000: 56-wide cache rows beside 40-wide ones); its latent scales, k_pe norm, per-head gate and experts.
    "dots3-note-tiny": dict(
        hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, rope_theta=80_000_000.0, rms_norm_eps=1e-5, lora_norm_eps=1e-5,
        intermediate_size=96, num_hidden_layers=6, vocab_size=96, max_position_embeddings=128, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, shared_expert_intermediate_size=24,
        scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, k_rope_norm=True, head_gate=True,
        indexer=dict(index_topk=8, index_n_heads=16, index_head_dim=16, indexer_rope_interleave=True),
        scalings=dict(lora_latent_scales=True),
        layer_kinds=dict(mlp_layer_types=("dense",) + ("sparse",) * 5,
                         attention_types=("full", "full", "sliding", "sliding", "sliding", "full")),
        sliding_attention=dict(sliding_window=6, num_attention_heads=2, q_lora_rank=24, kv_lora_rank=48,
                               qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=8, rope_theta=50_000.0),
    ),
    "tiny": dict(  # for tests: dense, no YaRN
        hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_theta=10000.0,
        rms_norm_eps=1e-6, intermediate_size=128, num_hidden_layers=2, vocab_size=256,
    ),    # HY-V4 at tiny dims (GLM-5's shapes scaled down; the families' parts as mla_ops.models.hy_v4 fixes them):
    # 3 layers, dense then MoE, indexers full, full, shared; 3 hyper-connection streams
    "tiny-hy-v4": dict(
        hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=24,
        qk_rope_head_dim=8, v_head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5, intermediate_size=96,
        num_hidden_layers=3, vocab_size=256, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
        routed_scaling_factor=2.827, decoder_layer="hyper", output_gate="hidden", attention_sinks=True,
        swiglu_limit=10.0, hyper_connections=dict(hc_mult=3),
        indexer=dict(index_topk=8, index_n_heads=4, index_head_dim=16, indexer_rope_interleave=True,
                     indexer_rope_last=True, indexer_norm_eps=1e-5),
        layer_kinds=dict(mlp_layer_types=["dense", "sparse", "sparse"], indexer_types=["full", "full", "shared"]),
    ),
    # A.X-K2 at tiny dims (V3.2's layers; the families' parts as mla_ops.models.axk2 fixes them): 3 layers, dense
    # then MoE (2 groups), 40-wide latent rows, the query fused with the output gate, gated norms of rank 4
    "tiny-axk2": dict(
        hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, intermediate_size=96,
        num_hidden_layers=3, vocab_size=256, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, scoring_func="sigmoid", topk_method="noaux_tc_zero", n_group=2,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, output_gate="query", gated_norm_rank=4,
        indexer=dict(index_topk=8, index_n_heads=4, index_head_dim=16),
    ),
}
