"""A.X-K2's gated RMSNorm (``MLAConfig.gated_norm_rank``): an RMSNorm whose output is scaled per channel by a
sigmoid of a rank-r MLP of itself,

y = RMSNorm(x)        out = y * sigmoid(fc2(silu(fc1(y))))        fc1 [r, H], fc2 [H, r], no biases

on the input norm of every layer and the post-attention norm of the MoE layers (``layer.DecoderLayer``). The sigmoid
in float32 (float64 kept), as transformers' ``AXK2GatedRMSNorm``; names as its modules: ``norm.weight``,
``mlp.fc1.weight``, ``mlp.fc2.weight`` (the release's ``W_down`` / ``W_up``, ``mla_ops.models.axk2``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .parts import acc_dtype, linear


class GateMLP(nn.Module):
    def __init__(self, hidden_size: int, rank: int, std: float):
        super().__init__()
        self.fc1 = linear(hidden_size, rank, std)
        self.fc2 = linear(rank, hidden_size, std)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(y)))


class GatedRMSNorm(nn.Module):
    def __init__(self, norm: nn.Module, hidden_size: int, rank: int, std: float):
        super().__init__()
        self.norm = norm  # the layer's RMSNorm
        self.mlp = GateMLP(hidden_size, rank, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return (y * torch.sigmoid(self.mlp(y).to(acc_dtype(y.dtype)))).to(y.dtype)
