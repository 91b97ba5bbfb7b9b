"""Keying Inductor's FX-graph cache on our lowering code.

The cache keys a graph by its ops' names, so after a decomposition changes, a warm cache would
hand back code compiled from the old one. Inductor adds the ``uuid()`` of
``config.post_grad_custom_post_pass`` to the key, so we install a pass that changes nothing and
whose uuid hashes the source of every registered decomposition's module. A pass the user had
installed keeps running, and its uuid stays part of ours.

Private API: ``torch._inductor.config``, ``torch._inductor.custom_graph_pass`` (torch 2.11-2.13).
"""

from __future__ import annotations

import hashlib
import inspect
import sys

import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass


def sources_digest(functions) -> str:
    """sha256 over the source of each function's module (so helpers it calls count too)."""
    digest = hashlib.sha256()
    for fn in functions:
        module = sys.modules.get(fn.__module__)
        digest.update(inspect.getsource(module if module is not None else fn).encode())
        digest.update(inspect.getsource(fn).encode())
    return digest.hexdigest()


class LoweringCacheKey(CustomGraphPass):
    """A no-op post-grad pass whose uuid is the digest of our lowering code."""

    def __init__(self, digest: str, inner: CustomGraphPass | None = None):
        self.digest = digest
        self.inner = inner

    def __call__(self, graph) -> None:
        if self.inner is not None:
            self.inner(graph)

    def uuid(self):
        inner = self.inner.uuid() if self.inner is not None else None
        return ("mla_ops.lowering", self.digest, inner)


def install(functions) -> str:
    """Make ``functions``' sources part of the cache key (idempotent); returns the digest."""
    current = inductor_config.post_grad_custom_post_pass
    inner = current.inner if isinstance(current, LoweringCacheKey) else current
    digest = sources_digest(functions)
    inductor_config.post_grad_custom_post_pass = LoweringCacheKey(digest, inner)
    return digest
