"""Position-dependent query scales: a per-token factor of the whole query ``[q_nope | q_pe]``, so it cannot go into
the softmax scale (one host float for all tokens); the model multiplies q by it before the attention op, which
makes it the same for the chunk loop and the absorbed path. Each is computed from the step's positions once per
step (``ModelStep.begin``), like the rotary tables.

* ``PositionScale``, Mistral 4's (transformers' ``get_llama_4_attn_scale``; its record ``scalings.QueryScale``):

  positions [T]  ->  scales [T]   q of token t times 1 + beta * log(1 + floor(positions[t] / original))

  ``original`` is ``original_max_position_embeddings`` (YaRN's): the scale is 1 inside the original context and
  grows by steps of it past there.
* ``LogPositionScale``, Mistral Large 4's (``Scalings.learned_query_scale``): learned per head,
  ``scale[h] * log(position + 1) + bias[h]``, in the attention and the indexer; ``log_positions`` is its
  per-step input.
"""

from __future__ import annotations

import torch

from torch import nn

from .parts import acc_dtype
from .scalings import QueryScale


class PositionScale(nn.Module):
    """The model's ``QueryScale``: positions [T] -> [T] factors in ``acc_dtype(dtype)``."""

    def __init__(self, scale: QueryScale):
        super().__init__()
        self.beta, self.original = scale.beta, scale.original_max_position_embeddings

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        blocks = torch.div(positions.long(), self.original, rounding_mode="floor")
        return 1 + self.beta * torch.log(1 + blocks.to(acc_dtype(dtype)))


class LogPositionScale(nn.Module):
    """A learned per-head query factor ``scale[h] * log(position + 1) + bias[h]`` (transformers'
    ``MistralLarge4TextSoftmaxScaling``). ``log_positions`` [T] (``ModelStep.log_positions``), q [T, heads, D]."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(num_heads))  # 0 * log + 1: no scaling until loaded
        self.bias = nn.Parameter(torch.ones(num_heads))

    def forward(self, q: torch.Tensor, log_positions: torch.Tensor) -> torch.Tensor:
        factor = self.scale[None, :] * log_positions.to(q.dtype)[:, None] + self.bias[None, :]  # [T, heads]
        return q * factor[:, :, None]


def log_positions(positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T] ``log(position + 1)`` for integer positions [T] (float32 as transformers', float64 for float64)."""
    return (positions.to(torch.promote_types(dtype, torch.float32)) + 1).log()
