"""One decoder layer of the MLA decoder (DeepSeek-V2/V3's), its attention (``MLAAttention``), its norms and the
step they run on (``ModelStep``).

T new tokens (all requests, concatenated)   H hidden_size        N num_attention_heads
L kv_lora_rank   P qk_nope_head_dim   R qk_rope_head_dim   V v_head_dim
kv_cache  [num_blocks, block_size, L+R]   one latent row [kv_c | k_pe] per token, k_pe rotated
index_cache  [num_blocks, block_size, D_I]   a sparse (DSA) layer's index keys (same blocks)
topk      [T, index_topk] int32   the keys each query attends (a sparse step's; -1 padding)

A layer reads as a transformer block: ``h = x + attention(norm(x))``, ``out = h + mlp(norm(h))``. The attention
projects, attends (the step's new rows as given, the context's from the cache) and returns the rows it made
(``NewRows``), which the step writes into its caches (``ModelStep.write``): a layer has no side effects. A layer
is handed a small ``Carry`` from the layers before it: a sparse (DSA) step's top-k, which a layer with an
indexer selects (``mla_ops.index_topk``) and a "shared" layer (GLM-5) reuses, and the new latent rows of the
layer whose cache a KV-sharing layer attends (Mistral Large 4); which layer gets what is decided once, at
construction (``mla_ops.models.wiring``). How the layers run under eager, regional and whole-model compilation,
and when their rows are written, is ``mla_ops.models.regions``' business alone.

Families with a layer structure of their own (LongCat-Flash: ``mla_ops.models.longcat``) build theirs from
these parts; ``mla_ops.models.decoder`` picks a model's layer class by ``MLAConfig.decoder_layer``.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
from torch import nn

from ..parallel.tensor_parallel import all_reduce
from ..planning.plan import PrefillPlan
from ..step import PrefillStep, begin_step
from . import axk2
from .config import MLAConfig
from .gated_norm import GatedRMSNorm
from .indexer import Indexer
from .moe import FeedForward, MoE
from .output_gate import gated
from .parts import acc_dtype, linear
from .query_scale import LogPositionScale, log_positions
from .rope import apply_rotary_emb


class AttentionCaches(NamedTuple):
    """The caches one attention reads and writes, with their scales (a float8 cache's one-element tensor, else
    None): made once per step from the model's ``KVCaches`` (``mla_ops.models.wiring``)."""

    latent: torch.Tensor  # the latent cache it attends (a KV-sharing layer's: its source's, read only)
    k_scale: torch.Tensor | None = None
    index: torch.Tensor | None = None  # with an indexer of its own: its index cache
    k_scale_index: torch.Tensor | None = None


LayerCaches = tuple  # of AttentionCaches, one per attention of the layer


class Carry(NamedTuple):
    """What a layer is handed from the layers before it (module doc)."""

    topk: torch.Tensor | None = None  # [T, index_topk] int32: the last full DSA layer's selection (a shared layer)
    latent: tuple[torch.Tensor, torch.Tensor] | None = None  # (kv_c, k_pe): the new rows a KV-sharing layer attends


class NewRows(NamedTuple):
    """What a layer made for its caches and the layers after it: nothing of its inputs."""

    latent: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # (kv_c, k_pe) per attention with a cache of its own
    index: torch.Tensor | None = None  # [T, D_I] its indexer's keys
    topk: torch.Tensor | None = None  # [T, index_topk] its indexer's selection

    def __add__(self, other: NewRows) -> NewRows:
        """The rows of two attentions of one layer (LongCat-Flash's), in order."""
        return NewRows(self.latent + other.latent, self.index if other.index is None else other.index,
                       self.topk if other.topk is None else other.topk)


class ModelStep(NamedTuple):
    """What the layers use that depends only on the step: made once per step, shared by every layer."""

    cos: torch.Tensor  # [T, R] rotary cos / sin of the step's positions
    sin: torch.Tensor
    attention: PrefillStep  # the plan checked against the caches and slots (a DSA step's index caches too)
    q_scale: torch.Tensor | None = None  # [T] per-token query factors (config.scalings.query_scale), or None
    log_positions: torch.Tensor | None = None  # [T] log(position + 1) (scalings.learned_query_scale), or None

    @classmethod
    def begin(cls, model, positions: torch.Tensor, plan: PrefillPlan, caches, slot_mapping: torch.Tensor,
              backend: str, kind: int = 0) -> ModelStep:
        """``model``'s step (an ``MLAModel``: its rotary frequencies, position scales and dtype) over its checked
        ``caches`` (a ``KVCaches`` of one scale per layer) for the layers of attention ``kind`` (0: the config's
        own, 1: its sliding layers', whose ``plan`` has their window); the attention step is checked once, against
        the kind's first latent cache and the index caches (every layer of a kind shares their geometry)."""
        index = caches.index is not None and kind == 0
        first = model.first_cache_of_kind[kind]
        attention = begin_step(plan, caches.latent[first], slot_mapping, k_scale=caches.k_scale[first],
                               backend=backend, index_cache=caches.index[0] if index else None,
                               k_scale_index=caches.k_scale_index[0] if index else None,
                               kv_cache_format=caches.kv_cache_format, index_cache_format=caches.index_cache_format)
        dtype = model.embed_tokens.weight.dtype
        cos, sin = (model.rotary_emb if kind == 0 else model.sliding_rotary_emb)(positions, dtype)
        q_scale = None if model.position_scale is None else model.position_scale(positions, dtype)
        logs = log_positions(positions, dtype) if model.config.scalings.learned_query_scale else None
        return cls(cos, sin, attention, q_scale, logs)

    def write(self, caches: LayerCaches, made: NewRows) -> None:
        """A layer's new rows into its caches at the step's slots: each attention's latent rows into its own
        cache, the indexer's keys into its index cache (the one write: ``mla_ops.models.regions`` calls it)."""
        for cache, (kv_c, k_pe) in zip(caches, made.latent):
            self.attention.write(kv_c, k_pe, cache.latent, k_scale=cache.k_scale)
        if made.index is not None:
            self.attention.write_index(made.index, caches[0].index, k_scale_index=caches[0].k_scale_index)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(acc_dtype(x.dtype))
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


class MLAAttention(nn.Module):
    """``config``: the rank's own config under tensor parallel (``local_config``: N / D heads); ``tp_group``:
    the group whose ``o_proj`` partial sums are added up (None: one device)."""

    def __init__(self, config: MLAConfig, tp_group=None, layer_idx: int = 0):
        super().__init__()
        c, std = config, config.initializer_range
        self.tp_group = tp_group
        # The layer's geometry: the config's, or its sliding_attention's (dots3_note's sliding layers). A NoPE
        # layer's (no_rope_layers): P + R nope dims, R = 0 (an L-wide latent row, nothing rotated)
        dims = c.attention_dims(layer_idx)
        self.num_heads, self.kv_lora_rank, self.v_head_dim = dims.num_heads, dims.kv_lora_rank, dims.v_head_dim
        self.qk_nope_head_dim, self.qk_rope_head_dim = dims.qk_nope_head_dim, dims.qk_rope_head_dim
        # KV sharing (kv_source_layers): a layer that attends an earlier layer's latent cache makes no latent rows
        self.owns_kv = c.kv_source(layer_idx) == layer_idx
        self.softmax_scale = c.layer_softmax_scale(layer_idx)  # 1/sqrt(P+R), times YaRN's mscale correction

        N, Q, L, P, R, V = (dims.num_heads, dims.q_lora_rank, dims.kv_lora_rank, self.qk_nope_head_dim,
                            self.qk_rope_head_dim, dims.v_head_dim)
        self.q_lora_rank = Q
        self.output_gate = c.output_gate
        if c.output_gate == "query":  # A.X-K2: no q_b_proj; the query and the gate from one fused projection
            self.q_a_proj = linear(c.hidden_size, Q, std)
            self.q_a_layernorm = RMSNorm(Q, c.lora_norm_eps)
            self.q_gate_proj = linear(2 * Q, N * (P + R + V), std)
        elif Q is None:
            self.q_proj = linear(c.hidden_size, N * (P + R), std)
        else:
            self.q_a_proj = linear(c.hidden_size, Q, std)
            self.q_a_layernorm = RMSNorm(Q, c.lora_norm_eps)
            self.q_b_proj = linear(Q, N * (P + R), std)
        if self.owns_kv:
            self.kv_a_proj_with_mqa = linear(c.hidden_size, L + R, std)
            self.kv_a_layernorm = RMSNorm(L, c.lora_norm_eps)
        self.kv_b_proj = linear(L, N * (P + V), std)
        self.o_proj = linear(N * V, c.hidden_size, std)
        # dots3_note's latent scales (lora_latent_scales): 1.0 where none
        scaled = c.scalings.lora_latent_scales
        self.lora_q_scale = (c.hidden_size / Q) ** 0.5 if scaled and Q else 1.0
        self.lora_kv_scale = (c.hidden_size / L) ** 0.5 if scaled else 1.0
        # dots3_note's RMSNorm on k_pe before RoPE (k_rope_norm) and per-head output gate (head_gate), or None
        self.k_rope_only_layernorm = RMSNorm(R, c.rms_norm_eps) if c.k_rope_norm and self.owns_kv else None
        self.g_proj = linear(c.hidden_size, N, std) if c.head_gate else None
        # HY-V4's output gate from the attention's input (output_gate "hidden"), its sink logits (float32)
        if c.output_gate == "hidden":
            self.gate_proj = linear(c.hidden_size, N * V, std)
        self.sinks = nn.Parameter(torch.zeros(N)) if c.attention_sinks else None
        # Mistral Large 4's learned per-head query scale (mla_ops.models.mistral_large4), or None
        self.softmax_scaling = LogPositionScale(N) if c.scalings.learned_query_scale else None
        # DeepSeek Sparse Attention: a layer's own indexer, or None (dense, or a "shared" layer of a sparse model)
        self.indexer = Indexer(c, layer_idx) if c.has_indexer(layer_idx) else None

    def forward(self, hidden: torch.Tensor, caches: AttentionCaches, step: ModelStep,
                carry: Carry = Carry()) -> tuple[torch.Tensor, NewRows]:
        """``hidden`` [T, H] (normed) -> (this attention's output after ``o_proj`` [T, H], the rows it made).
        ``caches``: its latent cache (a KV-sharing layer's: its source's, whose new rows are ``carry.latent``) and,
        with an indexer, its index cache; a shared DSA layer attends ``carry.topk``. It writes nothing: the step
        writes the rows it returns (``ModelStep.write``), after every check has passed."""
        q, kv_c, k_pe, gate, *index = self.project(hidden, step.cos, step.sin)
        made = NewRows(((kv_c, k_pe),))
        if not self.owns_kv:
            kv_c, k_pe = carry.latent
            made = NewRows()
        topk = carry.topk
        if self.indexer is not None:
            q_index, weights, k_index = index
            q_index = self.indexer.scaled_queries(q_index, step.log_positions)
            topk = step.attention.select(q_index, weights, k_index, caches.index,  # scores the new keys as given
                                         k_scale_index=caches.k_scale_index)
            made = made._replace(index=k_index, topk=topk)
        out = step.attention.attend(self.scaled_queries(q, step), kv_c, k_pe, caches.latent, self.kv_b_proj.weight,
                                    self.softmax_scale, k_scale=caches.k_scale, topk_indices=topk,
                                    v_head_dim=self.v_head_dim,
                                    sinks=None if self.sinks is None else self.sinks.float())  # [T, N, V]
        if self.g_proj is not None:  # dots3_note's per-head gate, in the model's dtype as transformers'
            out = out * self.g_proj(hidden).sigmoid()[:, :, None]
        return all_reduce(self.o_proj(gated(out, gate).flatten(1)), self.tp_group), made

    def project(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The dense part before attention: rotated queries ``q`` [T, N, P+R] and the new tokens'
        latent rows ``kv_c`` [T, L] and rotated ``k_pe`` [T, R] (both None for a KV-sharing layer; R = 0 for
        a NoPE layer, whose P is P + R), the output gate's logits [T, N, V] (None without ``output_gate``); with an
        indexer also its ``q_index`` [T, H_I, D_I], ``weights`` [T, H_I] and ``k_index`` [T, D_I]
        (``mla_ops.models.indexer``)."""
        num_tokens = hidden.shape[0]
        N, L, P, R = self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim
        gate = None
        if self.output_gate == "query":  # [normed, raw] q-LoRA latent -> per head [P+R | V] (A.X-K2)
            q_compressed = self.q_a_proj(hidden)
            q_resid = self.q_a_layernorm(q_compressed)
            q, gate = self.q_gate_proj(torch.cat([q_resid, q_compressed], dim=-1)).view(
                num_tokens, N, P + R + self.v_head_dim).split([P + R, self.v_head_dim], dim=-1)
            q = q.reshape(num_tokens, N * (P + R))
        elif self.q_lora_rank is None:
            q = self.q_proj(hidden)  # [T, N*(P+R)]
            q_resid = None  # an indexer then reads the layer input itself (indexer_q_norm)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))  # [T, q_lora_rank]
            if self.lora_q_scale != 1.0:  # dots3_note's: the indexer reads the scaled latent too
                q_resid = q_resid * self.lora_q_scale
            q = self.q_b_proj(q_resid)  # [T, N*(P+R)]
        if R:  # a NoPE layer (R = 0) rotates nothing
            q_nope, q_pe = q.view(num_tokens, N, P + R).split([P, R], dim=-1)  # [T, N, P], [T, N, R]
            q = torch.cat([q_nope, apply_rotary_emb(q_pe, cos[:, None, :], sin[:, None, :])], dim=-1)  # [T, N, P+R]
        else:
            q = q.view(num_tokens, N, P)
        if self.output_gate == "hidden":  # from the attention's input (HY-V4)
            gate = self.gate_proj(hidden).view(num_tokens, N, self.v_head_dim)
        latent = (q, None, None, gate)  # a KV-sharing layer's keys are its source layer's
        if self.owns_kv:
            kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split([L, R], dim=-1)  # [T, L], [T, R]
            kv_c = self.kv_a_layernorm(kv_c)
            if self.lora_kv_scale != 1.0:
                kv_c = kv_c * self.lora_kv_scale
            if self.k_rope_only_layernorm is not None:
                k_pe = self.k_rope_only_layernorm(k_pe)
            latent = (q, kv_c, apply_rotary_emb(k_pe, cos, sin) if R else k_pe, gate)
        return latent if self.indexer is None else latent + self.indexer(hidden, q_resid, cos, sin)

    def scaled_queries(self, q: torch.Tensor, step: ModelStep) -> torch.Tensor:
        """q [T, N, P+R] times the step's per-token factors (Mistral 4) or the learned per-head ones (Mistral
        Large 4): per token, so not in the softmax scale, the same for every attention path."""
        if step.q_scale is not None:
            q = (q.to(step.q_scale.dtype) * step.q_scale[:, None, None]).to(q.dtype)
        if self.softmax_scaling is not None:
            q = self.softmax_scaling(q, step.log_positions)
        return q


# A.X-K1's MoE output norm, by a checkpoint's names (DecoderLayer.checkpoint_name)
_POST_MLP_NORM = re.compile(r"^model\.layers\.(\d+)\.(?:mlp\.)?post_mlp_layernorm\.weight$")


class DecoderLayer(nn.Module):
    """Attention and MLP (or mixture of experts) with pre-norm residuals (module doc)."""

    num_kv_caches = 1  # cache layers per layer: one attention

    def __init__(self, config: MLAConfig, layer_idx: int = 0, tp_group=None):
        super().__init__()
        self.tp_group = tp_group  # tensor parallel: the partial sums of o_proj and the MLP are all-reduced
        self.residual_scale = config.scalings.residual_scale  # MiniCPM3's; 1: none
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAAttention(config, tp_group, layer_idx)
        if not self.self_attn.owns_kv:
            self.num_kv_caches = 0  # a KV-sharing layer attends its source layer's latent cache
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.gated_norm_rank is not None:  # A.X-K2's: the input norm gated, and a MoE layer's second norm
            gate = lambda norm: GatedRMSNorm(norm, config.hidden_size, config.gated_norm_rank,  # noqa: E731
                                              config.initializer_range)
            self.input_layernorm = gate(self.input_layernorm)
            if config.is_moe_layer(layer_idx):
                self.post_attention_layernorm = gate(self.post_attention_layernorm)
        if config.is_moe_layer(layer_idx):
            self.mlp = MoE(config)
        else:
            self.mlp = FeedForward(config.hidden_size, config.intermediate_size, config.initializer_range)
        # A.X-K1's norm of the MoE output (after the all-reduce: whole, not on partial sums); None: none
        self.post_mlp_layernorm = None
        if config.post_mlp_layernorm and config.is_moe_layer(layer_idx):
            self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, caches: LayerCaches, step: ModelStep,
                carry: Carry = Carry()) -> tuple[torch.Tensor, NewRows]:
        """``x`` [T, H] -> (the residual stream after the layer, the rows it made)."""
        attention, made = self.self_attn(self.input_layernorm(x), caches[0], step, carry)
        h = x + scaled(attention, self.residual_scale)
        mlp = all_reduce(self.mlp(self.post_attention_layernorm(h)), self.tp_group)
        if self.post_mlp_layernorm is not None:
            mlp = self.post_mlp_layernorm(mlp)
        return h + scaled(mlp, self.residual_scale), made

    @staticmethod
    def checkpoint_name(config: MLAConfig, name: str) -> str | None:
        """The model tensor that checkpoint tensor ``name`` fills (None: skipped): DeepSeek's names are the model's.
        With ``post_mlp_layernorm`` (A.X-K1) a layer's ``post_mlp_layernorm`` or ``mlp.post_mlp_layernorm`` (the
        name in transformers' model) is the MoE layer's norm, and skipped in a dense layer (its releases keep an
        unused copy there, which transformers ignores). A.X-K2's fused ``q_b_proj`` and gate MLPs' ``W_down`` /
        ``W_up`` are renamed as transformers renames them (``axk2.transformers_name``)."""
        if config.output_gate == "query" or config.gated_norm_rank is not None:  # A.X-K2's release names
            name = axk2.transformers_name(name)
        norm = _POST_MLP_NORM.match(name) if config.post_mlp_layernorm else None
        if norm is None:
            return name
        layer = int(norm.group(1))
        return f"model.layers.{layer}.post_mlp_layernorm.weight" if config.is_moe_layer(layer) else None


def scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x * scale``; nothing for a scale of 1 (DeepSeek's), so its graphs stay as they were."""
    return x if scale == 1.0 else x * scale
