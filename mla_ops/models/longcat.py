"""LongCat-Flash's decoder layer (``decoder_layer="longcat"``, model type ``longcat_flash``).

Each layer holds two MLA attentions, each with a latent cache of its own, two dense MLPs and one MoE
whose input is the first MLP's and whose output is added at the end of the layer (the "shortcut"):

    h1 = x  + attn_0(norm_in_0(x))                     shortcut = MoE(norm_post_0(h1))
    h2 = h1 + mlp_0(norm_post_0(h1))
    h3 = h2 + attn_1(norm_in_1(h2))
    out = h3 + mlp_1(norm_post_1(h3)) + shortcut

The MoE's experts follow ``mla_ops.models.moe`` with ``zero_expert_num`` identity experts; its router is
a softmax over routed + identity experts, top-k of the scores plus ``e_score_correction_bias``, weights
the scores times ``routed_scaling_factor`` (MoEGate: softmax, "noaux_tc" with one group, no norm).
Both attentions scale (``LongcatAttention``) q by sqrt(H / q_lora_rank) and the latent kv_c by
sqrt(H / L) before it is cached; k_pe and the softmax scale are DeepSeek's. The reference is
transformers' ``LongcatFlashDecoderLayer``.

x [T, H]   caches: the two attentions' caches [num_blocks, block_size, L+R] (``MLAModel`` hands layer j the
cache layers 2j and 2j+1 of its 2 * num_hidden_layers).

Checkpoint names are transformers' (``self_attn.{i}``, ``mlps.{i}``, ``input_layernorm.{i}``, ...), which
are the release's too, but for three things ``checkpoint_name`` handles: the router is
``mlp.router.classifier.weight`` / ``mlp.router.e_score_correction_bias`` (the model's ``mlp.gate.*``);
the identity experts have no weights: transformers 5.25's ``save_pretrained`` writes ``mlp.experts.{e}.*``
for the E routed experts only, as the release does, while 5.24's ``gate_up_proj`` had rows for the
identity experts too, written as ``mlp.experts.{e}.gate_proj`` / ``up_proj`` for e in [E, E + Z) that
nothing computes with (skipped); the release's Multi-Token-Prediction weights ``model.mtp.*`` are skipped.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from .config import MLAConfig
from .layer import Carry, LayerCaches, MLAAttention, ModelStep, NewRows, RMSNorm
from .moe import FeedForward, MoE

_ROUTER = re.compile(r"^(model\.layers\.\d+\.mlp)\.router\.(classifier\.weight|e_score_correction_bias)$")
_EXPERT_GATE_UP = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate_proj|up_proj)\.weight$")


class LongcatAttention(MLAAttention):
    """``MLAAttention`` with LongCat-Flash's LoRA scalings (``mla_scale_q_lora``, ``mla_scale_kv_lora``)."""

    def __init__(self, config: MLAConfig, tp_group=None):
        super().__init__(config, tp_group)
        c = config
        self.q_scale = (c.hidden_size / c.q_lora_rank) ** 0.5 if c.scalings.mla_scale_q_lora else 1.0
        self.latent_scale = (c.hidden_size / c.kv_lora_rank) ** 0.5 if c.scalings.mla_scale_kv_lora else 1.0

    def project(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        q, kv_c, k_pe, gate = super().project(hidden, cos, sin)  # [T, N, P+R], [T, L], [T, R], None
        # transformers scales q before the rotation: the same up to rounding (a rotation is linear)
        return q * self.q_scale, kv_c * self.latent_scale, k_pe, gate


class LongcatDecoderLayer(nn.Module):
    """Two attention sublayers, two dense MLPs and the shortcut MoE (module docstring). ``tp_group`` is always
    None: ``local_config`` refuses to shard this layer."""

    num_kv_caches = 2  # cache layers per layer: two attentions

    def __init__(self, config: MLAConfig, layer_idx: int = 0, tp_group=None):
        super().__init__()
        c = config
        self.input_layernorm = nn.ModuleList(RMSNorm(c.hidden_size, c.rms_norm_eps) for _ in range(2))
        self.self_attn = nn.ModuleList(LongcatAttention(c, tp_group) for _ in range(2))
        self.post_attention_layernorm = nn.ModuleList(RMSNorm(c.hidden_size, c.rms_norm_eps) for _ in range(2))
        self.mlps = nn.ModuleList(FeedForward(c.hidden_size, c.intermediate_size, c.initializer_range)
                                  for _ in range(2))
        self.mlp = MoE(c)  # the shortcut

    def forward(self, x: torch.Tensor, caches: LayerCaches, step: ModelStep,
                carry: Carry = Carry()) -> tuple[torch.Tensor, NewRows]:
        """``x`` [T, H] -> (the residual stream after the layer, both attentions' rows; no DSA, no KV sharing)."""
        attention, first = self.self_attn[0](self.input_layernorm[0](x), caches[0], step)
        h = x + attention
        normed = self.post_attention_layernorm[0](h)
        shortcut = self.mlp(normed)
        h = h + self.mlps[0](normed)
        attention, second = self.self_attn[1](self.input_layernorm[1](h), caches[1], step)
        h = h + attention
        return h + self.mlps[1](self.post_attention_layernorm[1](h)) + shortcut, first + second

    @staticmethod
    def checkpoint_name(config: MLAConfig, name: str) -> str | None:
        """The model tensor that checkpoint tensor ``name`` fills; None: skipped (module docstring)."""
        if name.startswith("model.mtp."):
            return None
        expert = _EXPERT_GATE_UP.match(name)
        if expert and 0 <= int(expert.group(1)) - config.n_routed_experts < config.zero_expert_num:
            return None
        router = _ROUTER.match(name)
        if router:
            return f"{router.group(1)}.gate.{'weight' if router.group(2) == 'classifier.weight' else router.group(2)}"
        return name

