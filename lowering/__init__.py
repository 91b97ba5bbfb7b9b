"""Inductor integration for mla-ops; switched on by ``mla_ops.enable()``.

All imports of private ``torch._inductor`` APIs live in this package.
"""

from __future__ import annotations

from . import cache_key, decompositions, storage_offset


def enable() -> dict:
    """Register the decompositions and key the compile cache on them, and lower ``sym_storage_offset``
    (``storage_offset``: without it, compiled cache writes land in the wrong layer). Idempotent."""
    ops = decompositions.register()
    storage_offset.register()
    digest = cache_key.install(decompositions.DECOMPOSITIONS.values())
    return {"decomposed": ops, "cache_key": digest}
