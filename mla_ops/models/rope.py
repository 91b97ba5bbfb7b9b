"""Rotary position embeddings of DeepSeek's MLA: plain RoPE, YaRN and LongRoPE (MiniCPM3's), in the halves
layout; their records (``YarnScaling``, ``LongRopeScaling``) are ``mla_ops.models.scalings``'.

positions [T]  ->  cos, sin [T, R]   each of the R/2 frequencies twice: [f_0 .. f_{R/2-1} | f_0 .. f_{R/2-1}]

The frequencies are built once, from the config, as the model's ``rotary_emb`` (``RotaryEmbedding``, as
gpt-fast's ``freqs_cis``); a step turns its positions into cos and sin with tensor code alone.

YaRN (``rope_scaling`` of every released DeepSeek-V2/V3 config) changes the frequencies at every
position, not only far out: frequencies that turn fewer than ``beta_slow`` times over the original
context are divided by ``factor``, those that turn more than ``beta_fast`` times are kept, and a
linear ramp blends the dimensions between. cos and sin are multiplied by ``attention_factor``
(``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)``: 1 for DeepSeek's
releases), and the attention's softmax scale by ``yarn_mscale(factor, mscale_all_dim) ** 2``
(x 1.5896 for V2-Lite). The formulas are those of DeepSeek's code and transformers'
``_compute_yarn_parameters`` / ``yarn_apply_mscale`` (truncated correction range by default).

DeepSeek's checkpoints lay out the R rope rows of each head in interleaved pairs (x0, x1), (x2, x3),
...; the layers here rotate halves (x_i with x_{i+R/2}), so a loader permutes those weight rows once
(``deinterleave_index``: evens first, then odds) and the rotation is then the same to the bit.
"""

from __future__ import annotations

import math

import torch

from torch import nn

from .parts import acc_dtype
from .scalings import LongRopeScaling, YarnScaling


def inverse_frequencies(rope_dim: int, theta: float, scaling: YarnScaling | LongRopeScaling | None, device,
                        dtype) -> torch.Tensor:
    """[R/2] angular frequencies (radians per position)."""
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, device=device, dtype=dtype) / rope_dim)  # [R/2]
    extrapolation = 1.0 / pos_freqs
    if scaling is None:
        return extrapolation
    if isinstance(scaling, LongRopeScaling):  # each frequency divided by its given factor
        return 1.0 / (pos_freqs.new_tensor(scaling.short_factor) * pos_freqs)
    interpolation = 1.0 / (scaling.factor * pos_freqs)
    low, high = correction_range(scaling, rope_dim, theta)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, device=device, dtype=dtype) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (fast dims), 0: divided by factor (slow dims)
    return interpolation * (1 - keep) + extrapolation * keep


def correction_range(y: YarnScaling, rope_dim: int, theta: float) -> tuple[float, float]:
    """YaRN's dimension pairs [low, high] over which the ramp blends kept and interpolated frequencies."""
    def dim_of(rotations: float) -> float:  # the pair index that turns `rotations` times
        return rope_dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = dim_of(y.beta_fast), dim_of(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rope_dim - 1)


class RotaryEmbedding(nn.Module):
    """The model's rotary frequencies, built once: ``inv_freq`` [R/2], float64, rebuilt from the config whenever
    the model moves or is cast (a cast to a half type must not round them). ``learned``: Mistral Large 4's
    learned log-factors ``alpha`` [R/2] (``inv_freq * exp(alpha)``; float32 as transformers keeps them), a
    parameter its checkpoint fills (``model.rotary_emb.alpha``)."""

    def __init__(self, rope_dim: int, theta: float, scaling: YarnScaling | LongRopeScaling | None = None,
                 learned: bool = False):
        super().__init__()
        self.rope_dim, self.theta, self.scaling = rope_dim, theta, scaling
        self.factor = 1.0 if scaling is None else scaling.cos_sin_factor()  # cos/sin multiplier
        self.register_buffer("inv_freq", self._frequencies(None), persistent=False)
        self.alpha = nn.Parameter(torch.zeros(rope_dim // 2, dtype=torch.float32)) if learned else None

    def _frequencies(self, device) -> torch.Tensor:
        return inverse_frequencies(self.rope_dim, self.theta, self.scaling, device, torch.float64)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = self._frequencies(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, R] in ``acc_dtype(dtype)`` for token positions [T]."""
        acc = acc_dtype(dtype)
        inv_freq = self.inv_freq.to(acc)
        if self.alpha is not None:
            inv_freq = inv_freq * self.alpha.to(acc).exp()
        freqs = positions.to(acc)[:, None] * inv_freq[None, :]  # [T, R/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, R]
        if self.scaling is None:
            return emb.cos(), emb.sin()
        return emb.cos() * self.factor, emb.sin() * self.factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [..., R]; cos, sin broadcast to x. Checkpoints in DeepSeek's interleaved
    layout are permuted at load time (``deinterleave_index``)."""
    y = x.to(cos.dtype)
    return (y * cos + rotate_half(y) * sin).to(x.dtype)


def deinterleave_index(rope_dim: int) -> torch.Tensor:
    """[R] row order that turns interleaved pairs into halves: 0, 2, 4, ..., 1, 3, 5, ..."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
