"""How the decoder layers compile: nested compile regions for ``torch.compile(model)``, and the compiled
regions of regional compilation (``MLAModel.compile_layers``).

Whole-model compile (``torch.compile`` of a model or of a step that calls one): every layer runs its
parts through ``nested``-marked functions, so Dynamo traces each part once per layer kind and stamps it
out for every other layer of that kind (``torch.compiler.nested_compile_region``; outside a compile they
are plain calls). A part ends where the layer writes its cache: a region may not mutate its inputs, so
the writes sit between the regions, in the step's graph, and each attention runs in the region after
its write, with the plan and the merges, which Inductor fuses there. What a region is handed must be
what Dynamo can compare from one layer to the next: tensors, ints, constants and modules, flattened as
pytrees (``PrefillStep`` and the plan are). Float attributes are ``StaticFloat`` (``mla_ops._env``), and
the caches' widths are checked before the first region: a region must meet no symbolic size that a guard
inside it would fix (Dynamo cannot stamp it out then), which is also why a plan's sizes must be
constants (docs/compile-and-graphs.md).

Regional compilation: ``CompiledRegion`` compiles a layer's dense parts on their own and runs the
attention between them eagerly (module doc of ``mla_ops.models.decoder``).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch

from .._env import own_code

# The first torch this library's regions are verified with (2.13 stamps a traced region out by its inputs'
# fingerprint); earlier ones trace every layer inline.
NESTED_REGIONS_SINCE = (2, 13)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


# Whether this torch reuses nested regions (a constant: read while tracing).
NESTED_REGIONS = hasattr(torch.compiler, "nested_compile_region") and _torch_version() >= NESTED_REGIONS_SINCE


def nested(fn: Callable) -> Callable:
    """``fn`` as a nested compile region where this torch reuses them, else ``fn`` itself (then a compile
    traces every layer, and ``warn_inlined`` says so once)."""
    return torch.compiler.nested_compile_region(fn) if NESTED_REGIONS else fn


@functools.cache
def _warn_inlined() -> None:
    warnings.warn(f"mla_ops: torch {torch.__version__} has no reusable nested compile regions (needs "
                  f"{'.'.join(map(str, NESTED_REGIONS_SINCE))}): torch.compile(model) traces every layer; "
                  "model.compile_layers() compiles in a time independent of depth", stacklevel=2)


def warn_inlined() -> None:
    """Once per process, while a whole model is traced without reusable regions (``comptime``: at trace time,
    with no graph break)."""
    if torch.compiler.is_compiling() and not NESTED_REGIONS:
        from torch._dynamo.comptime import comptime

        comptime(lambda ctx: _warn_inlined())


def _nothing() -> None:
    pass


def compile_options(options: dict) -> dict:
    """``MLAModel.compile_layers``' options (defaults ``fullgraph=True``, ``backend="inductor"``) as
    ``torch.compile`` takes them, refused at the call as ``torch.compile`` refuses them: a bad mode, backend,
    option or keyword (a ``TypeError`` stays one, the rest are ``ValueError``s), before any layer changes."""
    options = {"fullgraph": True, "backend": "inductor", **options}
    try:
        torch.compile(_nothing, **options)  # compiles nothing until called: only the arguments are checked
    except TypeError as e:
        raise TypeError(f"compile_layers: {e}") from None
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, InvalidBackend, AssertionError
        raise ValueError(f"compile_layers: {e}") from None
    return options


class CompiledRegion:
    """One dense region of the decoder layers (``DecoderLayer.attention_inputs`` or ``attention_output``,
    called ``region(layer, *tensors)``) compiled for ``MLAModel.compile_layers``.

    One ``torch.compile`` per (device, dtype, grad mode, inference mode and, for ``by_mlp``, the layer's
    MLP kind), each with a code object of its own: no combination spends another's recompile budget,
    so casting the model or switching modes compiles once more, never into the recompile limit. The
    tensors' first dim (the tokens) is dynamic, and nothing else: ``dynamic=True`` would make every dim
    symbolic, and duck sizing would tie a token count to an equal head count. Steps of 0 or 1 tokens
    run padded to 2 (zero rows, sliced off after), since sizes 0 and 1 would specialise and compile anew.
    """

    def __init__(self, region: Callable, options: dict, owner: str, by_mlp: bool):
        self.region, self.options, self.owner, self.by_mlp = region, options, owner, by_mlp
        self.compiled: dict[tuple, Callable] = {}

    def __call__(self, layer, *tensors: torch.Tensor):
        if torch.compiler.is_compiling():  # inside a compiled step: traced inline
            return self.region(layer, *tensors)
        num_tokens = tensors[0].shape[0]
        if num_tokens < 2:
            tensors = tuple(torch.cat([t, t.new_zeros(2 - num_tokens, *t.shape[1:])]) for t in tensors)
        first = tensors[0]
        key = (first.device, first.dtype, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
               type(layer.mlp) if self.by_mlp else None)
        compiled = self.compiled.get(key)
        if compiled is None:
            name = f"{self.region.__name__}_{len(self.compiled)}_{self.owner}"
            compiled = self.compiled[key] = torch.compile(own_code(self.region, name), **self.options)
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        out = compiled(layer, *tensors)
        if num_tokens < 2:
            out = torch.utils._pytree.tree_map(lambda t: t.narrow(0, 0, num_tokens), out)
        return out
