"""Where the kernels can run (is Triton installed, is its CPU interpreter on), a function copy
that gives torch.compile a cache of its own, and a float torch.compile keeps constant."""

from __future__ import annotations

import functools
import importlib.util
import os
import types
from typing import Callable


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: Triton kernels run on CPU tensors (set it before they are defined)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def own_code(fn: Callable, name: str) -> Callable:
    """``fn`` with a code object of its own, named ``name``: Dynamo keeps compiled code (and its
    recompile limit) per code object, so each copy compiled gets its own cache."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__,
                              fn.__closure__)
