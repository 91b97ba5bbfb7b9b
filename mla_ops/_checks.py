"""Argument checks of the public functions: errors name the argument, what was expected and what
arrived, and run on shapes and host values only (before any kernel).

Lengths (``query_start_loc``, ``context_lens``) and block ids are checked by value only where the
values are free to read: on the CPU, outside of tracing. On a GPU nothing is read on the host;
``set_debug(True)`` (or ``MLA_OPS_DEBUG=1``) adds the same checks as device-side asserts, which
fail the next synchronizing call without a host sync of their own.
"""

from __future__ import annotations

import math
import numbers
import operator
import os

import numpy as np
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FLOAT_DTYPE_NAMES = tuple(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)

_debug = os.environ.get("MLA_OPS_DEBUG") == "1"


def set_debug(enabled: bool) -> None:
    """Device-side checks of lengths, block ids and chunk capacity on the device path (module doc).

    They catch: ``query_start_loc`` not starting at 0 or decreasing, negative ``context_lens``, a
    block table too short for a context, a block id outside the cache, and a device plan whose
    batch needs more chunks than ``max_chunks`` or more indexer chunks than ``max_index_chunks`` (tokens
    that would otherwise come out as NaN), an fp8 scale that is not a positive, finite, normal float32, and a
    DSA ``topk_indices`` row with an entry out of range or a repeated position.
    Under torch.compile the switch is read when a function is traced: set it before compiling.
    """
    global _debug
    _debug = bool(enabled)


def debug_enabled() -> bool:
    return _debug


class TracedValueError(torch._dynamo.exc.UserError, ValueError):
    """A ``ValueError`` that ``torch.compile(fullgraph=True)`` lets out as it is (Dynamo reports a plain exception
    raised in traced code as "Observed exception", the message buried in its debug context)."""

    def __init__(self, message: str):
        super().__init__(torch._dynamo.exc.UserErrorType.INVALID_INPUT, message)


class TracedTypeError(torch._dynamo.exc.UserError, TypeError):
    """``TracedValueError``'s twin for a ``TypeError``."""

    def __init__(self, message: str):
        super().__init__(torch._dynamo.exc.UserErrorType.INVALID_INPUT, message)


def _raise_at_trace_time(ctx, error: type = TracedValueError) -> None:
    """A ``comptime`` callback: under ``fullgraph=True`` raise the caller's ``message`` now; otherwise do nothing,
    so the caller's plain raise falls back to eager and reaches the user as a ``ValueError`` (a trace-time
    error there would make Dynamo skip the frame silently)."""
    tx = torch._dynamo.symbolic_convert.InstructionTranslator.current_tx()
    if getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False):
        raise error(ctx.get_local("message").as_python_constant())


def _raise_type_at_trace_time(ctx) -> None:
    _raise_at_trace_time(ctx, TracedTypeError)


def raise_value_error(message: str):
    """``raise ValueError(message)``, also as itself (first line, our words) when traced with ``fullgraph=True``.
    ``message`` must be a constant while tracing (no symbolic sizes in it)."""
    if torch.compiler.is_compiling():
        from torch._dynamo.comptime import comptime

        comptime(_raise_at_trace_time)
    raise ValueError(message)


def raise_type_error(message: str):
    """``raise TypeError(message)``, as ``raise_value_error`` raises its ``ValueError``."""
    if torch.compiler.is_compiling():
        from torch._dynamo.comptime import comptime

        comptime(_raise_type_at_trace_time)
    raise TypeError(message)


def values_readable(*tensors: torch.Tensor) -> bool:
    """True when reading these tensors' values on the host is free: plain CPU tensors (not fake or
    other subclasses), not being traced."""
    return not torch.compiler.is_compiling() and all(type(t) is torch.Tensor and t.device.type == "cpu"
                                                     for t in tensors)


def _got(value) -> str:
    """What arrived, for a message: the type, and the value where it is a short scalar."""
    name = type(value).__name__
    if isinstance(value, (str, numbers.Number)) and len(repr(value)) <= 40:
        return f"{name} {value!r}"
    return name


INT32_MAX = 2**31 - 1


def check_int(value, name: str, least: int | None = None, *, optional: bool = False, meaning: str = "",
              most: int | None = None) -> int | None:
    """``value`` as an int (numpy ints too; a bool, float or str is a TypeError naming ``name``),
    at least ``least`` and at most ``most``; None passes where ``optional``. ``meaning`` follows the type
    in messages.

    Traced, an int the compiled function closes over (or reads from ``self``) arrives symbolic under
    ``dynamic=True``: ``operator.index`` makes Dynamo specialise it (a guard on its value), so every size
    derived from it is a constant, as a plan's static sizes must be (a nested region cannot be stamped
    out over a symbol that a guard inside it would fix)."""
    if value is None and optional:
        return None
    either = " or None" if optional else ""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int{meaning}{either}, got {_got(value)}")
    value = operator.index(value)
    if least is not None and value < least:
        bound = "a positive int" if least == 1 else f"an int >= {least}"
        raise ValueError(f"{name} must be {bound}{meaning}{either}, got {value}")
    if most is not None and value > most:
        limit = "2**31 - 1 (it reaches int32 tensors)" if most == INT32_MAX else str(most)
        raise ValueError(f"{name} must be at most {limit}, got {value}")
    return value


def check_int32_size(value, name: str, least: int = 1, meaning: str = "") -> int:
    """A size that reaches an int32 tensor (a compare with int32 lengths, an int32 offset): an int in
    ``least .. 2**31 - 1`` (a larger one would wrap around in the comparison)."""
    return check_int(value, name, least, meaning=meaning, most=INT32_MAX)


def check_positive_int(value, name: str) -> int:
    return check_int(value, name, 1)


def check_nonnegative_int(value, name: str, meaning: str = "") -> int:
    return check_int(value, name, 0, meaning=meaning)


def check_real(value, name: str, positive: bool | None = True, *, optional: bool = False) -> float | None:
    """``value`` as a finite float (ints too; a bool or str is a TypeError naming ``name``);
    positive: True for > 0, False for >= 0, None for any sign; None passes where ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number{' or None' if optional else ''}, got {_got(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if positive is False and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_bool(value, name: str) -> bool:
    """True or False only: a "false" string or a 0 would otherwise pass as a truth value."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {_got(value)}")
    return value


def check_str(value, name: str, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {_got(value)}")
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_object(value, name: str) -> dict:
    """A config.json entry that must be an object (a dict)."""
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be an object, got {value!r} ({type(value).__name__})")
    return value


def model_dtype(value, name: str = "dtype") -> torch.dtype | None:
    """A model dtype (``torch.bfloat16``, ``"bfloat16"``, ``"torch.bfloat16"``) as a torch.dtype; None stays
    None. Only ``FLOAT_DTYPES``: anything else is an error naming ``name``."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
    else:
        raise TypeError(f"{name} must be a torch.dtype or its name (one of {FLOAT_DTYPE_NAMES}), got {_got(value)}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be one of {FLOAT_DTYPE_NAMES}, got {value!r}")
    return dtype


def check_device(device, name: str = "device") -> torch.device:
    """``device`` (a torch.device or its name) as a torch.device this machine has and can compute on;
    a ValueError naming ``name`` otherwise (an unknown name, meta, a CUDA index past the devices)."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"unknown {name} {str(device)!r} (e.g. cpu, cuda, cuda:1)") from None
    if resolved.type == "meta":
        raise ValueError(f"{name} 'meta': meta tensors hold no values: choose a device that computes (cpu, cuda)")
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{name} {str(device)!r}: CUDA is not available here")
        if resolved.index is not None and resolved.index >= count:
            raise ValueError(f"{name} {str(device)!r}: there are {count} CUDA devices (0..{count - 1})")
    elif resolved.type != "cpu":
        try:
            torch.empty(0, device=resolved)  # allocates nothing; fails here for a device this machine lacks
        except Exception as e:  # noqa: BLE001  (each backend fails its own way)
            raise ValueError(f"{name} {str(device)!r} is not available here: {' '.join(str(e).split())}") from None
    return resolved


def check_softmax_scale(softmax_scale) -> float:
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (numbers.Real, torch.SymFloat)):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    # Comparisons, not math.isfinite: Dynamo folds them on a traced float, so compiled code checks too.
    if softmax_scale != softmax_scale or softmax_scale in (math.inf, -math.inf):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    return float(softmax_scale)


def check_choice(value, name: str, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_tensor(x, name: str, ndim: int, shape_doc: str, device: torch.device | None = None,
                 device_of: str = "", dtype: torch.dtype | None = None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_doc}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {shape_doc}, got shape {tuple(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} must be on {device} (the device of {device_of}), got {x.device}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name} must be {str(dtype).removeprefix('torch.')}, got {x.dtype}")


def check_own_memory(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    """Every element of each tensor has memory of its own: no dim of two or more entries with stride 0 (``expand``)
    or a stride inside the span of the smaller-strided dims, whose elements would share bytes (a write to one would
    land in the others); a ValueError names the tensor. Strides only, so under ``torch.compile`` it runs at trace
    time on the fake tensors (as ``check_disjoint_memory``)."""
    _checked_on_fakes(_check_own_memory, names, tensors, "")


def check_disjoint_memory(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], why: str) -> None:
    """No two of ``tensors`` share memory (the same tensor twice, overlapping views of one buffer); a ValueError
    names both, then says ``why``. Byte spans are compared: addresses on a device, or for meta and fake tensors
    the storage and the offset in it. Under ``torch.compile`` the check runs at trace time on the fake tensors, which
    keep each input's storage (views of one input share it) and offsets that traced code cannot read. The graph
    checks again at every call (the op ``mla_ops::check_disjoint_memory``, on the real tensors' addresses): a graph
    traced for separate tensors is not traced again for a later call whose tensors alias, since torch's guards do
    not compare the storages of separate inputs."""
    _checked_on_fakes(_check_disjoint, names, tensors, why)
    if torch.compiler.is_compiling():
        torch.ops.mla_ops.check_disjoint_memory(list(tensors), ",".join(names), why)


@torch.library.custom_op("mla_ops::check_disjoint_memory", mutates_args=())
def _check_disjoint_op(tensors: list[torch.Tensor], names: str, why: str) -> None:
    """``check_disjoint_memory`` at run time inside a compiled graph (``names`` comma-separated): reads the
    tensors' addresses, no values (no device sync). A side effect, so the graph keeps it."""
    _check_disjoint(tuple(names.split(",")), tuple(tensors), why)


@_check_disjoint_op.register_fake
def _(tensors, names, why) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.mla_ops.check_disjoint_memory.default)


def _checked_on_fakes(check, names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], why: str) -> None:
    """``check(names, tensors, why)``, a check of the tensors' metadata: in eager code on the tensors; under
    ``torch.compile`` at trace time on their fake tensors (``comptime``: Dynamo cannot trace storages or sorts of
    symbolic sizes). If the frame falls back to eager (no ``fullgraph``), the check runs there on the tensors."""
    if not torch.compiler.is_compiling():
        check(names, tensors, why)
        return
    from torch._dynamo.comptime import comptime

    comptime(_check_fakes, lambda: check(names, tensors, why))


def _check_fakes(ctx) -> None:
    """``_checked_on_fakes``' check on the fake tensors. A refusal is raised as itself (``TracedValueError``): under
    ``fullgraph=True`` it reaches the user; otherwise Dynamo breaks the graph at the ``comptime`` call, which then
    runs eagerly: its fallback checks the real tensors."""
    fakes = tuple(p.node.meta["example_value"] for p in ctx.get_local("tensors").as_proxy())
    check = ctx.get_local("check").as_python_constant()
    try:
        check(ctx.get_local("names").as_python_constant(), fakes, ctx.get_local("why").as_python_constant())
    except ValueError as e:
        raise TracedValueError(str(e)) from None


def _check_own_memory(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], why: str) -> None:
    for name, x in zip(names, tensors):
        span = 1  # elements spanned by the dims of smaller stride, taken so far
        for stride, size in sorted((st, sz) for sz, st in zip(x.shape, x.stride()) if sz > 1):
            if stride < span:
                raise ValueError(f"{name} must give every element memory of its own, got shape {tuple(x.shape)} "
                                 f"with strides {x.stride()} (a stride 0, as from expand, or overlapping strides): "
                                 "its writes would land in several places")
            span += stride * (size - 1)


def _check_disjoint(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], why: str) -> None:
    spans = []  # (where, first byte, end byte, name): addresses on a device, or offsets in a storage without any
    for name, t in zip(names, tensors):
        if t.numel():
            extent = (sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1) * t.element_size()
            if type(t) is torch.Tensor and t.device.type != "meta":  # memory with addresses (two storages may alias)
                where, start = str(t.device), t.data_ptr()
            else:  # meta or fake: the storage object, the offset in it (compared only within one storage)
                where, start = f"storage {t.untyped_storage()._cdata}", t.storage_offset() * t.element_size()
            spans.append((where, start, start + extent, name))
    by_storage = {}
    for span in spans:
        by_storage.setdefault(span[0], []).append(span)
    for group in by_storage.values():
        group.sort(key=lambda span: span[1])
        for (_, _, end, other), (_, next_start, _, name) in zip(group, group[1:]):
            if next_start < end:
                raise ValueError(f"{name} shares memory with {other}: {why}")


def check_int32(x: torch.Tensor, name: str, ndim: int, shape_doc: str, device=None, device_of: str = "") -> None:
    check_tensor(x, name, ndim, shape_doc, device, device_of, dtype=torch.int32)


def check_lengths(query_start_loc: np.ndarray, context_lens: np.ndarray, block_table: np.ndarray,
                  block_size: int) -> int:
    """Value checks of a step's lengths and the block ids they use; returns the largest block id
    the contexts use (-1 if none). Lengths: Python lists (small batches: no numpy call per check)
    or int arrays; block_table: an array."""
    if isinstance(context_lens, list):
        blocks = [-(-c // block_size) for c in context_lens]
        if query_start_loc[0] == 0 and all(a <= b for a, b in zip(query_start_loc, query_start_loc[1:])) and (
            not blocks or (min(context_lens) >= 0 and max(blocks) <= block_table.shape[1])
        ):
            return check_block_ids(block_table, blocks)
        query_start_loc, context_lens = np.array(query_start_loc), np.array(context_lens)  # which check fails
    if query_start_loc[0] != 0:
        raise ValueError(f"query_start_loc must start at 0, got {int(query_start_loc[0])}")
    steps = np.diff(query_start_loc)
    if steps.size and steps.min() < 0:
        i = int(np.argmin(steps))
        raise ValueError(
            f"query_start_loc must be non-decreasing, got {int(query_start_loc[i])} then "
            f"{int(query_start_loc[i + 1])} at index {i + 1}"
        )
    if context_lens.size == 0:
        return -1
    if context_lens.min() < 0:
        r = int(np.argmin(context_lens))
        raise ValueError(f"context_lens must be non-negative, got {int(context_lens[r])} for request {r}")
    blocks = -(-context_lens // block_size)  # blocks each context uses
    if blocks.max() > block_table.shape[1]:
        r = int(np.argmax(blocks))
        raise ValueError(
            f"block_table row {r} has {block_table.shape[1]} blocks, too short for context "
            f"{int(context_lens[r])} at block_size {block_size} (needs {int(blocks[r])})"
        )
    return check_block_ids(block_table, blocks)


def check_block_ids(block_table: np.ndarray, blocks) -> int:
    """Block ids in row r's first ``blocks[r]`` columns (a list or an int array) must be >= 0;
    returns their maximum (-1 if none). Work in proportion to the ids used: one maximum per row
    segment of the flat table, taken over its bits as uint32, where a negative id is >= 2**31."""
    small = isinstance(blocks, list)
    rows = [r for r, n in enumerate(blocks) if n] if small else np.flatnonzero(blocks)
    if len(rows) == 0:
        return -1
    ids = block_table.view(np.uint32)
    if len(rows) == 1:
        return _checked_top(int(ids[rows[0], : blocks[rows[0]]].max()), block_table, blocks, rows)
    shortest = min(blocks[r] for r in rows) if small else 0
    longer = [r for r in rows if blocks[r] > shortest] if small else rows
    if len(longer) <= 1:
        # Every row's first ``shortest`` ids in one 2-D reduction, then the one longer row's rest: a
        # long context among short ones (the reduction below would also read the gaps between rows).
        top = int((ids[: len(blocks)] if len(rows) == len(blocks) else ids[rows])[:, :shortest].max())
        if longer:
            top = max(top, int(ids[longer[0], shortest : blocks[longer[0]]].max()))
        return _checked_top(top, block_table, blocks, rows)
    if not ids.flags.c_contiguous:
        ids = np.ascontiguousarray(ids[: len(blocks), : max(blocks) if small else int(blocks.max())])
    width = ids.shape[1]
    if small:  # a few rows: Python lists beat numpy's per-call cost
        bounds = [b for r in rows for b in (r * width, r * width + blocks[r])]
    else:
        bounds = np.empty(2 * rows.size, dtype=np.int64)
        bounds[0::2] = rows * width
        bounds[1::2] = rows * width + blocks[rows]
    if bounds[-1] == ids.size:  # reduceat's last segment runs to the end anyway
        bounds = bounds[:-1]
    return _checked_top(int(np.maximum.reduceat(ids.reshape(-1), bounds)[0::2].max()), block_table, blocks, rows)


def _checked_top(top: int, block_table: np.ndarray, blocks, rows) -> int:
    """``top``, the largest id used read as uint32: one at or past 2**31 is a negative id, named here."""
    if top >= 2**31:
        r = next(r for r in rows if block_table[r, : blocks[r]].min() < 0)
        col = int(np.argmin(block_table[r, : blocks[r]]))
        raise ValueError(f"block_table[{r}, {col}] is {int(block_table[r, col])}: block ids must be >= 0")
    return top


def check_ids_below(x: torch.Tensor, name: str, limit: int, what: str) -> None:
    """Integer ids in ``[0, limit)``: checked on the host where readable, else (debug) on the device."""
    if x.numel() == 0:
        return
    if values_readable(x):
        low, high = int(x.min()), int(x.max())
        if low < 0 or high >= limit:
            bad = int(torch.nonzero((x < 0) | (x >= limit))[0, 0])
            raise ValueError(f"{name}[{bad}] is {int(x[bad])}: {name} must lie in [0, {limit}) ({what})")
    elif debug_enabled():
        torch._assert_async(((x >= 0) & (x < limit)).all(), f"mla_ops debug: {name} must lie in [0, {limit})")


def assert_lengths_async(query_start_loc: torch.Tensor, context_lens: torch.Tensor, block_table: torch.Tensor,
                         block_size: int) -> None:
    """The debug switch's device-side form of ``check_lengths`` (no host sync)."""
    torch._assert_async(query_start_loc[0] == 0, "mla_ops debug: query_start_loc must start at 0")
    torch._assert_async((query_start_loc[1:] >= query_start_loc[:-1]).all(),
                        "mla_ops debug: query_start_loc must be non-decreasing")
    torch._assert_async((context_lens >= 0).all(), "mla_ops debug: context_lens must be non-negative")
    blocks = (context_lens + block_size - 1) // block_size
    torch._assert_async((blocks <= block_table.shape[1]).all(),
                        "mla_ops debug: block_table too short for a context")
    in_context = torch.arange(block_table.shape[1], device=block_table.device) < blocks.unsqueeze(1)
    used = block_table.narrow(0, 0, context_lens.shape[0])
    torch._assert_async((~in_context | (used >= 0)).all(), "mla_ops debug: block ids must be >= 0")


def k_scale_tensor(k_scale, kv_cache: torch.Tensor) -> torch.Tensor | None:
    """A checked ``k_scale`` as the kernels take it: a one-element float32 tensor for a float8_e4m3fn
    cache (a float becomes one on the cache's device: make it once per step), None otherwise."""
    if kv_cache.dtype != torch.float8_e4m3fn:
        return None
    if isinstance(k_scale, torch.Tensor):
        return k_scale.reshape(1)
    return torch.tensor([float(k_scale)], dtype=torch.float32, device=kv_cache.device)


def check_k_scale(k_scale, kv_cache: torch.Tensor, device: torch.device) -> None:
    """``k_scale``: required for a float8_e4m3fn cache (``check_scale``); ignored for other cache dtypes."""
    if kv_cache.dtype == torch.float8_e4m3fn and k_scale is None:
        raise ValueError("k_scale is required for a float8_e4m3fn kv_cache (dequantized = stored * k_scale)")
    if k_scale is not None:
        check_scale(k_scale, "k_scale", device)


def check_scale(scale, name: str, device: torch.device) -> None:
    """A dequantization scale: a float or a one-element float32 tensor on ``device`` whose float32 value
    (the dtype the kernels use) is positive, finite and normal, checked by value where that is free (a
    float, a CPU tensor; a GPU tensor under the debug switch, as a device-side assert)."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(
                f"{name} must be a float or a one-element float32 tensor, got {scale.numel()} "
                f"elements of {scale.dtype}"
            )
        if scale.device != device:
            raise ValueError(f"{name} must be on {device}, got {scale.device}")
        if values_readable(scale):
            _check_scale_value(float(scale.reshape(())), name)
        elif debug_enabled():
            torch._assert_async(torch.isfinite(scale).all() & (scale >= FLOAT32_TINY).all(),
                                f"mla_ops debug: {name} must be finite and positive, a normal float32")
    else:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"{name} must be a float or a one-element float32 tensor, got {type(scale).__name__}")
        _check_scale_value(float(scale), name)


FLOAT32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32


# A float rounds to a normal, finite float32 exactly in [these): from half a subnormal step below the smallest
# normal, to float32's largest value plus half its last step (ties round to even: the bounds round out).
_FLOAT32_NORMAL_FROM = FLOAT32_TINY - 2.0 ** -150
_FLOAT32_INF_FROM = torch.finfo(torch.float32).max + 2.0 ** 103
_NORMAL_FLOAT32 = f"a normal float32 (in [{FLOAT32_TINY:.6g}, {torch.finfo(torch.float32).max:.6g}])"


def _check_scale_value(value: float, name: str) -> None:
    # Checked as float32, the kernels' dtype: 1e-46 is finite and positive as a Python float but 0 in
    # float32, 1e39 is inf. 0 or inf would store every row as +-448 or 0 (row / scale, saturated) and read
    # it back as 0 or NaN; a subnormal loses its precision (and flushes to 0 on some kernels). Plain float
    # comparisons (NaN and inf fail them), no numpy or math: torch.compile traces them on a scale it made symbolic.
    if not (_FLOAT32_NORMAL_FROM <= value < _FLOAT32_INF_FROM):
        got = "" if torch.compiler.is_compiling() else f", got {value!r}" + (  # traced: a symbol, not in a message
            " (inf as float32)" if math.isfinite(value) and value >= _FLOAT32_INF_FROM else "")
        raise_value_error(f"{name} must be finite and positive, {_NORMAL_FLOAT32}{got}")
