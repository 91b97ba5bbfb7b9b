"""Attention sinks (DESIGN §11): a learned logit per head that joins every softmax as one more key without a value.

out    [T, N, V]   a finished attention (every partial merged)     lse [N, T] natural log (float32 / float64)
sinks  [N] float32 the sink logit s_h of each head
-> out [T, N, V] (out's dtype), lse [N, T] (lse's dtype)

With the sink the softmax's denominator gains ``exp(s_h)`` and no value is added, so

    lse' = logaddexp(lse, s_h)        out' = out * exp(lse - lse') = out * sigmoid(lse - s_h)

Applied once, after the merges: the merge is associative, so the sink is one more partial ``(0, s_h)`` folded
in last, on every path (chunked, absorbed, sparse; host and device plans; any backend). A token without keys
(``lse = -inf``) gets ``(0, s_h)``; a sink of ``-inf`` changes nothing; NaN stays NaN. Plain tensor code on any
device (``torch.compile`` fuses it into its neighbours); computed in the LSE's dtype, rounded once to out's.
"""

from __future__ import annotations

import torch

from .. import _checks as checks


def check_sinks(sinks, num_heads: int, device: torch.device, device_of: str = "q") -> None:
    """``sinks``: None, or a float32 ``[N]`` tensor on ``device``."""
    if sinks is None:
        return
    checks.check_tensor(sinks, "sinks", 1, "[N]", device, device_of, dtype=torch.float32)
    if sinks.shape[0] != num_heads:
        raise ValueError(f"sinks must be [N] = [{num_heads}] (one logit per head of q), got {list(sinks.shape)}")


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out', lse')`` with each head's sink in the softmax (module doc)."""
    sink = sinks.to(lse.dtype)[:, None]  # [N, 1]
    merged = torch.logaddexp(lse, sink)
    # exp(lse - lse') is sigmoid(lse - s_h); where both are -inf (no key, a -inf sink) it is 0, not NaN.
    weight = torch.where(merged == float("-inf"), 0.0, torch.exp(lse - merged))
    return (out.to(lse.dtype) * weight.t()[..., None]).to(out.dtype), merged
