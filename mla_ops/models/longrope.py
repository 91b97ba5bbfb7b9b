"""LongRoPE (``rope_scaling`` of type ``"longrope"``): plain RoPE with each frequency divided by a given
factor, as MiniCPM3's release has it.

inv_freq [R/2] = 1 / (short_factor * theta ** (2i / R))   cos, sin times ``attention_factor``

transformers' ``_compute_longrope_parameters`` switches every position to ``long_factor`` once a sequence
passes ``original_max_position_embeddings``. Keys are cached already rotated, so that switch cannot be
served; a config whose ``max_position_embeddings`` passes ``original_max_position_embeddings`` is refused
(MiniCPM3-4B has both at 32,768: the short factors hold everywhere).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import _checks


@dataclass(frozen=True)
class LongRopeScaling:
    short_factor: tuple[float, ...]  # [R/2] divisors of the RoPE frequencies
    original_max_position_embeddings: int
    attention_factor: float = 1.0  # cos/sin multiplier

    @classmethod
    def from_dict(cls, scaling: dict, max_position_embeddings: int, key: str) -> LongRopeScaling:
        """config.json's ``rope_scaling`` / ``rope_parameters`` (nulls already dropped), checked, each error
        naming ``key.<entry>``."""
        original = _checks.check_int(scaling.get("original_max_position_embeddings", max_position_embeddings),
                                     f"{key}.original_max_position_embeddings", 1)
        if max_position_embeddings > original:
            raise ValueError(
                f"{key}: longrope with max_position_embeddings={max_position_embeddings} > "
                f"original_max_position_embeddings={original} is not supported (past it transformers switches every "
                "position to long_factor, which a cache of rotated keys cannot follow)"
            )
        factors = scaling.get("short_factor")
        if not isinstance(factors, (list, tuple)) or not factors:
            raise TypeError(f"{key}.short_factor must be a list of numbers, got {factors!r}")
        factors = tuple(_checks.check_real(f, f"{key}.short_factor[{i}]") for i, f in enumerate(factors))
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:  # transformers' rule, from factor (else the two lengths' ratio)
            factor = _checks.check_real(scaling.get("factor", max_position_embeddings / original), f"{key}.factor")
            attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        return cls(factors, original, _checks.check_real(attention_factor, f"{key}.attention_factor"))

    def check_rope_dim(self, rope_dim: int, key: str = "rope_scaling") -> None:
        if len(self.short_factor) != rope_dim // 2:
            raise ValueError(f"{key}.short_factor must have qk_rope_head_dim / 2 = {rope_dim // 2} entries, got "
                             f"{len(self.short_factor)}")

    def inverse_frequencies(self, pos_freqs: torch.Tensor) -> torch.Tensor:
        """``pos_freqs`` [R/2] = theta ** (2i / R) -> the scaled angular frequencies [R/2]."""
        return 1.0 / (pos_freqs.new_tensor(self.short_factor) * pos_freqs)

    def cos_sin_factor(self) -> float:
        return self.attention_factor

    def softmax_scale_factor(self) -> float:
        return 1.0
