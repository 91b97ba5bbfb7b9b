"""The scaling records of ``MLAConfig``'s fields, as config.json's ``rope_scaling`` / ``rope_parameters`` give
them: data and their checks, no tensors (the tables they make are ``rope.py``'s and ``query_scale.py``'s).

* ``YarnScaling`` (``MLAConfig.rope_scaling``): YaRN, every released DeepSeek-V2/V3 config's;
* ``LongRopeScaling`` (``MLAConfig.rope_scaling``): LongRoPE, MiniCPM3's;
* ``QueryScale`` (``Scalings.query_scale``): Mistral 4's position-dependent query scale.

``read_rope_scaling`` reads config.json's ``rope_scaling`` (or ``rope_parameters``) into one of the first two, or
None for plain RoPE; each error names the key. Each rope record carries its ``rope_type``, so its dict form
(``dataclasses.asdict``, as in an ``MLAConfig``'s) reads back as the same record, also through JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .. import _checks


@dataclass(frozen=True)
class YarnScaling:
    """``rope_scaling`` of type ``"yarn"`` (the field names of DeepSeek's config.json); its formulas: ``rope.py``."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # cos/sin multiplier; None: derived from factor and the mscales
    truncate: bool = True  # round the correction range outwards to whole dimensions
    # config.json's key, so that ``dataclasses.asdict`` of a config reads back as this record (not plain RoPE)
    rope_type: str = field(default="yarn", init=False)

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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def check_yarn(y: YarnScaling, key: str) -> None:
    _checks.check_real(y.factor, f"{key}.factor")
    _checks.check_int(y.original_max_position_embeddings, f"{key}.original_max_position_embeddings", 1)
    _checks.check_real(y.beta_fast, f"{key}.beta_fast")
    _checks.check_real(y.beta_slow, f"{key}.beta_slow")
    _checks.check_real(y.mscale, f"{key}.mscale", None, optional=True)
    _checks.check_real(y.mscale_all_dim, f"{key}.mscale_all_dim", None, optional=True)
    _checks.check_real(y.attention_factor, f"{key}.attention_factor", optional=True)
    _checks.check_bool(y.truncate, f"{key}.truncate")


@dataclass(frozen=True)
class LongRopeScaling:
    """LongRoPE (``rope_scaling`` of type ``"longrope"``): plain RoPE with each frequency divided by a given
    factor, as MiniCPM3's release has it.

    inv_freq [R/2] = 1 / (short_factor * theta ** (2i / R))   cos, sin times ``attention_factor``

    transformers' ``_compute_longrope_parameters`` switches every position to ``long_factor`` once a sequence
    passes ``original_max_position_embeddings``. Keys are cached already rotated, so that switch cannot be
    served; a config whose ``max_position_embeddings`` passes ``original_max_position_embeddings`` is refused
    (MiniCPM3-4B has both at 32,768: the short factors hold everywhere).
    """

    short_factor: tuple[float, ...]  # [R/2] divisors of the RoPE frequencies
    original_max_position_embeddings: int
    attention_factor: float = 1.0  # cos/sin multiplier
    rope_type: str = field(default="longrope", init=False)  # config.json's key (see YarnScaling's)

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

    def cos_sin_factor(self) -> float:
        return self.attention_factor

    def softmax_scale_factor(self) -> float:
        return 1.0


def read_rope_scaling(scaling, max_position_embeddings: int,
                      key: str = "rope_scaling") -> YarnScaling | LongRopeScaling | None:
    """config.json's ``rope_scaling`` (or ``rope_parameters``) checked and read: a ``YarnScaling``, a
    ``LongRopeScaling``, or None for plain RoPE. A null entry takes its default."""
    _checks.check_object(scaling, key)
    for name in ("rope_type", "type"):
        if scaling.get(name) is not None:
            _checks.check_str(scaling[name], f"{key}.{name}")
    clean = {k: v for k, v in scaling.items() if v is not None}
    kind = clean.get("rope_type", clean.get("type", "default"))
    if kind == "longrope":
        return LongRopeScaling.from_dict(clean, max_position_embeddings, key)
    if kind == "yarn":
        for name, positive in (("factor", True), ("beta_fast", True), ("beta_slow", True),
                               ("attention_factor", True), ("mscale", None), ("mscale_all_dim", None)):
            if name in clean:
                clean[name] = _checks.check_real(clean[name], f"{key}.{name}", positive)
        if "original_max_position_embeddings" in clean:
            _checks.check_int(clean["original_max_position_embeddings"], f"{key}.original_max_position_embeddings", 1)
        if "truncate" in clean:
            _checks.check_bool(clean["truncate"], f"{key}.truncate")
    y = YarnScaling.from_dict(clean, max_position_embeddings)  # an unknown type: a ValueError naming it
    if y is not None:
        check_yarn(y, key)
    return y


@dataclass(frozen=True)
class QueryScale:
    """Mistral 4's query scale (``query_scale.py``): ``rope_parameters.llama_4_scaling_beta`` and
    ``original_max_position_embeddings`` of config.json."""

    beta: float
    original_max_position_embeddings: int

    def __post_init__(self):
        object.__setattr__(self, "beta", _checks.check_real(self.beta, "query_scale.beta", positive=False))
        object.__setattr__(self, "original_max_position_embeddings", _checks.check_int(
            self.original_max_position_embeddings, "query_scale.original_max_position_embeddings", 1))

