"""Tensor-parallel sharding of a DeepSeek model over the context-parallel group (DESIGN §10, "End to
end"): which parameters are split along which dim, rank r's slice of D, and the all-reduce that sums
the partial outputs. Plain functions after gpt-fast's ``tp.py``, no framework: the layers stay the
single-device layers, built with the local head count and intermediate sizes.

Split (each rank keeps 1/D): the query heads (``q_proj`` / ``q_b_proj`` / ``kv_b_proj`` rows, ``o_proj``
columns), the dense MLP and the shared and routed experts along their intermediate size (gate/up rows,
down columns; the stacked ``experts.gate_up_proj [E, 2I, H]`` keeps its I/D slice of gate AND of up).
Whole on every rank: ``embed_tokens``, the norms, ``q_a_proj``, ``kv_a_proj_with_mqa``, the router
(``mlp.gate``) and ``lm_head``. ``o_proj`` and the down projections then give partial sums, which
``all_reduce`` adds up, so the hidden states and the logits are the same on every rank.
"""

from __future__ import annotations

import torch

from . import collectives

# Parameter name endings -> the dim each rank takes 1/D of (per-expert checkpoint tensors included).
_ROWS = ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight",
         "gate_proj.weight", "up_proj.weight")
_COLUMNS = ("self_attn.o_proj.weight", "down_proj.weight")
GATE_UP = "mlp.experts.gate_up_proj"  # [E, 2I, H]: gate rows then up rows, each split
DOWN = "mlp.experts.down_proj"  # [E, H, I]


def shard_dim(name: str) -> int | None:
    """The dim of parameter ``name`` (full model or checkpoint name) that is split; None: kept whole."""
    if name.endswith(_ROWS):
        return 0
    if name.endswith(_COLUMNS):
        return 1
    if name.endswith(GATE_UP):
        return 1
    if name.endswith(DOWN):
        return 2
    return None


def shard_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s contiguous 1/D of ``size`` (divisible: ``check_divisible``)."""
    step = size // world_size
    return rank * step, (rank + 1) * step


def shard_ranges(name: str, size: int, rank: int, world_size: int) -> list[tuple[int, int]]:
    """The ranges of ``shard_dim(name)`` that rank ``rank`` keeps: one, or two for ``gate_up_proj``
    (its slice of gate, then of up)."""
    if name.endswith(GATE_UP):
        half = size // 2
        start, stop = shard_range(half, rank, world_size)
        return [(start, stop), (half + start, half + stop)]
    return [shard_range(size, rank, world_size)]


def shard_tensor(name: str, tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the full parameter ``name`` (the tensor itself when kept whole)."""
    dim = shard_dim(name)
    if dim is None or world_size == 1:
        return tensor
    pieces = [tensor.narrow(dim, start, stop - start)
              for start, stop in shard_ranges(name, tensor.shape[dim], rank, world_size)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def check_divisible(sizes: dict[str, int], world_size: int) -> None:
    """Every split size must divide by D: a ValueError naming ``context_parallel`` otherwise."""
    bad = {name: size for name, size in sizes.items() if size % world_size}
    if bad:
        listed = ", ".join(f"{name}={size}" for name, size in bad.items())
        raise ValueError(f"context_parallel: {listed} not divisible by the group's {world_size} ranks (each rank "
                         "keeps 1/D of the query heads and of the MLP and experts' intermediate size)")


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over the group's ranks (functional collective: eager, and a graph node under torch.compile);
    ``group`` None: one device, ``x`` itself."""
    if group is None:
        return x
    return collectives.all_reduce(x, group)
