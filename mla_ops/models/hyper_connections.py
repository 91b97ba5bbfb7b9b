"""Hyper-connections (HY-V4's, ``decoder_layer="hyper"``; ``MLAConfig.hyper_connections``): the residual stream is
m = ``hc_mult`` streams instead of one, and each sublayer (attention, MLP) reads a learned mix of them and adds its
output back into every stream with a learned weight. DeepSeek-V4's form without its Sinkhorn-mixed streams: a
stream is never mixed with another, only fed.

x [T, m, H]  (the embeddings copied m times)      flat = x.flatten(1) [T, m*H]
mixes  = (flat @ fn.T) * rsqrt(mean(flat^2) + rms_norm_eps)       [T, 2m]
pre    = sigmoid(mixes[:, :m] * scale[0] + base[:m]) + hc_eps     [T, m]   the sublayer's input: sum_i pre_i x_i
post   = hc_magnitude * sigmoid(mixes[:, m:] * scale[1] + base[m:]) + hc_eps   [T, m]
x'     = x + post[..., None] * sublayer(norm(sum_i pre_i x_i))[:, None, :]

The model's end (``HyperHead``) collapses the streams the same way with weights of its own (``hc_fn [m, m*H]``,
``hc_base [m]``, ``hc_scale [1]``) before the final norm. Computed in float32 (float64 for a float64 model) and
kept float32 in half-precision models, as transformers keeps them. The reference is transformers'
``HYV4HyperConnection`` / ``HYV4HyperHead`` / ``HYV4DecoderLayer``; the checkpoint names are its module names
(``attn_hc.fn``, ``ffn_hc.base``, ``model.hc_head.hc_scale``, ...), the releases' renamed as transformers does
(``mla_ops.models.hy_v4.transformers_name``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor_parallel import all_reduce
from .config import MLAConfig
from .hy_v4 import transformers_name
from .layer import Carry, DecoderLayer, LayerCaches, ModelStep, NewRows
from .parts import acc_dtype


def _mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.dtype]:
    """(flat @ fn.T) * rsqrt(mean(flat^2) + eps) in the compute dtype, and that dtype."""
    dtype = acc_dtype(streams.dtype)
    flat = streams.flatten(1).to(dtype)  # [T, m*H]
    return F.linear(flat, fn.to(dtype)) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps), dtype


class HyperConnection(nn.Module):
    """One sublayer's connection to the streams: its input mix and its output weights (module doc)."""

    def __init__(self, config: MLAConfig):
        super().__init__()
        hc, m = config.hyper_connections, config.hyper_connections.hc_mult
        self.hc_mult, self.magnitude, self.eps, self.norm_eps = m, hc.hc_magnitude, hc.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.randn(2 * m, m * config.hidden_size) * config.initializer_range)
        self.base = nn.Parameter(torch.cat([torch.full((m,), -math.log(max(m - 1, 1))), torch.zeros(m)]))
        self.scale = nn.Parameter(torch.full((2,), 0.01))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, m, H] -> (post [T, m] in the compute dtype, the sublayer's input [T, H])."""
        m = self.hc_mult
        mixes, dtype = _mixes(streams, self.fn, self.norm_eps)
        base, scale = self.base.to(dtype), self.scale.to(dtype)
        pre = torch.sigmoid(mixes[:, :m] * scale[0] + base[:m]) + self.eps
        post = self.magnitude * torch.sigmoid(mixes[:, m:] * scale[1] + base[m:]) + self.eps
        return post, (pre[..., None] * streams.to(dtype)).sum(1).to(streams.dtype)

    @staticmethod
    def residual(streams: torch.Tensor, post: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """streams [T, m, H] plus the sublayer's output [T, H] weighted by post [T, m] in every stream."""
        return (post[..., None] * out[:, None, :].to(post.dtype) + streams.to(post.dtype)).to(streams.dtype)


class HyperHead(nn.Module):
    """The model's end: the streams [T, m, H] collapsed to one [T, H] (module doc)."""

    def __init__(self, config: MLAConfig):
        super().__init__()
        hc, m = config.hyper_connections, config.hyper_connections.hc_mult
        self.eps, self.norm_eps = hc.hc_eps, config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.randn(m, m * config.hidden_size) * config.initializer_range)
        self.hc_base = nn.Parameter(torch.full((m,), -math.log(max(m - 1, 1))))
        self.hc_scale = nn.Parameter(torch.full((1,), 0.01))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes, dtype = _mixes(streams, self.hc_fn, self.norm_eps)
        pre = torch.sigmoid(mixes * self.hc_scale.to(dtype) + self.hc_base.to(dtype)) + self.eps
        return (pre[..., None] * streams.to(dtype)).sum(1).to(streams.dtype)


def streams_of(embeddings: torch.Tensor, config: MLAConfig) -> torch.Tensor:
    """The embeddings [T, H] as the m streams [T, m, H] the first layer reads."""
    return embeddings[:, None, :].expand(-1, config.hyper_connections.hc_mult, -1).contiguous()


class HyperDecoderLayer(DecoderLayer):
    """DeepSeek's layer (attention, MLP or MoE, their norms) on hyper-connected streams: x [T, m, H]."""

    def __init__(self, config: MLAConfig, layer_idx: int = 0, tp_group=None):
        super().__init__(config, layer_idx, tp_group)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, x: torch.Tensor, caches: LayerCaches, step: ModelStep,
                carry: Carry = Carry()) -> tuple[torch.Tensor, NewRows]:
        """``x`` [T, m, H] -> (the streams after the layer, the rows it made)."""
        post, inputs = self.attn_hc(x)
        attention, made = self.self_attn(self.input_layernorm(inputs), caches[0], step, carry)
        h = self.attn_hc.residual(x, post, attention)
        post, inputs = self.ffn_hc(h)
        mlp = all_reduce(self.mlp(self.post_attention_layernorm(inputs)), self.tp_group)
        return self.ffn_hc.residual(h, post, mlp), made

    @staticmethod
    def checkpoint_name(config: MLAConfig, name: str) -> str | None:
        """The releases' names as transformers renames them (``hy_v4.transformers_name``)."""
        return DecoderLayer.checkpoint_name(config, transformers_name(name))
