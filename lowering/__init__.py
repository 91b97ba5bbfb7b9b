"""Inductor integration for mla-ops; switched on by ``mla_ops.enable()``.

All imports of private ``torch._inductor`` APIs live in this package.
"""

from __future__ import annotations

from . import cache_key, decompositions


def enable() -> dict:
    """Register the decompositions and key the compile cache on them. Idempotent."""
    ops = decompositions.register()
    digest = cache_key.install(decompositions.DECOMPOSITIONS.values())
    return {"decomposed": ops, "cache_key": digest}
