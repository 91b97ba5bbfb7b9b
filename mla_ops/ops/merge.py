"""Merging two attention partials over disjoint key sets by log-sum-exp.

prefix_out [T, N, V]   prefix_lse [N, T]   (natural log; float32, float64 for float64 outputs)
suffix_out [T, N, V]   suffix_lse [N, T]
-> out [T, N, V] (dtype of prefix_out), lse [N, T]

Empty partials (``lse = ±inf``; FA2 and FlashMLA report ``+inf`` for a row with no keys) count as
``0 / -inf``; merging two empty partials gives ``0 / -inf``, never NaN. A NaN partial (``lse`` NaN:
a row whose scores were not finite, ``poisoned_rows``) merged with anything stays NaN, out and lse.
"""

from __future__ import annotations

import torch

from .._mla import lse_dtype


def merge_states_reference(
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_out: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = lse_dtype(prefix_out.dtype)
    a = prefix_lse.to(acc)
    b = suffix_lse.to(acc)
    a = torch.where(torch.isinf(a), float("-inf"), a)  # +inf (FA2, FlashMLA) means empty too
    b = torch.where(torch.isinf(b), float("-inf"), b)
    m = torch.maximum(a, b)
    m = torch.where(torch.isinf(m), 0.0, m)  # both empty: keep exp() finite
    wa = torch.exp(a - m)
    wb = torch.exp(b - m)
    total = wa + wb
    lse = torch.log(total) + m  # -inf where both are empty
    total = torch.where(total > 0, total, 1.0)
    wa = (wa / total).transpose(0, 1).unsqueeze(-1)  # [T, N, 1]
    wb = (wb / total).transpose(0, 1).unsqueeze(-1)
    out = prefix_out.to(acc) * wa + suffix_out.to(acc) * wb
    return out.to(prefix_out.dtype), lse


def poisoned_rows(lse: torch.Tensor, empty: torch.Tensor | None = None) -> torch.Tensor:
    """bool like ``lse``: the rows of a partial that saw a key (not ``empty``, which broadcasts to ``lse``;
    None: every row did) and whose LSE is not finite. Finite scores give a finite LSE, so such a row had a
    NaN or inf score (a non-finite input, an overflow): the attention ops make it NaN, out and lse, since an
    LSE of ``-inf`` (the empty partial) or ``+inf`` (read as empty by the merge) would let a merge turn it
    into a finite answer."""
    bad = ~torch.isfinite(lse)
    return bad if empty is None else bad & ~empty


def scores_nan_for_neg_inf_(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` with -inf made NaN, in place, before a mask writes its -inf: a score of -inf from the
    inputs (an inf in q or a key, an overflow) is not finite and must reach the answer as NaN, not read as a
    hidden key (the kernels do the same)."""
    return scores.masked_fill_(scores == float("-inf"), float("nan"))


def merge_into(partial, block):
    """A running partial ``(out, lse)`` with the partial ``block`` of further keys folded in; None: no
    keys yet (the block itself)."""
    return block if partial is None else merge_states_reference(*partial, *block)


@torch.library.custom_op("mla_ops::merge_attn_states", mutates_args=())
def _merge_attn_states(
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_out: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = merge_states_reference(prefix_out, prefix_lse, suffix_out, suffix_lse)
    # Elementwise results follow their inputs' layout; the op promises contiguous ones (its fake).
    return out.contiguous(), lse.contiguous()


@_merge_attn_states.register_fake
def _(prefix_out, prefix_lse, suffix_out, suffix_lse):
    out = torch.empty_like(prefix_out, memory_format=torch.contiguous_format)
    return out, torch.empty_like(prefix_lse, dtype=lse_dtype(prefix_out.dtype), memory_format=torch.contiguous_format)


def merge_attn_states(
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_out: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials of the same queries; returns ``(out [T, N, V], lse [N, T])``."""
    for name, out, lse in (("prefix", prefix_out, prefix_lse), ("suffix", suffix_out, suffix_lse)):
        if out.dim() != 3:
            raise ValueError(f"{name}_out must be [T, N, V], got shape {tuple(out.shape)}")
        if lse.shape != (out.shape[1], out.shape[0]):
            raise ValueError(
                f"{name}_lse must be [N, T] = {[out.shape[1], out.shape[0]]}, got {list(lse.shape)}"
            )
        if not lse.dtype.is_floating_point:
            raise TypeError(f"{name}_lse must be floating point, got {lse.dtype}")
    if prefix_out.shape != suffix_out.shape:
        raise ValueError(
            f"prefix_out and suffix_out must have the same shape, got {tuple(prefix_out.shape)} "
            f"and {tuple(suffix_out.shape)}"
        )
    if prefix_out.dtype != suffix_out.dtype:
        raise TypeError(f"prefix_out and suffix_out dtypes differ: {prefix_out.dtype}, {suffix_out.dtype}")
    return torch.ops.mla_ops.merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse)
