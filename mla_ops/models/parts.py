"""Small model parts the layers, the model and the feed-forward blocks share, whatever the family."""

from __future__ import annotations

import torch
from torch import nn


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute in (norms, rotary tables, query factors): float32 for half types, float64 kept."""
    return torch.promote_types(dtype, torch.float32)


def linear(in_features: int, out_features: int, std: float) -> nn.Linear:
    """A bias-free projection with normal(0, std) weights (DeepSeek's ``initializer_range``)."""
    layer = nn.Linear(in_features, out_features, bias=False)
    nn.init.normal_(layer.weight, std=std)
    return layer


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (Mistral Large 4's ``final_logit_softcapping``); nothing for None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap
