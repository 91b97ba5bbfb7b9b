"""A position-dependent query scale (Mistral 4's, transformers' ``get_llama_4_attn_scale``).

positions [T]  ->  scales [T]   q of token t times 1 + beta * log(1 + floor(positions[t] / original))

``original`` is ``original_max_position_embeddings`` (YaRN's): the scale is 1 inside the original context and
grows by steps of it past there. It is a per-token factor of the whole query ``[q_nope | q_pe]``, so it cannot
go into the softmax scale (one host float for all tokens); the model multiplies q by it before the attention
op, which makes it the same for the chunk loop and the absorbed path. The model's ``PositionScale`` computes it
once per step (``ModelStep.begin``), like the rotary tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch import nn

from .. import _checks
from .rope import acc_dtype


@dataclass(frozen=True)
class QueryScale:
    """``rope_parameters.llama_4_scaling_beta`` and ``original_max_position_embeddings`` of config.json."""

    beta: float
    original_max_position_embeddings: int

    def __post_init__(self):
        object.__setattr__(self, "beta", _checks.check_real(self.beta, "query_scale.beta", positive=False))
        object.__setattr__(self, "original_max_position_embeddings", _checks.check_int(
            self.original_max_position_embeddings, "query_scale.original_max_position_embeddings", 1))


class PositionScale(nn.Module):
    """The model's ``QueryScale``: positions [T] -> [T] factors in ``acc_dtype(dtype)``."""

    def __init__(self, scale: QueryScale):
        super().__init__()
        self.beta, self.original = scale.beta, scale.original_max_position_embeddings

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        blocks = torch.div(positions.long(), self.original, rounding_mode="floor")
        return 1 + self.beta * torch.log(1 + blocks.to(acc_dtype(dtype)))
