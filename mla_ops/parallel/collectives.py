"""The collectives of context parallel: ``torch.distributed``'s functional collectives, which run
eagerly and become graph nodes under ``torch.compile`` (NCCL on GPU, gloo on CPU)."""

from __future__ import annotations

import torch

_funcol = None


def _collectives():
    global _funcol
    if _funcol is None:
        import torch.distributed._functional_collectives as funcol

        _funcol = funcol
    return _funcol


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """[n, ...] from every rank -> [D * n, ...], rank after rank."""
    funcol = _collectives()
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # torch 2.11: the latter
    return gather(x.contiguous(), 0, group)


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """[D, ...]: block e goes to rank e; returns [D, ...], block d from rank d."""
    return _collectives().all_to_all_single(x.contiguous(), None, None, group)


def wait(x: torch.Tensor) -> torch.Tensor:
    """The plain tensor of an eager functional collective (traced ones are plain already)."""
    return x.wait() if isinstance(x, _collectives().AsyncCollectiveTensor) else x


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The elementwise sum over the group, the same on every rank."""
    return wait(_collectives().all_reduce(x.contiguous(), "sum", group))


def gather_fingerprints(fingerprint: int, group) -> list[int]:
    """Every rank's int64 ``fingerprint``, rank after rank (one small collective, e.g. to check that the
    ranks agree on a call before they run it)."""
    mine = torch.tensor([fingerprint], dtype=torch.int64)
    return wait(all_gather(mine, group)).tolist()
