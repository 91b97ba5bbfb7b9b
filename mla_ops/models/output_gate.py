"""The attention's output gate (HY-V4's and A.X-K2's, ``MLAConfig.output_gate``): the attention output of every
head times a sigmoid of per-head, per-dim logits made from the layer's input, before ``o_proj``:

out [T, N, V]   gate [T, N, V]   ->   out * sigmoid(gate)

HY-V4 makes the logits with a projection of the attention's input (``self_attn.gate_proj``); A.X-K2 with the
query's fused projection (``self_attn.q_gate_proj``: per head P+R query dims, then V gate dims). Both in the
attention's ``project`` (``mla_ops.models.layer``), so it compiles with the other dense parts. The sigmoid is taken
in float32 (float64 kept), as transformers' A.X-K2 does.
"""

from __future__ import annotations

import torch

from .parts import acc_dtype


def gated(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """``out * sigmoid(gate)`` in ``out``'s dtype; ``out`` itself without a gate."""
    if gate is None:
        return out
    return (out.to(acc_dtype(out.dtype)) * torch.sigmoid(gate.to(acc_dtype(gate.dtype)))).to(out.dtype)
