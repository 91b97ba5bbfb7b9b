"""Decompositions that let Inductor fuse the merge and the device planner with their neighbours.

Both ops are plain tensor code already (their torch implementations); registered here, Inductor
traces through them instead of calling an opaque kernel, so the merge becomes part of one
pointwise kernel and the planner a fused scan. The gather and attention ops stay opaque out= ops.

Private API: ``torch._inductor.decomposition`` (written against torch 2.13, works on 2.11).
"""

from __future__ import annotations

import torch
import torch._inductor.decomposition as inductor_decomposition

from mla_ops.ops.merge import merge_states_reference
from mla_ops.planning.device_schedule import device_plan_tensors

# op -> the function Inductor traces in its place. Its sources are part of the compile-cache key.
DECOMPOSITIONS = {
    torch.ops.mla_ops.merge_attn_states.default: merge_states_reference,
    torch.ops.mla_ops.plan_context_chunks_device.default: device_plan_tensors,
}


def register() -> list[str]:
    """Put ``DECOMPOSITIONS`` into Inductor's table; returns the ops now decomposed."""
    table = inductor_decomposition.decompositions
    for op, fn in DECOMPOSITIONS.items():
        table[op] = fn
    # Inductor caches a merged copy of the table; rebuild it so the entries are seen.
    cached = getattr(inductor_decomposition, "fast_random_decomps", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()
    return [str(op) for op in DECOMPOSITIONS]
