"""The MLA decoder: an MLA attention layer, the decoder layer and the model, on the mla_ops operators.

DeepSeek-V2/V3's layout is the base; what other MLA families change (gates, MLP layouts, layer
structures, scalings, RoPE kinds, checkpoint names) is data of ``MLAConfig``, read by the small named
parts of ``mla_ops.models`` (DESIGN §11), not branches here.

T new tokens (all requests, concatenated)   H hidden_size        N num_attention_heads
L kv_lora_rank   P qk_nope_head_dim   R qk_rope_head_dim   V v_head_dim   B requests
kv_cache  [num_blocks, block_size, L+R]   one latent row [kv_c | k_pe] per token, k_pe rotated

Module and parameter names follow DeepSeek's and transformers' (``q_a_proj``, ``kv_a_proj_with_mqa``,
``kv_b_proj``, ``mlp.experts.gate_up_proj``, ``lm_head``, ...), so a checkpoint's tensors map by name;
``mla_ops.models.checkpoint`` converts the rest once at load (interleaved RoPE rows to the halves the layers
rotate, per-expert tensors to stacked ones, float8 blocks to the model dtype). YaRN frequencies and
their softmax-scale correction come from the config (``mla_ops.models.rope``); layers from
``first_k_dense_replace`` on (or those ``mlp_layer_types`` calls "sparse") have DeepSeek's mixture of experts
(``mla_ops.models.moe``). MiniCPM3's scalings (``embedding_scale``, ``residual_scale``, ``logits_scaling``)
are config values, 1 (nothing done) for the others.

The cache tensors, slot mapping, block table and the step's ``PrefillPlan`` (``mla_ops.plan_prefill``,
made once per step) are passed in on every call; nothing is stored in the modules. ``MLAModel``
begins the step once (``ModelStep``: the rotary tables and ``mla_ops.begin_step``'s checked
attention step) and every layer makes one attention call on it: with a device plan
(``max_chunks=K``) the whole step reads no device value and compiles to one graph, the planner
running once however many layers there are.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import torch
from torch import nn

from .. import _checks
from .._env import own_code
from ..parallel import ContextParallel
from ..parallel.tensor_parallel import all_reduce, check_divisible
from ..planning.plan import PrefillPlan, check_step_tensors
from ..prefill import PrefillStep, begin_step
from .config import MLAConfig
from .moe import FeedForward, MoE, linear
from .rope import acc_dtype, apply_rotary_emb, rotary_cos_sin


class ModelStep(NamedTuple):
    """What the layers use that depends only on the step: made once per step, shared by every layer."""

    cos: torch.Tensor  # [T, R] rotary cos / sin of the step's positions
    sin: torch.Tensor
    attention: PrefillStep  # the plan checked against the caches and slots, the kernels chosen
    q_scale: torch.Tensor | None = None  # [T] per-token query factors (config.query_scale), or None

    @classmethod
    def begin(cls, config: MLAConfig, positions, plan, kv_caches, slot_mapping, k_scale, backend,
              dtype) -> ModelStep:
        attention = begin_step(plan, kv_caches, slot_mapping, k_scale=k_scale, backend=backend)
        cos, sin = rotary_cos_sin(positions, config.qk_rope_head_dim, config.rope_theta, dtype, config.rope_scaling)
        q_scale = None if config.query_scale is None else config.query_scale.scales(positions, dtype)
        return cls(cos, sin, attention, q_scale)


class CompiledRegion:
    """One dense region of the decoder layers (``DecoderLayer.attention_inputs`` or ``attention_output``,
    called ``region(layer, *tensors)``) compiled for ``MLAModel.compile_layers``.

    One ``torch.compile`` per (device, dtype, grad mode, inference mode and, for ``by_mlp``, the layer's
    MLP kind), each with a code object of its own: no combination spends another's recompile budget,
    so casting the model or switching modes compiles once more, never into the recompile limit. The
    tensors' first dim (the tokens) is dynamic, and nothing else: ``dynamic=True`` would make every dim
    symbolic, and duck sizing would tie a token count to an equal head count. Steps of 0 or 1 tokens
    run padded to 2 (zero rows, sliced off after), since sizes 0 and 1 would specialise and compile anew.
    """

    def __init__(self, region: Callable, options: dict, owner: str, by_mlp: bool):
        self.region, self.options, self.owner, self.by_mlp = region, options, owner, by_mlp
        self.compiled: dict[tuple, Callable] = {}

    def __call__(self, layer: DecoderLayer, *tensors: torch.Tensor):
        if torch.compiler.is_compiling():  # inside a compiled step: traced inline
            return self.region(layer, *tensors)
        num_tokens = tensors[0].shape[0]
        if num_tokens < 2:
            tensors = tuple(torch.cat([t, t.new_zeros(2 - num_tokens, *t.shape[1:])]) for t in tensors)
        first = tensors[0]
        key = (first.device, first.dtype, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
               type(layer.mlp) if self.by_mlp else None)
        compiled = self.compiled.get(key)
        if compiled is None:
            name = f"{self.region.__name__}_{len(self.compiled)}_{self.owner}"
            compiled = self.compiled[key] = torch.compile(own_code(self.region, name), **self.options)
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        out = compiled(layer, *tensors)
        if num_tokens < 2:
            out = torch.utils._pytree.tree_map(lambda t: t.narrow(0, 0, num_tokens), out)
        return out


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

    def __init__(self, config: MLAConfig, tp_group=None):
        super().__init__()
        c, std = config, config.initializer_range
        self.tp_group = tp_group
        self.num_heads = c.num_attention_heads
        self.kv_lora_rank = c.kv_lora_rank
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        self.config = config  # rotary frequencies (YaRN or plain RoPE): ModelStep.begin
        self.softmax_scale = c.softmax_scale  # 1/sqrt(P+R), times YaRN's mscale correction

        self.q_lora_rank = c.q_lora_rank
        if c.q_lora_rank is None:
            self.q_proj = linear(c.hidden_size, c.num_attention_heads * c.qk_head_dim, std)
        else:
            self.q_a_proj = linear(c.hidden_size, c.q_lora_rank, std)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.lora_norm_eps)
            self.q_b_proj = linear(c.q_lora_rank, c.num_attention_heads * c.qk_head_dim, std)
        self.kv_a_proj_with_mqa = linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, std)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.lora_norm_eps)
        self.kv_b_proj = linear(c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), std)
        self.o_proj = linear(c.num_attention_heads * c.v_head_dim, c.hidden_size, std)

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
        check_plan_block_table(block_table, plan)
        step = ModelStep.begin(self.config, positions, plan, kv_cache, slot_mapping, k_scale, backend, hidden.dtype)
        q, kv_c, k_pe = self.project(hidden, step.cos, step.sin)
        return all_reduce(self.o_proj(self.attend(q, kv_c, k_pe, kv_cache, step).flatten(1)), self.tp_group)

    def project(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The dense part before attention: rotated queries ``q`` [T, N, P+R] and the new tokens'
        latent rows ``kv_c`` [T, L] and rotated ``k_pe`` [T, R]."""
        num_tokens = hidden.shape[0]
        N, L, P, R = self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)  # [T, N*(P+R)]
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))  # [T, q_lora_rank] -> [T, N*(P+R)]
        q_nope, q_pe = q.view(num_tokens, N, P + R).split([P, R], dim=-1)  # [T, N, P], [T, N, R]
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split([L, R], dim=-1)  # [T, L], [T, R]
        q_pe = apply_rotary_emb(q_pe, cos[:, None, :], sin[:, None, :])
        q = torch.cat([q_nope, q_pe], dim=-1)  # [T, N, P+R]
        return q, self.kv_a_layernorm(kv_c), apply_rotary_emb(k_pe, cos, sin)

    def attend(self, q, kv_c, k_pe, kv_cache, step: ModelStep) -> torch.Tensor:
        """Write the new rows into the cache and attend (``PrefillStep.run``): ``[T, N, V]``, before
        ``o_proj``. Everything is checked before the cache is written: a rejected call writes nothing."""
        if step.q_scale is not None:  # per token, so not in the softmax scale: the same for every attention path
            q = (q.to(step.q_scale.dtype) * step.q_scale[:, None, None]).to(q.dtype)
        return step.attention.run(q, kv_c, k_pe, kv_cache, self.kv_b_proj.weight, self.softmax_scale)


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


def check_step_inputs(input_ids: torch.Tensor, positions: torch.Tensor, plan: PrefillPlan, vocab_size: int) -> None:
    """What a model step can check for free, once per step (CPU tensors; the debug switch adds
    device-side asserts of the token ids elsewhere): token ids inside the vocabulary, and each
    request's first new position equal to its context length (DESIGN §2)."""
    _checks.check_tensor(input_ids, "input_ids", 1, "[T]")
    _checks.check_tensor(positions, "positions", 1, "[T]")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    _checks.check_ids_below(input_ids, "input_ids", vocab_size, "the vocabulary")
    if not isinstance(plan, PrefillPlan) or not _checks.values_readable(positions, plan.query_start_loc,
                                                                        plan.context_lens):
        return
    if positions.shape[0] != input_ids.shape[0]:
        raise ValueError(f"positions must have one entry per token ({input_ids.shape[0]}), got {positions.shape[0]}")
    starts, context = plan.query_start_loc[:-1].long(), plan.context_lens.long()
    has_tokens = (plan.query_start_loc[1:] > plan.query_start_loc[:-1]) & (starts < positions.shape[0])
    first = positions.index_select(0, starts[has_tokens])
    wrong = torch.nonzero(first != context[has_tokens])
    if wrong.numel():
        r = int(torch.nonzero(has_tokens)[int(wrong[0, 0]), 0])
        raise ValueError(
            f"positions[{int(starts[r])}] is {int(positions[starts[r]])}, but request {r} has {int(context[r])} "
            "context tokens: a request's first new token sits at position context_lens[r]"
        )


class DecoderLayer(nn.Module):
    """Attention and MLP with pre-norm residuals. Its dense parts, ``attention_inputs`` and
    ``attention_output``, are the regions ``MLAModel.compile_layers`` compiles; the attention
    between them (cache write, plan, chunk loop) runs the library's ops."""

    num_kv_caches = 1  # cache layers per layer: one attention

    def __init__(self, config: MLAConfig, layer_idx: int = 0, tp_group=None):
        super().__init__()
        self.tp_group = tp_group  # tensor parallel: the partial sums of o_proj and the MLP are all-reduced
        self.residual_scale = config.residual_scale  # MiniCPM3's; 1: none
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAAttention(config, tp_group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(layer_idx):
            self.mlp = MoE(config)
        else:
            self.mlp = FeedForward(config.hidden_size, config.intermediate_size, config.initializer_range)
        self.regions: tuple[Callable, Callable] | None = None  # compiled by MLAModel.compile_layers

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, step: ModelStep) -> torch.Tensor:
        """``x`` [T, H] -> the residual stream after the layer; ``step``: ``ModelStep.begin``'s, shared
        by every layer of the step."""
        inputs, output = self.regions or (DecoderLayer.attention_inputs, DecoderLayer.attention_output)
        q, kv_c, k_pe = inputs(self, x, step.cos, step.sin)
        return output(self, x, self.self_attn.attend(q, kv_c, k_pe, kv_cache, step))

    def attention_inputs(self, x, cos, sin):
        """``x`` [T, H] -> the attention's ``q``, ``kv_c``, ``k_pe`` (``MLAAttention.project``)."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def attention_output(self, x, attention):
        """The residual stream after the layer, from its input ``x`` and the attention's [T, N, V]."""
        h = x + scaled(all_reduce(self.self_attn.o_proj(attention.flatten(1)), self.tp_group), self.residual_scale)
        return h + scaled(all_reduce(self.mlp(self.post_attention_layernorm(h)), self.tp_group), self.residual_scale)

    # MLAModel.compile_layers' regions: (function, compiled per MLP kind)
    compiled_regions = ((attention_inputs, False), (attention_output, True))

    @staticmethod
    def checkpoint_name(config: MLAConfig, name: str) -> str | None:
        """The model tensor that checkpoint tensor ``name`` fills (None: skipped): DeepSeek's names are the model's."""
        return name


def scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x * scale``; nothing for a scale of 1 (DeepSeek's), so its graphs stay as they were."""
    return x if scale == 1.0 else x * scale


class MLAModel(nn.Module):
    """``context_parallel``: the group over which the layers are sharded (``MLAForCausalLM``); ``config``
    stays the whole model's."""

    # config.decoder_layer -> its layer class; a family with a layer structure of its own adds it from its
    # module (mla_ops.models.longcat, imported by the package).
    layer_classes: dict[str, type[nn.Module]] = {"deepseek": DecoderLayer}

    def __init__(self, config: MLAConfig, *, context_parallel: ContextParallel | None = None):
        super().__init__()
        self.config = config
        self.context_parallel = context_parallel
        layer_config, group = config, None
        if context_parallel is not None:
            layer_config, group = local_config(config, context_parallel), context_parallel.process_group
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        nn.init.normal_(self.embed_tokens.weight, std=config.initializer_range)
        self.layer_class = self.layer_classes[config.decoder_layer]
        self.layers = nn.ModuleList(self.layer_class(layer_config, i, group) for i in range(config.num_hidden_layers))
        self.num_cache_layers = sum(layer.num_kv_caches for layer in self.layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._compile_options: dict | None = None  # compile_layers'

    def compile_layers(self, **options) -> MLAModel:
        """Regional compilation: the decoder layers' dense regions (their class's ``compiled_regions``:
        ``DecoderLayer.attention_inputs`` and ``attention_output``; LongCat-Flash's three) compiled once and
        shared by every layer of this model, whatever its depth: one graph per region (a second for MoE
        layers' output) and per dtype, device, grad and inference mode (``CompiledRegion``), the token
        count dynamic, so every step size (zero and one token included), cache size and plan reuses them.
        The attention between them runs the library's ops. ``options`` go to ``torch.compile`` (defaults
        ``fullgraph=True``, ``backend="inductor"``); calling it again with the same options keeps the
        compiled regions. Returns the model."""
        options = {"fullgraph": True, "backend": "inductor", **options}
        if self._compile_options != options:
            owner = f"{id(self):x}"
            regions = tuple(CompiledRegion(region, options, owner, by_mlp)
                            for region, by_mlp in self.layer_class.compiled_regions)
            for layer in self.layers:
                layer.regions = regions
            self._compile_options = options
        return self

    def allocate_kv_caches(
        self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None, device=None
    ) -> torch.Tensor:
        """Zeroed caches [num_cache_layers, num_blocks, block_size, L+R] (one per attention: num_hidden_layers,
        twice that for LongCat-Flash); dtype and device default to the model's (a float8_e4m3fn cache then needs
        ``k_scale`` in ``forward``)."""
        c = self.config
        weight = self.embed_tokens.weight
        return torch.zeros(
            self.num_cache_layers, num_blocks, block_size, c.kv_lora_rank + c.qk_rope_head_dim,
            dtype=dtype or weight.dtype, device=device or weight.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: torch.Tensor,  # [num_cache_layers, num_blocks, block_size, L+R] (allocate_kv_caches)
        slot_mapping: torch.Tensor,  # [T]
        block_table: torch.Tensor,  # [B, max_blocks] int32, shared by all layers: the plan's
        plan: PrefillPlan,  # one plan per step (mla_ops.plan_prefill), shared by all layers
        *,
        k_scale: float | torch.Tensor | None = None,
        backend: str = "auto",
    ) -> torch.Tensor:
        if kv_caches.dim() != 4 or kv_caches.shape[0] != self.num_cache_layers:
            raise ValueError(
                f"kv_caches must be [num_cache_layers={self.num_cache_layers}, num_blocks, block_size, L+R], "
                f"got shape {tuple(kv_caches.shape)} (see allocate_kv_caches)"
            )
        check_plan_block_table(block_table, plan)
        check_step_inputs(input_ids, positions, plan, self.embed_tokens.num_embeddings)
        step = ModelStep.begin(self.config, positions, plan, kv_caches, slot_mapping, k_scale, backend,
                               self.embed_tokens.weight.dtype)  # once, not per layer
        x = scaled(self.embed_tokens(input_ids), self.config.embedding_scale)  # [T, H]
        first = 0
        for layer in self.layers:  # a layer of several attentions gets its caches [n, num_blocks, block_size, L+R]
            n = layer.num_kv_caches
            x = layer(x, kv_caches[first] if n == 1 else kv_caches[first : first + n], step)
            first += n
        return self.norm(x)  # [T, H]


def local_config(config: MLAConfig, context_parallel: ContextParallel) -> MLAConfig:
    """One rank's layer config under tensor parallel: N / D heads, intermediate sizes / D (a ValueError
    naming ``context_parallel`` unless they divide). Nothing else derives from N: ``softmax_scale``
    (P, R and YaRN) stays the whole model's."""
    if not isinstance(context_parallel, ContextParallel):
        raise TypeError(f"context_parallel must be a mla_ops.ContextParallel or None, got "
                        f"{type(context_parallel).__name__}")
    if config.decoder_layer != "deepseek" or config.zero_expert_num:  # an identity expert's x would be summed D times
        raise ValueError(f"context_parallel: only DeepSeek's layers without identity experts are sharded, got "
                         f"decoder_layer {config.decoder_layer!r}, zero_expert_num={config.zero_expert_num}")
    world_size = context_parallel.world_size
    sizes = {"num_attention_heads": config.num_attention_heads, "intermediate_size": config.intermediate_size}
    if config.n_routed_experts is not None:
        sizes["moe_intermediate_size"] = config.moe_intermediate_size
    check_divisible(sizes, world_size)
    return dataclasses.replace(config, **{name: size // world_size for name, size in sizes.items()})


class MLAForCausalLM(nn.Module):
    """``MLAModel`` plus ``lm_head``: logits [T, vocab] for every new token of the step.

    ``context_parallel``: a ``mla_ops.ContextParallel`` whose group of D ranks also shards the weights
    (``mla_ops.parallel.tensor_parallel``): each rank keeps N / D query heads and 1/D of the MLP and
    experts; every rank gets the same hidden states and logits. The caches then hold each rank's
    context shard (DESIGN §10), and ``Generator`` / ``generate`` run unchanged on every rank."""

    def __init__(self, config: MLAConfig, *, context_parallel: ContextParallel | None = None):
        super().__init__()
        self.config = config
        self.context_parallel = context_parallel
        self.model = MLAModel(config, context_parallel=context_parallel)
        self.lm_head = linear(config.hidden_size, config.vocab_size, config.initializer_range)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device=None, *,
                        context_parallel: ContextParallel | None = None) -> MLAForCausalLM:
        """A checkpoint directory (config.json + safetensors, DeepSeek's release layout or what
        transformers writes); see ``mla_ops.models.checkpoint.load_pretrained``. With
        ``context_parallel`` each rank reads only its shard of the weights."""
        from .checkpoint import load_pretrained

        return load_pretrained(cls, path, dtype=dtype, device=device, context_parallel=context_parallel)

    def allocate_kv_caches(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                           device=None) -> torch.Tensor:
        return self.model.allocate_kv_caches(num_blocks, block_size, dtype, device)

    def compile_layers(self, **options) -> MLAForCausalLM:
        """``MLAModel.compile_layers`` of the decoder; returns the model."""
        self.model.compile_layers(**options)
        return self

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: torch.Tensor,  # [num_cache_layers, num_blocks, block_size, L+R]
        slot_mapping: torch.Tensor,  # [T]
        block_table: torch.Tensor,  # [B, max_blocks] int32: the plan's
        plan: PrefillPlan,
        *,
        k_scale: float | torch.Tensor | None = None,
        backend: str = "auto",
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions, kv_caches, slot_mapping, block_table, plan,
                            k_scale=k_scale, backend=backend)  # [T, H]
        return self.logits(hidden)  # [T, vocab]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``MLAModel``'s hidden states [T, H] -> logits [T, vocab] (MiniCPM3 divides by ``logits_scaling`` first)."""
        if self.config.logits_scaling != 1.0:
            hidden = hidden / self.config.logits_scaling
        return self.lm_head(hidden)
