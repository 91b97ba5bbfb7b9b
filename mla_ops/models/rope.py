"""Rotary position embeddings of DeepSeek's MLA: plain RoPE and YaRN, in the halves layout (LongRoPE,
MiniCPM3's: ``mla_ops.models.longrope``).

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
from dataclasses import dataclass

import torch

from torch import nn

from .longrope import LongRopeScaling


@dataclass(frozen=True)
class YarnScaling:
    """``rope_scaling`` of type ``"yarn"`` (the field names of DeepSeek's config.json)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # cos/sin multiplier; None: derived from factor and the mscales
    truncate: bool = True  # round the correction range outwards to whole dimensions

    @classmethod
    def from_dict(cls, scaling: dict, max_position_embeddings: int) -> YarnScaling | None:
        """From config.json's ``rope_scaling`` or transformers' ``rope_parameters``; None for plain RoPE."""
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind in (None, "default"):
            return None
        if kind != "yarn":
            raise ValueError(f"rope_scaling type {kind!r} is not supported (DeepSeek models use 'yarn' or none)")
        original = scaling.get("original_max_position_embeddings") or max_position_embeddings
        factor = scaling.get("factor")
        if factor is None:  # transformers' rule: the ratio of the two lengths
            factor = max_position_embeddings / original
        return cls(
            factor=float(factor), original_max_position_embeddings=int(original),
            beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1),
            mscale=scaling.get("mscale"), mscale_all_dim=scaling.get("mscale_all_dim"),
            attention_factor=scaling.get("attention_factor"), truncate=bool(scaling.get("truncate", True)),
        )

    def cos_sin_factor(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_scale_factor(self) -> float:
        if not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    def correction_range(self, rope_dim: int, theta: float) -> tuple[float, float]:
        """Dimension pairs [low, high] over which the ramp blends kept and interpolated frequencies."""
        def dim_of(rotations: float) -> float:  # the pair index that turns `rotations` times
            return rope_dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, rope_dim - 1)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(rope_dim: int, theta: float, scaling: YarnScaling | LongRopeScaling | None, device,
                        dtype) -> torch.Tensor:
    """[R/2] angular frequencies (radians per position)."""
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, device=device, dtype=dtype) / rope_dim)  # [R/2]
    extrapolation = 1.0 / pos_freqs
    if scaling is None:
        return extrapolation
    if isinstance(scaling, LongRopeScaling):
        return scaling.inverse_frequencies(pos_freqs)
    interpolation = 1.0 / (scaling.factor * pos_freqs)
    low, high = scaling.correction_range(rope_dim, theta)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, device=device, dtype=dtype) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (fast dims), 0: divided by factor (slow dims)
    return interpolation * (1 - keep) + extrapolation * keep


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


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
