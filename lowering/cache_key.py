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
import marshal
import sys

import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass


def _source(obj) -> bytes:
    try:
        return inspect.getsource(obj).encode()
    except (OSError, TypeError):  # defined where no source file exists (a REPL, ``python -c``)
        code = getattr(obj, "__code__", None)
        return marshal.dumps(code) if code is not None else b""


def sources_digest(functions) -> str:
    """sha256 over each function and its module's source (so helpers it calls count too)."""
    digest = hashlib.sha256()
    for fn in functions:
        module = sys.modules.get(fn.__module__)
        if module is not None:
            digest.update(_source(module))
        digest.update(_source(fn))
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
