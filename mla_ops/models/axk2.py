"""A.X-K2's config readers and checkpoint names (model type ``axk2``; its record in ``families.FAMILIES``).

The model is DeepSeek-V3.2's sparse layers (DESIGN §12; A.X-K2's dims: 160-wide latent rows, L = 128, R = 32, an
indexer of 16 x 128) with: no ``q_b_proj``, one fused projection of [normed, raw] q-LoRA latent giving the query and
a per-head, per-dim sigmoid output gate (``output_gate="query"``, ``mla_ops.models.output_gate``); gated RMSNorms
(``gated_norm_rank``, ``mla_ops.models.gated_norm``) on every layer's input norm and on the MoE layers'
post-attention norm; its router V3's with the experts of dropped groups scored 0 (``noaux_tc_zero``), over one group
without ``n_group`` (A.X-K2-Light).

Checkpoint names: the release's, as transformers' save_pretrained writes them too: ``self_attn.q_b_proj`` (the fused
query-and-gate projection, the model's ``q_gate_proj``) and the gate MLPs' ``W_down`` / ``W_up`` (``mlp.fc1`` /
``mlp.fc2``), renamed as transformers' loader does (``transformers_name``); per-expert tensors stacked as every
family's.
"""

from __future__ import annotations

import re

_RENAMES = tuple((re.compile(pattern), repl) for pattern, repl in (
    (r"W_down", "mlp.fc1"),
    (r"W_up", "mlp.fc2"),
    (r"self_attn\.q_b_proj\.", "self_attn.q_gate_proj."),
))


def transformers_name(name: str) -> str:
    """A release (or save_pretrained) tensor name -> transformers' module name, which the model uses."""
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


def prepare(c: dict) -> dict:
    """AXK2Config's refusals: a ``q_lora_rank`` (the indexer and the gate read the q-LoRA latent), ``n_group`` and
    ``topk_group`` set together (both null: no groups)."""
    if "q_lora_rank" in c and c["q_lora_rank"] is None:
        raise ValueError("config.json sets q_lora_rank=null: A.X-K2's query, gate and indexer read the q-LoRA latent")
    if (c.get("n_group") is None) != (c.get("topk_group") is None):
        raise ValueError(f"n_group and topk_group must be set together (both null: no expert groups), got "
                         f"n_group={c.get('n_group')!r}, topk_group={c.get('topk_group')!r}")
    return c


def config_kwargs(c: dict) -> dict:
    return dict(gated_norm_rank=c.get("gated_norm_rank", 16))
