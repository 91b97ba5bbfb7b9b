"""Where the kernels can run: is Triton installed, is its CPU interpreter on."""

from __future__ import annotations

import functools
import importlib.util
import os


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: Triton kernels run on CPU tensors (set it before they are defined)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
