"""The paged caches of a model step: a dense MLA model's one tensor, or a sparse (DSA) model's ``DSACaches``.

dense   kv_caches        [cache_layers, num_blocks, block_size, L+R]     one latent row per token and layer
sparse  DSACaches.latent [cache_layers, num_blocks, block_size, L+R]     the same
        DSACaches.index  [index_layers, num_blocks, block_size, D_I]     one index key per token and full layer

A sparse model's index cache lives beside its latent cache (DESIGN §12): the same blocks, block size and block
table, so one block id names a token's rows in both, and the block manager's prefix sharing and eviction
(``mla_ops.serving``) cover both at once. Only the layers with an indexer of their own have an index cache
(``MLAConfig.num_index_layers``: GLM-5's "shared" layers reuse another layer's top-k and allocate none).
``DSACaches`` is a NamedTuple, so torch.compile and pytrees take it as its two tensors.

The helpers below let the serving code treat either form alike: its tensors, its geometry, growing it.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import torch


class DSACaches(NamedTuple):
    latent: torch.Tensor  # [cache_layers, num_blocks, block_size, L+R]
    index: torch.Tensor  # [index_layers, num_blocks, block_size, D_I]

    @property
    def dtype(self) -> torch.dtype:
        return self.latent.dtype

    @property
    def device(self) -> torch.device:
        return self.latent.device

    @property
    def num_blocks(self) -> int:
        return self.latent.shape[1]


Caches = Union[torch.Tensor, DSACaches]


def cache_tensors(caches: Caches) -> tuple[torch.Tensor, ...]:
    """The tensors of a step's caches, each ``[layers, num_blocks, block_size, width]``."""
    return tuple(caches) if isinstance(caches, DSACaches) else (caches,)


def grown(caches: Caches, bigger: Caches) -> Caches:
    """``bigger`` (``allocate_kv_caches`` with more blocks) holding ``caches``' rows in its first blocks:
    block ids, and the rows cached under them, stay valid."""
    for old, new in zip(cache_tensors(caches), cache_tensors(bigger)):
        new[:, : old.shape[1]] = old
    return bigger


def check_caches(caches, num_cache_layers: int, width: int, index: tuple[int, int] | None = None) -> None:
    """A model's caches (``allocate_kv_caches``): rows ``width`` (L+R) wide; ``index`` None for a dense model
    (one tensor), else (index layers, D_I) of a ``DSACaches`` whose two tensors share the block geometry,
    dtype and device. (Checking the widths here, before any layer, also keeps them static under
    ``torch.compile(dynamic=True)``, where a layer's region would meet them symbolic.)"""
    if index is None:
        if not isinstance(caches, torch.Tensor):
            raise TypeError(f"kv_caches must be a tensor [num_cache_layers={num_cache_layers}, num_blocks, "
                            f"block_size, L+R={width}] for a dense model, got {type(caches).__name__}")
        if caches.dim() != 4 or caches.shape[0] != num_cache_layers or caches.shape[3] != width:
            raise ValueError(f"kv_caches must be [num_cache_layers={num_cache_layers}, num_blocks, block_size, "
                             f"L+R={width}], got shape {tuple(caches.shape)} (see allocate_kv_caches)")
        return
    if not isinstance(caches, DSACaches):
        raise TypeError(f"kv_caches must be a DSACaches (latent, index) for a sparse (index_topk) model, got "
                        f"{type(caches).__name__} (see allocate_kv_caches)")
    latent, index_cache = caches
    for name, tensor, (layers, row) in (("latent", latent, (num_cache_layers, width)), ("index", index_cache, index)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4 or tensor.shape[0] != layers \
                or tensor.shape[3] != row:
            raise ValueError(f"kv_caches.{name} must be [{layers} layers, num_blocks, block_size, {row}], got "
                             f"{tuple(getattr(tensor, 'shape', ()))} (see allocate_kv_caches)")
    if index_cache.shape[1:3] != latent.shape[1:3] or index_cache.device != latent.device:
        raise ValueError(f"kv_caches.index must have the latent cache's blocks {tuple(latent.shape[1:3])} on "
                         f"{latent.device}, got {tuple(index_cache.shape[1:3])} on {index_cache.device}")
