"""Inductor's missing lowering for ``aten.sym_storage_offset`` (pytorch/pytorch#198068, fixed by #198069).

Inductor re-inplaces a custom op that mutates a view of a larger buffer (a layer's cache,
``kv_caches[i]``, written by ``mla_ops::write_latent_cache``) as ``as_strided(base, size, stride,
sym_storage_offset(view))``. Without a lowering that offset is recomputed on a tensor rebuilt without
its offset, so under dynamic shapes it is 0 and every layer writes into layer 0's cache. The lowering
reads the offset from the node's metadata, as ``sym_size`` and ``sym_stride`` do.

Private API: ``torch._inductor.lowering`` (torch 2.11 and 2.13 lack this lowering).
"""

from __future__ import annotations

import torch
from torch._inductor import lowering
from torch._inductor.virtualized import V


def _sym_storage_offset(a):
    val = V.graph.current_node.meta["val"]
    return val.node.expr if isinstance(val, torch.SymInt) else int(val)


def register() -> bool:
    """Register the lowering where Inductor has none; True if it is registered now."""
    op = torch.ops.aten.sym_storage_offset.default
    if op in lowering.lowerings:
        return False
    lowering.register_lowering(op)(_sym_storage_offset)
    return True
