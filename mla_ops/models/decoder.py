"""The MLA decoder: the model (``MLAModel``, ``MLAForCausalLM``) over its layers, on the mla_ops operators.

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

The caches (one record, ``KVCaches``: ``allocate_kv_caches``), slot mapping and the step's ``PrefillPlan``
(``mla_ops.plan_prefill``, made once per step; it holds the block table) are passed in on every call; nothing is
stored in the modules. ``MLAModel`` begins the step once per attention kind (``ModelStep``: the rotary tables and
``mla_ops.begin_step``'s checked attention step; dots3_note's sliding layers have a kind, and a plan, of their
own) and every layer makes its attention calls on its kind's: with a device plan (``max_chunks=K``) the whole step
reads no device value and compiles to one graph, the planner running once per kind however many layers there
are. One loop runs every kind of layer, handing each its caches and what the layers before it made for it
(``layer.Carry``), as wired once at construction (``wiring``); ``mla_ops.models.regions`` decides how each layer
runs and when its new rows are written.

A sparse model (DeepSeek Sparse Attention: ``MLAConfig.index_topk``, DeepSeek-V3.2, GLM-5) keeps index caches
beside the latent ones (``KVCaches.index``) and needs a plan made with its ``index_topk``; a full layer's top-k
is handed to the "shared" layers after it, which reuse it instead of recomputing it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .. import _checks
from ..parallel import ContextParallel
from ..parallel.tensor_parallel import check_divisible
from ..planning.plan import PrefillPlan
from ..prefill import plan_with_options
from . import regions, stacking
from .config import MLAConfig
from .hyper_connections import HyperDecoderLayer, HyperHead, streams_of
from .kv_caches import KVCaches, allocate, as_kv_caches, check_caches
from .layer import DecoderLayer, ModelStep, RMSNorm, scaled
from .longcat import LongcatDecoderLayer
from .parts import linear, softcap
from .query_scale import PositionScale
from .rope import RotaryEmbedding
from .wiring import Passed, wire_layers

# MLAConfig.decoder_layer -> the layer structure of the family's model.
LAYER_CLASSES: dict[str, type[nn.Module]] = {"deepseek": DecoderLayer, "longcat": LongcatDecoderLayer,
                                             "hyper": HyperDecoderLayer}


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


class MLAModel(nn.Module):
    """``context_parallel``: the group over which the layers are sharded (``MLAForCausalLM``); ``config``
    stays the whole model's."""

    def __init__(self, config: MLAConfig, *, context_parallel: ContextParallel | None = None):
        super().__init__()
        self.config = config
        self.context_parallel = context_parallel
        layer_config, group = config, None
        if context_parallel is not None:
            layer_config, group = local_config(config, context_parallel), context_parallel.process_group
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        nn.init.normal_(self.embed_tokens.weight, std=config.initializer_range)
        self.layer_class = LAYER_CLASSES[config.decoder_layer]
        self.layers = nn.ModuleList(self.layer_class(layer_config, i, group) for i in range(config.num_hidden_layers))
        self.num_cache_layers = sum(layer.num_kv_caches for layer in self.layers)  # KV-sharing layers have none
        self.wiring = wire_layers(config, [layer.num_kv_caches for layer in self.layers])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Hyper-connections (HY-V4's): the streams' collapse before the norm; None: one residual stream
        self.hc_head = None if config.hyper_connections is None else HyperHead(config)
        # The rotary frequencies, built once (Mistral Large 4's learned ones: model.rotary_emb.alpha)
        self.rotary_emb = RotaryEmbedding(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling,
                                          learned=config.learned_rope_frequencies)
        # The sliding layers' (sliding_attention: dots3_note's), plain RoPE of their own R and theta; None: none
        sliding = config.sliding_attention
        self.sliding_rotary_emb = None if sliding is None else RotaryEmbedding(
            sliding.qk_rope_head_dim or config.qk_rope_head_dim, sliding.rope_theta or config.rope_theta)
        # Each attention kind's first cache layer, against which its step is checked (every layer of a kind alike)
        self.first_cache_of_kind = {}
        for wiring in self.wiring:
            self.first_cache_of_kind.setdefault(wiring.kind, wiring.latent[0])
        query_scale = config.scalings.query_scale  # Mistral 4's; None: none
        self.position_scale = None if query_scale is None else PositionScale(query_scale)
        self.embedding_scale = config.scalings.embedding_scale  # MiniCPM3's; 1: none
        # stack_layers(): each run of like layers' weights stacked (stacking.LayerRun); None: not stacked, or no
        # longer (a tensor of a stacked layer set anew)
        self.layer_runs = None
        self.stacks_layers = False
        self.register_load_state_dict_post_hook(_restack_after_load)
        regions.static_floats(self)

    def compile_layers(self, **options) -> MLAModel:
        """Regional compilation: the layers' dense parts (the attentions' projections, the MLPs) compiled once and
        shared by every layer, whatever the depth, step size, cache size or plan; the attention ops between them
        run eagerly (``mla_ops.models.regions.compile_layers``). ``options`` go to ``torch.compile`` (defaults
        ``fullgraph=True``, ``backend="inductor"``), which refuses bad ones here, the model left as it was;
        calling it again with the same options keeps the compiled parts. Returns the model."""
        regions.compile_layers(self, options)
        return self

    def stack_layers(self) -> MLAModel:
        """Each run of consecutive layers of one structure keeps its weights in one tensor per weight name, the
        layers' parameters views of it (``mla_ops.models.stacking``; the parameters, their names and the
        checkpoint stay as they were). Under a whole-model ``torch.compile`` with the latent caches as one stacked
        tensor (``allocate_kv_caches(..., stacked=True)``), each run then runs as one ``scan``: traced and compiled
        once, whatever the depth. ``.to()`` and ``load_state_dict`` keep the stacks; a parameter set anew on a
        layer unstacks the model until this is called again. Refuses a model with layers that take another
        layer's rows or top-k (KV sharing, a sparse model's). Returns the model."""
        self.layer_runs = stacking.stack(self)
        self.stacks_layers = True
        return self

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        if self.stacks_layers:  # the layers' tensors were converted one by one: views of the stacks no more
            self.layer_runs = stacking.restack(self)
        return module

    def allocate_kv_caches(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None, device=None, *,
                           kv_cache_format: str = "auto", index_cache_format: str = "auto", k_scale=None,
                           k_scale_index=None, stacked: bool = False) -> KVCaches:
        """Zeroed caches, a ``KVCaches``: ``latent`` one ``[num_blocks, block_size, L+R]`` tensor per cache layer (one
        per attention: num_hidden_layers, twice that for LongCat-Flash), as engines bind one to each attention
        layer; a sparse model's ``index`` one ``[num_blocks, block_size, D_I]`` per layer with an indexer. dtype and
        device default to the model's; a float8_e4m3fn cache needs ``k_scale`` (and a sparse model's
        ``k_scale_index``): one for every layer, or a list of one per layer. KV-sharing layers
        (``kv_source_layers``) have no latent cache; a NoPE layer's (``no_rope_layers``, R = 0) is the first L
        columns of its L+R rows. ``kv_cache_format="fp8_ds_mla"`` / ``index_cache_format="fp8_per_token"``: vLLM's
        packed uint8 layouts (656-byte latent rows, index rows of D_I + D_I/128*4 bytes; ``ops/cache_formats.py``),
        which keep their own scales (``dtype`` then unused). ``stacked=True``: ``latent`` one tensor ``[cache
        layers, num_blocks, block_size, L+R]``, what a stacked model scans under ``torch.compile``
        (``stack_layers``)."""
        weight = self.embed_tokens.weight
        return allocate(self.config, self.num_cache_layers, num_blocks, block_size, dtype or weight.dtype,
                        device or weight.device, kv_cache_format=kv_cache_format,
                        index_cache_format=index_cache_format, k_scale=k_scale, k_scale_index=k_scale_index,
                        stacked=stacked)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: KVCaches,  # allocate_kv_caches' (or a list of [num_blocks, block_size, L+R], one per cache layer)
        slot_mapping: torch.Tensor,  # [T]
        plan: PrefillPlan,  # one plan per step (mla_ops.plan_prefill), shared by all layers; it holds the block table
        *stale,  # a call from before the plan held the block table: refused by name
        backend: str = "auto",
    ) -> torch.Tensor:
        refuse_block_table(plan, stale)
        weight = self.embed_tokens.weight
        scanned = regions.scanned_caches(self, as_kv_caches(kv_caches), plan)
        caches = check_caches(kv_caches, self.config, self.num_cache_layers, (weight.dtype, weight.device),
                              scanned=scanned is not None)
        check_plan(plan, self.config)
        check_step_inputs(input_ids, positions, plan, self.embed_tokens.num_embeddings)
        # once per attention kind, not per layer: the sliding layers' step on the plan of their window
        steps = {kind: ModelStep.begin(self, positions, kind_plan, caches, slot_mapping, backend, kind)
                 for kind, kind_plan in kind_plans(plan, self.config).items()}
        x = scaled(self.embed_tokens(input_ids), self.embedding_scale)  # [T, H]
        if self.hc_head is not None:
            x = streams_of(x, self.config)  # [T, hc_mult, H]
        if scanned is not None:
            x = regions.run_stacked(self, x, scanned, caches.k_scale, steps)
        else:
            passed = Passed()
            for layer, wiring in zip(self.layers, self.wiring):
                x, made = regions.run_layer(layer, x, wiring.caches(caches), steps[wiring.kind], wiring.carry(passed))
                passed = wiring.passed_on(passed, made)
        return self.norm(x if self.hc_head is None else self.hc_head(x))  # [T, H]


def _restack_after_load(model: MLAModel, incompatible_keys) -> None:
    """After ``load_state_dict``: with ``assign=True`` the layers hold the loaded tensors, no views of the stacks."""
    if model.stacks_layers:
        model.layer_runs = stacking.restack(model)


def check_plan(plan: PrefillPlan, config: MLAConfig) -> None:
    """A plan, made with the model's ``index_topk`` and no window (a model plans its sliding layers itself)."""
    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan must be a PrefillPlan (mla_ops.plan_prefill), got {type(plan).__name__}")
    if plan.sliding_window:
        raise ValueError(f"plan was made with sliding_window={plan.sliding_window}, but the model's plan is its full "
                         "layers' (no window): a model with sliding layers plans their step itself, from this plan "
                         "and its config's window (sliding_attention.sliding_window)")
    if plan.index_topk != (config.index_topk or 0):
        raise ValueError(f"plan was made with index_topk={plan.index_topk or None}, but the model selects "
                         f"index_topk={config.index_topk}: plan the step with plan_prefill(..., index_topk="
                         f"{config.index_topk}) (config.index_topk)")


def kind_plans(plan: PrefillPlan, config: MLAConfig) -> dict[int, PrefillPlan]:
    """The step's plan of each attention kind (``MLAConfig.attention_kinds``): the caller's for the config's own
    layers (0), and for the sliding layers (1) one of the same lengths, block table and options with their window
    and no indexer (planned here once per step: the device form reads nothing on the host, so it compiles)."""
    plans = {0: plan}
    if 1 in config.attention_kinds:
        if plan.options is None or plan.context_parallel is not None:
            raise ValueError("a model with sliding layers (sliding_attention) plans their step from the plan's "
                             "options on one device: pass a plan_prefill plan without context_parallel")
        options = dataclasses.replace(plan.options, index_topk=None, max_index_chunks=None,
                                      sliding_window=config.sliding_attention.sliding_window)
        plans[1] = plan_with_options(plan.query_start_loc, plan.context_lens, plan.block_table, options)
    if 0 not in config.attention_kinds:
        del plans[0]
    return plans


def refuse_block_table(plan, stale: tuple) -> None:
    """A step called with a block table, as before the plan held it: named, with the call to make instead."""
    if stale or isinstance(plan, torch.Tensor):
        raise TypeError("the model's forward takes no block_table: the plan holds it (plan.block_table). Call "
                        "model(input_ids, positions, kv_caches, slot_mapping, plan, *, backend='auto'); the caches' "
                        "formats and scales travel in their record, mla_ops.KVCaches")


def local_config(config: MLAConfig, context_parallel: ContextParallel) -> MLAConfig:
    """One rank's layer config under tensor parallel: N / D heads, intermediate sizes / D (a ValueError
    naming ``context_parallel`` unless they divide). Nothing else derives from N: ``softmax_scale``
    (P, R and YaRN) stays the whole model's."""
    if not isinstance(context_parallel, ContextParallel):
        raise TypeError(f"context_parallel must be a mla_ops.ContextParallel or None, got "
                        f"{type(context_parallel).__name__}")
    if config.sliding_attention is not None:
        raise ValueError("context_parallel does not serve sliding-window layers (sliding_attention) yet: their "
                         "geometry is not sharded (docs/limitations.md)")
    if config.is_sparse:
        raise ValueError("context_parallel does not serve DeepSeek Sparse Attention models (index_topk) yet: "
                         "their index cache and top-k are not sharded (docs/limitations.md)")
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
        self.logits_scaling = config.scalings.logits_scaling  # MiniCPM3's; 1: none
        self.logit_softcapping = config.scalings.final_logit_softcapping  # Mistral Large 4's; None: none
        regions.static_floats(self)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device=None, *,
                        context_parallel: ContextParallel | None = None) -> MLAForCausalLM:
        """A checkpoint directory (config.json + safetensors, DeepSeek's release layout or what
        transformers writes); see ``mla_ops.models.checkpoint.load_pretrained``. With
        ``context_parallel`` each rank reads only its shard of the weights."""
        from .checkpoint import load_pretrained

        return load_pretrained(cls, path, dtype=dtype, device=device, context_parallel=context_parallel)

    def allocate_kv_caches(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                           device=None, **storage) -> KVCaches:
        """``MLAModel.allocate_kv_caches`` (``storage``: its formats and scales)."""
        return self.model.allocate_kv_caches(num_blocks, block_size, dtype, device, **storage)

    def compile_layers(self, **options) -> MLAForCausalLM:
        """``MLAModel.compile_layers`` of the decoder; returns the model."""
        self.model.compile_layers(**options)
        return self

    def stack_layers(self) -> MLAForCausalLM:
        """``MLAModel.stack_layers`` of the decoder; returns the model."""
        self.model.stack_layers()
        return self

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: KVCaches,
        slot_mapping: torch.Tensor,  # [T]
        plan: PrefillPlan,
        *stale,
        backend: str = "auto",
    ) -> torch.Tensor:
        """``MLAModel.forward``, then the logits."""
        hidden = self.model(input_ids, positions, kv_caches, slot_mapping, plan, *stale, backend=backend)  # [T, H]
        return self.logits(hidden)  # [T, vocab]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``MLAModel``'s hidden states [T, H] -> logits [T, vocab] (MiniCPM3 divides by ``logits_scaling`` first,
        Mistral Large 4 soft-caps them: ``final_logit_softcapping``)."""
        if self.logits_scaling != 1.0:
            hidden = hidden / self.logits_scaling
        return softcap(self.lm_head(hidden), self.logit_softcapping)
