"""One decoder layer of the MLA decoder (DeepSeek-V2/V3's): its attention (``MLAAttention``), its norms and
the step it runs on (``ModelStep``). Its parts are the regions of ``mla_ops.models.regions``: nested regions
under ``torch.compile(model)`` (the part before the cache write, and the attention with the rest), or the
dense parts alone for regional compilation.

T new tokens (all requests, concatenated)   H hidden_size        N num_attention_heads
L kv_lora_rank   P qk_nope_head_dim   R qk_rope_head_dim   V v_head_dim
kv_cache  [num_blocks, block_size, L+R]   one latent row [kv_c | k_pe] per token, k_pe rotated
index_cache  [num_blocks, block_size, D_I]   a sparse (DSA) layer's index keys (same blocks)
topk      [T, index_topk] int32   the keys each query attends (a sparse step's; -1 padding)

A sparse model's layers (``MLAConfig.index_topk``) add the lightning indexer (``mla_ops.models.indexer``) and
run through ``DecoderLayer.forward_sparse``: a full layer writes its index keys and selects its top-k
(``mla_ops.index_topk``); a "shared" layer (GLM-5) has no indexer and attends the top-k it is handed, the
previous full layer's of the same step, computed once.

Families with a layer structure of their own (LongCat-Flash: ``mla_ops.models.longcat``) build theirs
from these parts; ``mla_ops.models.decoder`` picks a model's layer class by ``MLAConfig.decoder_layer``.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
from torch import nn

from ..ops.cache import write_index_cache
from ..ops.indexer import index_topk
from ..parallel.tensor_parallel import all_reduce
from ..planning.plan import PrefillPlan, check_step_tensors
from ..prefill import PrefillStep, begin_step
from .config import MLAConfig
from .indexer import Indexer
from .mistral_large4 import LogPositionScale, log_positions
from .moe import FeedForward, MoE, linear
from .regions import CompiledRegion, nested
from .rope import acc_dtype, apply_rotary_emb, rotary_cos_sin


class ModelStep(NamedTuple):
    """What the layers use that depends only on the step: made once per step, shared by every layer."""

    cos: torch.Tensor  # [T, R] rotary cos / sin of the step's positions
    sin: torch.Tensor
    attention: PrefillStep  # the plan checked against the caches and slots, the kernels chosen
    q_scale: torch.Tensor | None = None  # [T] per-token query factors (config.query_scale), or None
    k_scale_index: torch.Tensor | float | None = None  # a float8 index cache's scale (sparse models)
    log_positions: torch.Tensor | None = None  # [T] log(position + 1) (config.learned_query_scale), or None

    @classmethod
    def begin(cls, config: MLAConfig, positions, plan, kv_caches, slot_mapping, k_scale, backend,
              dtype, k_scale_index=None, rope_alpha=None) -> ModelStep:
        """``rope_alpha``: the model's learned RoPE log-factors (``config.learned_rope_frequencies``)."""
        attention = begin_step(plan, kv_caches, slot_mapping, k_scale=k_scale, backend=backend)
        cos, sin = rotary_cos_sin(positions, config.qk_rope_head_dim, config.rope_theta, dtype, config.rope_scaling,
                                  rope_alpha)
        q_scale = None if config.query_scale is None else config.query_scale.scales(positions, dtype)
        logs = log_positions(positions, dtype) if config.learned_query_scale else None
        return cls(cos, sin, attention, q_scale, k_scale_index, logs)


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
        self.num_heads = c.num_attention_heads
        self.kv_lora_rank = c.kv_lora_rank
        # A NoPE layer's (no_rope_layers): P + R nope dims, R = 0 (an L-wide latent row, nothing rotated)
        self.qk_nope_head_dim, self.qk_rope_head_dim = c.layer_dims(layer_idx)
        self.v_head_dim = c.v_head_dim
        # KV sharing (kv_source_layers): a layer that attends an earlier layer's latent cache makes no latent rows
        self.owns_kv = c.kv_source(layer_idx) == layer_idx
        self.config = config  # rotary frequencies (YaRN or plain RoPE): ModelStep.begin
        self.softmax_scale = c.softmax_scale  # 1/sqrt(P+R), times YaRN's mscale correction

        self.q_lora_rank = c.q_lora_rank
        if c.q_lora_rank is None:
            self.q_proj = linear(c.hidden_size, c.num_attention_heads * c.qk_head_dim, std)
        else:
            self.q_a_proj = linear(c.hidden_size, c.q_lora_rank, std)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.lora_norm_eps)
            self.q_b_proj = linear(c.q_lora_rank, c.num_attention_heads * c.qk_head_dim, std)
        P, R = self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.owns_kv:
            self.kv_a_proj_with_mqa = linear(c.hidden_size, c.kv_lora_rank + R, std)
            self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.lora_norm_eps)
        self.kv_b_proj = linear(c.kv_lora_rank, c.num_attention_heads * (P + c.v_head_dim), std)
        self.o_proj = linear(c.num_attention_heads * c.v_head_dim, c.hidden_size, std)
        # Mistral Large 4's learned per-head query scale (mla_ops.models.mistral_large4), or None
        self.softmax_scaling = LogPositionScale(c.num_attention_heads) if c.learned_query_scale else None
        # DeepSeek Sparse Attention: a layer's own indexer, or None (dense, or a "shared" layer of a sparse model)
        self.sparse = c.is_sparse
        self.indexer = Indexer(c, layer_idx) if c.has_indexer(layer_idx) else None

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, L+R]
        slot_mapping: torch.Tensor,  # [T] int64/int32, negative = padding (not written)
        block_table: torch.Tensor,  # [B, max_blocks] int32: the plan's
        plan: PrefillPlan,
        *,
        k_scale: float | torch.Tensor | None = None,
        backend: str = "auto",
    ) -> torch.Tensor:
        """The layer alone: a step of its own (``MLAModel`` begins one for all its layers)."""
        if self.sparse:
            raise ValueError("a sparse (index_topk) attention runs in its model (MLAModel), which keeps its index "
                             "cache and the step's top-k")
        check_plan_block_table(block_table, plan)
        step = ModelStep.begin(self.config, positions, plan, kv_cache, slot_mapping, k_scale, backend, hidden.dtype)
        q, kv_c, k_pe = self.project(hidden, step.cos, step.sin)
        return all_reduce(self.o_proj(self.attend(q, kv_c, k_pe, kv_cache, step).flatten(1)), self.tp_group)

    def project(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The dense part before attention: rotated queries ``q`` [T, N, P+R] and the new tokens'
        latent rows ``kv_c`` [T, L] and rotated ``k_pe`` [T, R] (both None for a KV-sharing layer; R = 0 for
        a NoPE layer, whose P is P + R); with an indexer also its ``q_index`` [T, H_I, D_I], ``weights``
        [T, H_I] and ``k_index`` [T, D_I] (``mla_ops.models.indexer``)."""
        num_tokens = hidden.shape[0]
        N, L, P, R = self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)  # [T, N*(P+R)]
            q_resid = None  # an indexer then reads the layer input itself (indexer_q_norm)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))  # [T, q_lora_rank]
            q = self.q_b_proj(q_resid)  # [T, N*(P+R)]
        if R:  # a NoPE layer (R = 0) rotates nothing
            q_nope, q_pe = q.view(num_tokens, N, P + R).split([P, R], dim=-1)  # [T, N, P], [T, N, R]
            q = torch.cat([q_nope, apply_rotary_emb(q_pe, cos[:, None, :], sin[:, None, :])], dim=-1)  # [T, N, P+R]
        else:
            q = q.view(num_tokens, N, P)
        latent = (q, None, None)  # a KV-sharing layer's keys are its source layer's
        if self.owns_kv:
            kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split([L, R], dim=-1)  # [T, L], [T, R]
            latent = (q, self.kv_a_layernorm(kv_c), apply_rotary_emb(k_pe, cos, sin) if R else k_pe)
        return latent if self.indexer is None else latent + self.indexer(hidden, q_resid, cos, sin)

    def attend(self, q, kv_c, k_pe, kv_cache, step: ModelStep, write: bool = True) -> torch.Tensor:
        """Write the new rows into the cache and attend (``PrefillStep.run``): ``[T, N, V]``, before
        ``o_proj``. Everything is checked before the cache is written: a rejected call writes nothing.
        ``write=False``: the rows are in already (``write``)."""
        return step.attention.run(self.scaled_queries(q, step), kv_c, k_pe, kv_cache, self.kv_b_proj.weight,
                                  self.softmax_scale, write=self.owns_kv and write)

    def write(self, kv_c, k_pe, kv_cache, step: ModelStep, k_index=None, index_cache=None) -> None:
        """The new tokens' latent rows into ``kv_cache`` (none for a KV-sharing layer) and, with an indexer,
        their index keys ``k_index`` into ``index_cache``, at the step's slots (nothing without a slot mapping)."""
        if self.indexer is not None and step.attention.slot_mapping is not None:
            write_index_cache(k_index, step.attention.slot_mapping, index_cache, step.k_scale_index)
        if self.owns_kv:
            step.attention.write(kv_c, k_pe, kv_cache)

    def scaled_queries(self, q: torch.Tensor, step: ModelStep) -> torch.Tensor:
        """q [T, N, P+R] times the step's per-token factors (Mistral 4) or the learned per-head ones (Mistral
        Large 4): per token, so not in the softmax scale, the same for every attention path."""
        if step.q_scale is not None:
            q = (q.to(step.q_scale.dtype) * step.q_scale[:, None, None]).to(q.dtype)
        if self.softmax_scaling is not None:
            q = self.softmax_scaling(q, step.log_positions)
        return q

    def attend_sparse(self, q, kv_c, k_pe, kv_cache, step: ModelStep, index, index_cache, topk,
                      write: bool = True):
        """``attend`` over each query's selected keys: with an indexer (``index`` = its q_index, weights,
        k_index) this layer's top-k, its index keys written into ``index_cache``; without (a shared layer)
        ``topk``, the step's from its full layer. Returns ([T, N, V], the top-k it attended). ``write=False``:
        the rows and index keys are in already (``write``)."""
        if self.indexer is not None:
            q_index, weights, k_index = index
            q_index = self.indexer.scaled_queries(q_index, step.log_positions)
            topk = index_topk(q_index, weights, k_index, index_cache, step.attention.plan,
                              k_scale_index=step.k_scale_index)  # scores the new keys as given: order is free
            if write and step.attention.slot_mapping is not None:
                write_index_cache(k_index, step.attention.slot_mapping, index_cache, step.k_scale_index)
        elif topk is None:
            raise ValueError("a shared DSA layer (indexer_types 'shared') needs the top-k of a full layer before it")
        out = step.attention.run(self.scaled_queries(q, step), kv_c, k_pe, kv_cache, self.kv_b_proj.weight,
                                 self.softmax_scale, topk_indices=topk, write=self.owns_kv and write)
        return out, topk


def check_plan_block_table(block_table: torch.Tensor, plan: PrefillPlan) -> None:
    """The layers read ``plan.block_table``; the ``block_table`` argument must be that table."""
    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan must be a PrefillPlan (mla_ops.plan_prefill), got {type(plan).__name__}")
    if not isinstance(block_table, torch.Tensor) or block_table.shape != plan.block_table.shape \
            or block_table.device != plan.block_table.device:
        raise ValueError(
            f"block_table does not fit plan: shape {tuple(getattr(block_table, 'shape', ()))}, the plan's "
            f"block table is {tuple(plan.block_table.shape)} on {plan.block_table.device}"
        )
    check_step_tensors(plan, block_table=block_table)


# A.X-K1's MoE output norm, by a checkpoint's names (DecoderLayer.checkpoint_name)
_POST_MLP_NORM = re.compile(r"^model\.layers\.(\d+)\.(?:mlp\.)?post_mlp_layernorm\.weight$")


class DecoderLayer(nn.Module):
    """Attention and MLP with pre-norm residuals. Its dense parts, ``attention_inputs`` and
    ``attention_output``, are the regions ``MLAModel.compile_layers`` compiles; the attention
    between them (cache write, plan, chunk loop) runs the library's ops. Otherwise (eager, and as
    nested regions under ``torch.compile``) it runs ``attention_inputs``, the cache write, then
    ``attention_and_output``."""

    num_kv_caches = 1  # cache layers per layer: one attention

    def __init__(self, config: MLAConfig, layer_idx: int = 0, tp_group=None):
        super().__init__()
        self.tp_group = tp_group  # tensor parallel: the partial sums of o_proj and the MLP are all-reduced
        self.residual_scale = config.residual_scale  # MiniCPM3's; 1: none
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAAttention(config, tp_group, layer_idx)
        if not self.self_attn.owns_kv:
            self.num_kv_caches = 0  # a KV-sharing layer attends its source layer's latent cache
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(layer_idx):
            self.mlp = MoE(config)
        else:
            self.mlp = FeedForward(config.hidden_size, config.intermediate_size, config.initializer_range)
        # A.X-K1's norm of the MoE output (after the all-reduce: whole, not on partial sums); None: none
        self.post_mlp_layernorm = None
        if config.post_mlp_layernorm and config.is_moe_layer(layer_idx):
            self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.regions: tuple[CompiledRegion, CompiledRegion] | None = None  # compiled by MLAModel.compile_layers

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, step: ModelStep) -> torch.Tensor:
        """``x`` [T, H] -> the residual stream after the layer; ``step``: ``ModelStep.begin``'s, shared
        by every layer of the step."""
        if self.regions is not None:
            inputs, output = self.regions
            q, kv_c, k_pe = inputs(self, x, step.cos, step.sin)
            return output(self, x, self.self_attn.attend(q, kv_c, k_pe, kv_cache, step))
        inputs, rest, _ = layer_parts(self, step)
        q, kv_c, k_pe = inputs(self, x, step.cos, step.sin)
        self.self_attn.write(kv_c, k_pe, kv_cache, step)
        return rest(self, x, q, kv_c, k_pe, kv_cache, step)

    def forward_sparse(self, x: torch.Tensor, kv_cache: torch.Tensor, index_cache: torch.Tensor | None,
                       step: ModelStep, topk: torch.Tensor | None, shared_latent=None):
        """A sparse model's layer: ``forward`` with the lightning indexer (module doc). ``kv_cache``: the
        latent cache it attends (its own, or its KV source layer's); ``index_cache``: this layer's (None for a
        shared layer); ``topk``: the step's last full layer's (None before the first); ``shared_latent``: a
        KV-sharing layer's source's (kv_c, k_pe) of the step's new tokens. Returns (the residual stream after
        the layer, the top-k the next shared layer reuses, the (kv_c, k_pe) it attended)."""
        parts = layer_parts(self, step)
        inputs = parts[0] if self.regions is None else self.regions[0]
        q, kv_c, k_pe, *index = inputs(self, x, step.cos, step.sin)
        if not self.self_attn.owns_kv:
            if shared_latent is None:
                raise ValueError("a KV-sharing layer (kv_source_layers) needs its source layer's new latent rows")
            kv_c, k_pe = shared_latent
        if self.regions is not None:  # regional compilation: the attention runs eagerly between its regions
            attention, topk = self.self_attn.attend_sparse(q, kv_c, k_pe, kv_cache, step, index, index_cache, topk)
            return self.regions[1](self, x, attention), topk, (kv_c, k_pe)
        self.self_attn.write(kv_c, k_pe, kv_cache, step, index[2] if index else None, index_cache)
        out = parts[2](self, x, q, kv_c, k_pe, kv_cache, step, tuple(index), index_cache, topk)
        x, topk = out if self.self_attn.indexer is not None else (out, topk)
        return x, topk, (kv_c, k_pe)

    def attention_inputs(self, x, cos, sin):
        """``x`` [T, H] -> the attention's ``q``, ``kv_c``, ``k_pe`` (``MLAAttention.project``)."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def attention_and_output(self, x, q, kv_c, k_pe, kv_cache, step: ModelStep):
        """The layer after its cache write: the attention (``MLAAttention.attend``, writing nothing) and
        ``attention_output``."""
        return self.attention_output(x, self.self_attn.attend(q, kv_c, k_pe, kv_cache, step, write=False))

    def sparse_attention_and_output(self, x, q, kv_c, k_pe, kv_cache, step: ModelStep, index, index_cache, topk):
        """``attention_and_output`` of a sparse layer (``forward_sparse``): the residual stream, and with an
        indexer the top-k it selected (a shared layer's is its input: a region returns no input)."""
        attention, selected = self.self_attn.attend_sparse(q, kv_c, k_pe, kv_cache, step, index, index_cache, topk,
                                                           write=False)
        out = self.attention_output(x, attention)
        return out if self.self_attn.indexer is None else (out, selected)

    def attention_output(self, x, attention):
        """The residual stream after the layer, from its input ``x`` and the attention's [T, N, V]."""
        h = x + scaled(all_reduce(self.self_attn.o_proj(attention.flatten(1)), self.tp_group), self.residual_scale)
        mlp = all_reduce(self.mlp(self.post_attention_layernorm(h)), self.tp_group)
        if self.post_mlp_layernorm is not None:
            mlp = self.post_mlp_layernorm(mlp)
        return h + scaled(mlp, self.residual_scale)

    # MLAModel.compile_layers' regions: (function, compiled per MLP kind)
    compiled_regions = ((attention_inputs, False), (attention_output, True))
    # forward's (and forward_sparse's) parts, plain; nested_parts: the same as nested regions (layer_parts)
    parts = (attention_inputs, attention_and_output, sparse_attention_and_output)

    @staticmethod
    def checkpoint_name(config: MLAConfig, name: str) -> str | None:
        """The model tensor that checkpoint tensor ``name`` fills (None: skipped): DeepSeek's names are the model's.
        With ``post_mlp_layernorm`` (A.X-K1) a layer's ``post_mlp_layernorm`` or ``mlp.post_mlp_layernorm`` (the
        name in transformers' model) is the MoE layer's norm, and skipped in a dense layer (its releases keep an
        unused copy there, which transformers ignores)."""
        norm = _POST_MLP_NORM.match(name) if config.post_mlp_layernorm else None
        if norm is None:
            return name
        layer = int(norm.group(1))
        return f"model.layers.{layer}.post_mlp_layernorm.weight" if config.is_moe_layer(layer) else None


DecoderLayer.nested_parts = tuple(nested(part) for part in DecoderLayer.parts)


def layer_parts(layer: nn.Module, step: ModelStep) -> tuple:
    """A layer's parts for this step (its class's ``parts``): as nested regions, but where the step's plan
    holds what a region cannot be handed (context parallel's process group)."""
    cls = type(layer)
    return cls.parts if step.attention.plan.context_parallel is not None else cls.nested_parts


def scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x * scale``; nothing for a scale of 1 (DeepSeek's), so its graphs stay as they were."""
    return x if scale == 1.0 else x * scale
