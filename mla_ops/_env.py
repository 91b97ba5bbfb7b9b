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


class StaticFloat(float):
    """A float that ``torch.compile(dynamic=True)`` reads as a constant guarded by value. Dynamo makes a plain
    float attribute a symbolic graph input and, where a use cannot take one (``theta ** tensor``, an op's
    float argument), specialises it late and restarts the whole analysis; a model's constants (rope_theta,
    eps, scales) are meant to be fixed, so they are stored as this (Dynamo tests ``type(v) is float``)."""

    __slots__ = ()


def static_float(value: float | None) -> StaticFloat | None:
    return None if value is None else StaticFloat(value)


def static_float_fields(obj) -> None:
    """A (frozen) dataclass's float fields, and floats in its tuple fields, made ``StaticFloat`` in place."""
    import dataclasses

    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if type(value) is float:
            object.__setattr__(obj, field.name, StaticFloat(value))
        elif type(value) is tuple and any(type(v) is float for v in value):
            object.__setattr__(obj, field.name, tuple(StaticFloat(v) if type(v) is float else v for v in value))


def static_module_floats(module) -> None:
    """Every float attribute of ``module`` and its submodules (eps, scales, torch's own ``norm_type``) made
    ``StaticFloat``: a nested compile region would otherwise lift each into a symbolic input."""
    for m in module.modules():
        for name, value in vars(m).items():
            if type(value) is float:
                setattr(m, name, StaticFloat(value))
