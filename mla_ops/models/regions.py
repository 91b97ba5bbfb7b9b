"""How the decoder layers run: eagerly, under regional compilation (``MLAModel.compile_layers``) and under a
whole-model ``torch.compile``. The layers are written once, blind to all three; this module alone decides.

Whole-model compile: every layer runs as one nested compile region (``torch.compiler.nested_compile_region``),
which Dynamo traces once per layer kind and stamps out for every other layer of that kind (outside a compile
it is a plain call). A layer writes nothing: it returns the rows it made (``NewRows``), and they are written
after it (``ModelStep.write``, the one write): eagerly by ``run_layer``; under a whole-model compile inside the
layer's region where torch lets a region that writes its inputs hold the attention's out= ops (2.14,
pytorch#189543: ``WRITES_IN_REGIONS``), so the step's graph holds no per-layer write; on torch 2.13, which
refuses that, between the regions, in the step's graph. (The attention never reads its own new rows from a
cache, so a write after the layer is a write in time.) A region returns none of its inputs, only what the
layer made, flattened (``_layer_body``) and rebuilt (``_rebuilt``). What a region is handed must compare from one
layer to the next: tensors, ints, constants and modules, as pytrees (the step and its plan are); float
attributes are ``StaticFloat`` (``static_floats``), and the caches' widths are checked before the first region
(a region must meet no symbolic size that a guard inside it would fix). A context-parallel step, whose plan
holds a process group, and torch before 2.13 run the layers inline.

Stacked layers (``MLAModel.stack_layers``, ``mla_ops.models.stacking``) under a whole-model compile, with the
latent caches one stacked tensor: each run of like layers is one ``scan`` over its stacked weights and cache layers
(``run_stacked``), then one write of the run's rows; the step's graph does not grow with depth.

Regional compilation: ``CompiledRegion`` compiles the attentions' projections and the MLPs (the dense
parts), each once for all the layers that share its structure; the attention ops between them run eagerly.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from .. import _checks
from .._env import own_code
from .layer import AttentionCaches, Carry, LayerCaches, MLAAttention, ModelStep, NewRows
from .moe import FeedForward, MoE

if TYPE_CHECKING:
    from .kv_caches import KVCaches  # which imports this module

# The first torch this library's regions are verified with (2.13 stamps a traced region out by its inputs'
# fingerprint); earlier ones trace every layer inline.
NESTED_REGIONS_SINCE = (2, 13)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


# Whether this torch reuses nested regions (a constant: read while tracing).
NESTED_REGIONS = hasattr(torch.compiler, "nested_compile_region") and _torch_version() >= NESTED_REGIONS_SINCE

# The first torch whose regions may write their inputs (the caches) beside custom ops with out= arguments
# (pytorch#189543: 2.13 refuses "a custom operator whose output has alias annotations" there).
WRITES_IN_REGIONS_SINCE = (2, 14)
# Whether a layer's region writes its rows itself (a constant: read while tracing); else they are written between
# the regions.
WRITES_IN_REGIONS = NESTED_REGIONS and _torch_version() >= WRITES_IN_REGIONS_SINCE


class StaticFloat(float):
    """A float that ``torch.compile(dynamic=True)`` reads as a constant guarded by value (Dynamo tests
    ``type(v) is float`` before it makes one a symbolic input)."""

    __slots__ = ()


def static_floats(module: nn.Module) -> None:
    """Every float attribute of ``module`` and its submodules (eps, scales, torch's own ``norm_type``) made
    ``StaticFloat``, a constant to ``torch.compile(dynamic=True)`` guarded by value: a nested region would
    otherwise lift each into a symbolic input, and an op's float argument would restart Dynamo's analysis.
    Nothing before torch 2.13, whose Dynamo cannot hand a float subclass to an op (and has no regions)."""
    if not NESTED_REGIONS:
        return
    for m in module.modules():
        for name, value in vars(m).items():
            if type(value) is float:
                setattr(m, name, StaticFloat(value))


def unstacked(caches: torch.Tensor, name: str, form: str) -> tuple[torch.Tensor, ...]:
    """A stacked cache tensor's layers (views), in eager code; refused by name under ``torch.compile`` (but for a
    stacked model's scan, ``scanned_caches``), whose writes into the views of one buffer land in the wrong layer
    (pytorch#198068; ``mla_ops.enable()`` lowers the missing op, but a model never depends on it)."""
    if torch.compiler.is_compiling():
        _checks.raise_value_error(f"{name} is one stacked tensor: under torch.compile pass {form} (what "
                                  "allocate_kv_caches returns), or stack the model's layers (stack_layers(), "
                                  f"torch >= {'.'.join(map(str, NESTED_REGIONS_SINCE))}, a dense model's latent "
                                  "caches, one k_scale for all): compiled writes into the views of one buffer land in "
                                  "the wrong layer (pytorch#198068)")
    return tuple(caches.unbind())


def scanned_caches(model: nn.Module, kv_caches: KVCaches, plan) -> torch.Tensor | None:
    """The stacked latent caches a whole-model compile scans the layers over (``run_stacked``), or None (the
    layers run one by one): under ``torch.compile`` (torch >= 2.13), a model whose layers are stacked
    (``stack_layers``), one stacked ``kv_caches.latent`` of a dense model in the model's dtype or float8_e4m3fn
    with one ``k_scale`` for every layer (not a packed format), and a plan without context parallel."""
    if not (torch.compiler.is_compiling() and NESTED_REGIONS and model.layer_runs is not None):
        return None
    c = kv_caches
    plain = c.index is None and c.kv_cache_format == "auto" and not isinstance(c.k_scale, (list, tuple))
    if not (isinstance(c.latent, torch.Tensor) and plain and getattr(plan, "context_parallel", None) is None):
        return None
    return c.latent


def run_stacked(model: nn.Module, x: torch.Tensor, latent: torch.Tensor, k_scales: tuple, steps: dict) -> torch.Tensor:
    """Every layer, each run of stacked layers (``model.layer_runs``) as one ``scan`` over its stacked weights and
    its cache layers of ``latent`` (``[layers, num_blocks, block_size, L+R]``; ``k_scales``: each cache layer's
    checked scale, one for all), then the run's new rows written in one write (``PrefillStep.write_layers``): the
    step's graph holds a scan and a write per run, however deep."""
    from torch._higher_order_ops.scan import scan

    for run in model.layer_runs:
        step, k_scale = steps[model.wiring[run.start].kind], k_scales[run.cache]
        body = _scan_body(model.layers[run.start], run.names, step, k_scale)
        with torch.no_grad():  # as the regions: the attention ops have no backward
            x, (kv_c, k_pe) = scan(body, x, (*run.weights, latent.narrow(0, run.cache, run.count)))
        step.attention.write_layers(kv_c, k_pe, latent, run.cache, k_scale=k_scale)
    return x


def _scan_body(layer: nn.Module, names: tuple[str, ...], step: ModelStep, k_scale) -> Callable:
    """One layer of a run: ``layer`` on one layer's slice of the stacked tensors (``names``) and its cache."""

    def body(x, sliced):
        *tensors, cache = sliced
        x, made = torch.func.functional_call(layer, dict(zip(names, tensors)),
                                             (x, (AttentionCaches(cache, k_scale),), step, Carry()))
        (kv_c, k_pe), = made.latent
        return x, (kv_c, k_pe)

    return body


def run_layer(layer: nn.Module, x: torch.Tensor, caches: LayerCaches, step: ModelStep,
              carry: Carry) -> tuple[torch.Tensor, NewRows]:
    """``layer(x, caches, step, carry)``, then the rows it made written into its caches (``ModelStep.write``);
    as a nested region under a whole-model compile, which writes them itself (torch >= 2.14) or whose rows are
    written between the regions (module doc)."""
    if not torch.compiler.is_compiling():
        x, made = layer(x, caches, step, carry)
    elif not NESTED_REGIONS or step.attention.plan.context_parallel is not None:
        _warn_inlined()
        x, made = layer(x, caches, step, carry)
    else:
        with torch.no_grad():  # the attention ops have no backward; the writes after a region change what it read
            x, made = _rebuilt(_layer_region(layer, x, caches, step, carry), layer.num_kv_caches)
        if WRITES_IN_REGIONS:
            return x, made
    step.write(caches, made)
    return x, made


def _layer_body(layer, x, caches, step, carry) -> tuple[torch.Tensor, ...]:
    """The layer, then its rows written where the region may write (``WRITES_IN_REGIONS``), its output flattened
    (a region returns tensors only): ``_rebuilt`` undoes it. The rows are returned either way, for the layers
    after it (``Carry``)."""
    x, made = layer(x, caches, step, carry)
    if WRITES_IN_REGIONS:
        step.write(caches, made)
    return (x, *(t for rows in made.latent for t in rows), *(t for t in (made.index, made.topk) if t is not None))


def _rebuilt(flat: tuple[torch.Tensor, ...], num_kv_caches: int) -> tuple[torch.Tensor, NewRows]:
    """A region's flat output as ``(x, NewRows)``: the rows of each of its ``num_kv_caches`` own caches, then an
    indexer's keys and top-k if it has one. (Not torch's pytree: traced, it reads a None as a leaf.)"""
    x, *rows = flat
    n = 2 * num_kv_caches
    index, topk = rows[n:] or (None, None)
    return x, NewRows(tuple(zip(rows[0:n:2], rows[1:n:2])), index, topk)


_layer_region = torch.compiler.nested_compile_region(_layer_body) if NESTED_REGIONS else _layer_body


def _warn_inlined() -> None:
    """Once per process, while a whole model is traced layer by layer (``comptime``: at trace time, no break)."""
    if not NESTED_REGIONS:
        from torch._dynamo.comptime import comptime

        comptime(lambda ctx: _warn_once())


@functools.cache
def _warn_once() -> None:
    warnings.warn(f"mla_ops: torch {torch.__version__} has no reusable nested compile regions (needs "
                  f"{'.'.join(map(str, NESTED_REGIONS_SINCE))}): torch.compile(model) traces every layer; "
                  "model.compile_layers() compiles in a time independent of depth", stacklevel=2)


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


# Regional compilation's regions: (the classes whose method is compiled, the method's name)
DENSE_PARTS = (((MLAAttention,), "project"), ((FeedForward, MoE), "forward"))


def compile_layers(model: nn.Module, options: dict) -> None:
    """``MLAModel.compile_layers``: each outermost module of ``DENSE_PARTS`` in ``model.layers`` gets its method
    compiled (an instance attribute over its class's), one ``CompiledRegion`` per part shared by every module
    (a MoE's shared experts, an MLP, run inside the MoE's region); they are ``model.compiled_regions``. The same
    options again keep them; a bad option is refused before anything changes."""
    options = compile_options(options)
    if getattr(model, "compiled_regions", None) is not None and model.compiled_regions[0].options == options:
        return
    regions = tuple(CompiledRegion(name, options, f"{id(model):x}") for _, name in DENSE_PARTS)

    def install(module: nn.Module) -> None:
        for (classes, name), region in zip(DENSE_PARTS, regions):
            if isinstance(module, classes):
                setattr(module, name, functools.partial(region, module))
                return
        for child in module.children():
            install(child)

    install(model.layers)
    model.compiled_regions = regions


class CompiledRegion:
    """One dense part of the decoder layers (``DENSE_PARTS``: a method ``name``, called ``region(module,
    *tensors)``) compiled for ``MLAModel.compile_layers``.

    One ``torch.compile`` per module structure (its class and parameter shapes: a dense MLP, a MoE, a NoPE
    attention each have theirs) and per device, dtype, grad mode and inference mode, each with a code object
    of its own: no combination spends another's recompile budget, so casting the model or switching modes
    compiles once more, never into the recompile limit. The tensors' first dim (the tokens) is dynamic, and
    nothing else: ``dynamic=True`` would make every dim symbolic, and duck sizing would tie a token count to
    an equal head count. Steps of 0 or 1 tokens run padded to 2 (zero rows, sliced off after), since sizes 0
    and 1 would specialise and compile anew.
    """

    def __init__(self, name: str, options: dict, owner: str):
        self.name, self.options, self.owner = name, options, owner
        self.compiled: dict[tuple, Callable] = {}

    def __call__(self, module: nn.Module, *tensors: torch.Tensor):
        fn = getattr(type(module), self.name)
        if torch.compiler.is_compiling():  # inside a compiled step: traced inline
            return fn(module, *tensors)
        num_tokens = tensors[0].shape[0]
        if num_tokens < 2:
            tensors = tuple(torch.cat([t, t.new_zeros(2 - num_tokens, *t.shape[1:])]) for t in tensors)
        first = tensors[0]
        structure = (type(module), tuple((n, p.shape) for n, p in module.named_parameters()))
        key = (structure, first.device, first.dtype, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        compiled = self.compiled.get(key)
        if compiled is None:
            name = f"{type(module).__name__}_{self.name}_{len(self.compiled)}_{self.owner}"
            compiled = self.compiled[key] = torch.compile(own_code(fn, name), **self.options)
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        out = compiled(module, *tensors)
        if num_tokens < 2:
            out = torch.utils._pytree.tree_map(
                lambda t: t.narrow(0, 0, num_tokens) if isinstance(t, torch.Tensor) else t, out)
        return out
