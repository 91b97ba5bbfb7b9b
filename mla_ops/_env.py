"""Where the kernels can run (is Triton installed, is its CPU interpreter on), a function copy
that gives torch.compile a cache of its own, and how much memory a device has left."""

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


def available_memory(device) -> int | None:
    """Bytes a new allocation on ``device`` (a torch.device) can still take, or None where that is unknown.

    CUDA: the driver's free memory plus what torch's allocator holds unused. CPU (Linux): the kernel's
    ``MemAvailable``, within the process's cgroup v2 limit when it has one. A refusal on it is a sanity check
    (an allocation far past it can only fail, or be killed), not a promise that a smaller one fits."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    sizes = []
    try:
        with open("/proc/meminfo") as f:
            sizes += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                sizes.append(max(0, int(limit) - int(g.read())))
    except (OSError, ValueError):
        pass
    return min(sizes) if sizes else None
