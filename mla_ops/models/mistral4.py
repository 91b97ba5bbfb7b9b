"""Mistral 4 (Mistral Small 4, transformers' ``mistral4``): the config.json keys a DeepSeek-V3 config lacks.

Mistral 4 is DeepSeek-V3's decoder (q LoRA, YaRN, interleaved RoPE rows, shared expert) with three
differences, each a named part of ``mla_ops.models``:

* the gate: softmax scores, groups ranked by the sum of their two best, no correction bias
  (``topk_method="group_top2"``, ``mla_ops.models.moe``; its record in ``families.FAMILIES`` gives it);
* the query scale ``1 + beta * log(1 + floor(position / original_max_position_embeddings))``
  (``mla_ops.models.query_scale``), from ``rope_parameters.llama_4_scaling_beta`` and YaRN's
  ``original_max_position_embeddings``: both required, as transformers' Mistral4Attention reads them always;
* stacked experts in the checkpoint (3-D ``mlp.experts.gate_up_proj`` / ``down_proj``), read as is.

``rope_parameters.partial_rotary_factor``: transformers rotates ``int(head_dim * factor)`` dimensions, with
head_dim = qk_nope_head_dim + qk_rope_head_dim; that must be qk_rope_head_dim (it is for the
R / (P + R) transformers writes), since the rope rows are the R of ``q_b_proj`` and ``kv_a_proj_with_mqa``.
"""

from __future__ import annotations

from .. import _checks
from .scalings import QueryScale


def config_kwargs(c: dict) -> dict:
    """MLAConfig keyword arguments from the keys only Mistral 4 has (their values checked, each error naming
    the key)."""
    key = "rope_parameters" if c.get("rope_parameters") is not None else "rope_scaling"
    rope = c.get(key)
    if not isinstance(rope, dict):
        raise ValueError(f"config.json of model_type 'mistral4' needs rope_parameters (an object with "
                         f"llama_4_scaling_beta), got {key}={rope!r}")
    factor = rope.get("partial_rotary_factor")
    if factor is not None:
        factor = _checks.check_real(factor, f"{key}.partial_rotary_factor")
        nope = _checks.check_int(c.get("qk_nope_head_dim"), "qk_nope_head_dim", 1)
        rope_dim = _checks.check_int(c.get("qk_rope_head_dim"), "qk_rope_head_dim", 1)
        if int((nope + rope_dim) * factor) != rope_dim:  # transformers' int(head_dim * factor)
            raise ValueError(
                f"{key}.partial_rotary_factor={factor} rotates int({nope + rope_dim} * {factor}) = "
                f"{int((nope + rope_dim) * factor)} dimensions of each head, but qk_rope_head_dim={rope_dim} "
                f"(the factor must be qk_rope_head_dim / (qk_nope_head_dim + qk_rope_head_dim))")
    for name in ("llama_4_scaling_beta", "original_max_position_embeddings"):
        if rope.get(name) is None:
            raise ValueError(f"config.json lacks {key}.{name}, which Mistral 4's query scale needs")
    beta = _checks.check_real(rope["llama_4_scaling_beta"], f"{key}.llama_4_scaling_beta", positive=False)
    original = _checks.check_int(rope["original_max_position_embeddings"], f"{key}.original_max_position_embeddings", 1)
    return dict(query_scale=QueryScale(beta, original))
