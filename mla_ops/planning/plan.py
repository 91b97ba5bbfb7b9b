"""One plan per prefill step, shared by every layer: ``PrefillPlan`` and its single-device builders.

Everything that depends only on the step's lengths is decided once: the absorbed/MHA routing
split, the chunk schedule of the MHA-routed requests, the validated lengths, and (device form)
which requests overflow the chunk capacity. ``run_prefill`` then only launches.

* Host form (``max_chunks=None``): the chunks are planned on the host from the lengths' values
  (free for CPU tensors, which a scheduler has; a sync for GPU tensors) and their tensors are
  moved to the block table's device in one copy.
* Device form (``max_chunks=K``): the packed schedule in K fixed slots, computed with tensor code
  on the block table's device, reading nothing on the host: the form for ``torch.compile`` (it can
  be planned inside the compiled step) and CUDA graphs.

The plan lives on the block table's device (the device of the cache and the kernels). It is a
frozen dataclass and a pytree whose leaves are its tensors and the sizes it was planned for (ints).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.utils._pytree as pytree

from .. import _checks
from .._mla import absorbed_token_loc
from .device_schedule import DeviceSchedule, plan_context_chunks_device
from .index_schedule import IndexSchedule, device_index_schedule, host_index_schedule, sparse_requests
from .options import PlanOptions
from .routing import route_context
from .schedule import SMALL_BATCH, ContextSchedule, frozen_instance, schedule_checked

if TYPE_CHECKING:  # a type only: mla_ops.parallel builds on this module
    from ..parallel.plan import ContextParallelPlan


@dataclass(frozen=True)
class PrefillPlan:
    """A step's plan (module doc). ``B = context_lens.shape[0]`` requests."""

    query_start_loc: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [>= B, max_blocks] int32, the caller's tensor (not copied)
    absorbed_context_lens: torch.Tensor  # [B] int32 context read by the absorbed path; zeros: no request
    schedule: ContextSchedule | None  # host form: chunks of the MHA-routed context, tensors on the device
    device_schedule: DeviceSchedule | None  # device form: [K, B] chunk slots
    truncated: torch.Tensor | None  # device form: [B] bool, MHA context running past chunk K
    block_size: int
    workspace_size: int
    # The longest query an absorbed request can have (a static bound: FlashMLA's s_q): the routed
    # requests' longest (host form), the routing threshold (device form) or the token slots (context
    # parallel's device form); 0: no absorbed path.
    absorbed_query_bound: int
    num_tokens: int | None  # T, where the lengths were readable
    max_block_id: int  # largest block id a context uses; -1 if none or not readable
    # Rows of the absorbed path's packed scratch: the routed tokens (host form) or its capacity (device
    # form); -1: T.
    absorbed_rows: int = -1
    # Context parallel (mla_ops/parallel/): this rank's chunk pieces and reorder index; a pytree
    # node whose tensors are leaves and whose ContextParallel config and sizes are static context.
    # Its plans keep ``schedule`` / ``device_schedule`` in stripes of interleave * world_size rows.
    context_parallel: ContextParallelPlan | None = None
    # [B+1] int32: rows of each absorbed request's tokens in the absorbed path's packed scratch
    # (``_mla.absorbed_token_loc``), made once per step; None without an absorbed path.
    absorbed_token_loc: torch.Tensor | None = None
    options: PlanOptions | None = None  # what was asked (the fields above are what was planned)
    # DeepSeek Sparse Attention (DESIGN §12): K_I (0: dense MLA), the [B] bool requests routed to the
    # sparse path (their context is in neither ``schedule`` nor the absorbed lengths) and the indexer's
    # chunks over their sequences. ``truncated`` (device form) includes requests with indexer chunks
    # past the capacity.
    index_topk: int = 0
    sparse: torch.Tensor | None = None
    index_schedule: IndexSchedule | None = None
    # DSA: the suffix attention runs over the dense-routed requests' tokens only (a sparse request's rows are
    # the sparse attention's): [B+1] int32 their query offsets in the suffix's token order (``chunk_loop.
    # suffix_tokens``: a sparse request has none); None where no request is sparse (host form) or without
    # index_topk. ``suffix_rows``: those tokens (host form), or -1: T slots (device form), the others padding.
    suffix_query_start_loc: torch.Tensor | None = None
    suffix_rows: int = -1
    # A sliding window w (DESIGN §11; 0: none): query c_r + j sees keys c_r + j - w + 1 .. c_r + j. The
    # schedules hold each request's last min(c_r, w - 1) context rows only (their ``starts`` are context
    # positions); ``absorbed_context_lens`` keeps c_r, the absorbed kernel reads the window itself.
    sliding_window: int = 0

    @property
    def num_requests(self) -> int:
        return self.context_lens.shape[0]

    @property
    def max_chunks(self) -> int | None:
        """K of the device form; None for the host form."""
        return None if self.device_schedule is None else self.device_schedule.max_chunks

    @property
    def has_absorbed_path(self) -> bool:
        """Whether a layer launches the absorbed path (a static fact: some request may take it with
        queries); ``absorbed_context_lens`` is a [B] tensor either way."""
        return self.absorbed_query_bound > 0

    @property
    def device(self) -> torch.device:
        return self.block_table.device

    @property
    def form(self) -> str:
        """``"host"`` (chunks planned from the lengths' values) or ``"device"`` (K static chunk slots)."""
        return "host" if self.device_schedule is None else "device"

    def __repr__(self) -> str:
        planned = [f"form={self.form!r}", f"requests={self.num_requests}", f"tokens={self.num_tokens}"]
        if self.schedule is not None:
            planned.append(f"chunks={self.schedule.num_chunks}")
        else:
            planned.append(f"max_chunks={self.max_chunks}")
        if not self.has_absorbed_path:
            planned.append("absorbed=none")
        else:
            rows = "T" if self.absorbed_rows < 0 else self.absorbed_rows
            planned += [f"absorbed_query_bound={self.absorbed_query_bound}", f"absorbed_rows={rows}"]
        if self.index_topk:
            planned.append(f"index_topk={self.index_topk}")
            planned.append(f"{'index_chunks' if self.form == 'host' else 'max_index_chunks'}="
                           f"{self.index_schedule.max_chunks}")
        if self.sliding_window:
            planned.append(f"sliding_window={self.sliding_window}")
        if self.context_parallel is not None:
            planned.append(f"context_parallel=rank {self.context_parallel.rank} of {self.context_parallel.world_size}")
        planned += [f"workspace_size={self.workspace_size}", f"block_size={self.block_size}", f"device={self.device}",
                    f"options={self.options!r}"]
        return f"PrefillPlan({', '.join(planned)})"


def register_plan_pytree(cls, static: tuple[str, ...] = ()) -> None:
    """A plan dataclass as a pytree: ``static`` fields are its context (objects such as a process group),
    the others its children, sizes and ``PlanOptions`` included: a nested compile region's input is
    flattened while tracing, and its context must then be a constant Dynamo can rebuild, which a frozen
    dataclass (or an int that a compile made symbolic) is not."""
    children = tuple(f.name for f in fields(cls) if f.name not in static)

    def flatten(obj):
        return [getattr(obj, n) for n in children], tuple(getattr(obj, n) for n in static)

    def unflatten(values, context):
        return cls(**dict(zip(children, values)), **dict(zip(static, context)))

    pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name=f"mla_ops.{cls.__name__}")


register_plan_pytree(PlanOptions)
register_plan_pytree(PrefillPlan)
register_plan_pytree(DeviceSchedule)
register_plan_pytree(IndexSchedule)


def check_inputs(query_start_loc, context_lens, block_table) -> None:
    """The step's length tensors and block table: int32, their ranks and a row per request."""
    _checks.check_int32(block_table, "block_table", 2, "[B, max_blocks]")
    _checks.check_int32(context_lens, "context_lens", 1, "[B]")
    _checks.check_int32(query_start_loc, "query_start_loc", 1, "[B+1]")
    batch = context_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(
            f"query_start_loc must be [B+1] = [{batch + 1}] for B={batch} context_lens, "
            f"got {list(query_start_loc.shape)}"
        )
    if block_table.shape[0] < batch:
        raise ValueError(f"block_table must have a row per request (B={batch}), got {block_table.shape[0]} rows")


def check_step_tensors(plan: PrefillPlan, **given: torch.Tensor) -> None:
    """Lengths or a block table passed beside a plan (``block_table=``, ``query_start_loc=``,
    ``context_lens=``) must be the plan's own tensors, or, on the CPU where reading is free, equal to
    them: a plan is made for one step, and a plan of another step with the same shapes would
    attend the wrong keys. On a GPU (or under tracing) only the plan's own tensors pass."""
    for name, x in given.items():
        planned = getattr(plan, name)
        if x is planned:
            continue
        if isinstance(x, torch.Tensor) and _checks.values_readable(x, planned) and x.dtype == planned.dtype \
                and x.shape == planned.shape and torch.equal(x, planned):
            continue
        where = "its values differ" if isinstance(x, torch.Tensor) and _checks.values_readable(x, planned) else \
            "not the plan's tensor, and its values cannot be compared for free (not both CPU tensors)"
        raise ValueError(f"{name} is not the one plan was made for ({where}): plan each step with plan_prefill "
                         "and pass that step's tensors")


def current_max_block_id(plan: PrefillPlan) -> int:
    """The largest block id the plan's contexts use in its block table as the table is now: on CPU
    tables read again (in proportion to the ids used), so an id edited after planning is caught;
    elsewhere the value read at planning (-1: none read)."""
    lens = plan.context_lens if plan.context_parallel is None else plan.context_parallel.local_context_lens
    if not _checks.values_readable(plan.block_table, lens):
        return plan.max_block_id
    blocks = -(-lens.numpy().astype(np.int64) // plan.block_size)
    return _checks.check_block_ids(plan.block_table.numpy(), blocks)


def check_on_plan_device(query_start_loc, context_lens, block_table) -> None:
    """A device plan reads its lengths where its kernels run: on the block table's device."""
    for name, x in (("query_start_loc", query_start_loc), ("context_lens", context_lens)):
        if x.device != block_table.device:
            raise ValueError(
                f"{name} must be on {block_table.device} (the device of block_table) for a device plan "
                f"(max_chunks), got {x.device}"
            )


def window_rows(context_lens, window: int):
    """``(rows, first)``: the context rows a sliding window of ``window`` keys covers per request, its last
    ``min(c_r, window - 1)`` (query ``c_r`` sees ``c_r - window + 1 ..``, later queries fewer), and the position
    of the first, ``c_r - rows``. Lists, int64 arrays or (device code) tensors, as given."""
    if isinstance(context_lens, list):
        rows = [min(c, window - 1) for c in context_lens]
        return rows, [c - n for c, n in zip(context_lens, rows)]
    rows = (torch.clamp(context_lens, max=window - 1) if isinstance(context_lens, torch.Tensor)
            else np.minimum(context_lens, window - 1))
    return rows, context_lens - rows


def whole_context_where_routed(context_lens, routed):
    """The absorbed lengths of a windowed plan: ``c_r`` (the absorbed kernel reads its window itself) where
    the window's rows were routed there (``routed[r] > 0``), else 0."""
    if isinstance(context_lens, list):
        return [c if a else 0 for c, a in zip(context_lens, routed)]
    if isinstance(context_lens, torch.Tensor):
        return torch.where(routed > 0, context_lens, 0)
    return np.where(routed > 0, context_lens, 0)


# Requests up to which the value checks walk Python lists; numpy's per-call cost pays off beyond.
LIST_CHECKS = 32


def host_values(query_start_loc, context_lens, block_table, block_size):
    """The lengths on the host, checked: lists for a small batch, int64 arrays for a large one (as
    the host planner takes them); ``(qsl, ctx, max_block_id)``. A GPU tensor's values cost a sync."""
    batch = context_lens.shape[0]
    readable_table = block_table.is_cpu
    table = block_table.numpy() if readable_table else np.zeros((batch, block_table.shape[1]), np.int32)
    if batch <= LIST_CHECKS:
        qsl, ctx = query_start_loc.tolist(), context_lens.tolist()
        max_block_id = _checks.check_lengths(qsl, ctx, table, block_size)
    else:
        qsl, ctx = (t.cpu().numpy().astype(np.int64) for t in (query_start_loc, context_lens))
        max_block_id = _checks.check_lengths(qsl, ctx, table, block_size)
        if batch <= SMALL_BATCH:
            qsl, ctx = qsl.tolist(), ctx.tolist()
    return qsl, ctx, (max_block_id if readable_table else -1)


def plan_host(query_start_loc, context_lens, block_table, options: PlanOptions) -> PrefillPlan:
    """The host form (module doc): checked inputs, options and lengths read on the host."""
    device, block_size = block_table.device, options.block_size
    qsl, ctx, max_block_id = host_values(query_start_loc, context_lens, block_table, block_size)
    small = isinstance(qsl, list)
    query_lens = [b - a for a, b in zip(qsl, qsl[1:])] if small else np.diff(qsl)
    sparse = index_schedule = suffix_loc = None
    suffix_rows = -1
    if options.index_topk:
        host_qsl = torch.as_tensor(qsl, dtype=torch.int32)
        host_ctx = torch.as_tensor(ctx, dtype=torch.int32)
        sparse = sparse_requests(host_qsl, host_ctx, options.index_topk)
        index_schedule = host_index_schedule(host_qsl, host_ctx, sparse, options.workspace_size,
                                             options.index_scores_budget).to(device)
        ctx = [0 if s else c for c, s in zip(ctx, sparse.tolist())] if small else np.where(sparse.numpy(), 0, ctx)
        if bool(sparse.any()):
            dense_queries = np.where(sparse.numpy(), 0, np.asarray(query_lens, dtype=np.int64))
            suffix_rows = int(dense_queries.sum())
            suffix_loc = torch.as_tensor(np.concatenate([[0], np.cumsum(dense_queries)]), dtype=torch.int32)
            suffix_loc = suffix_loc.to(device, non_blocking=True)
        sparse = sparse.to(device, non_blocking=True)
    window_ctx = first = None
    if options.window:  # only the rows the window covers are chunked or routed
        window_ctx, (ctx, first) = ctx, window_rows(ctx, options.window)
    mha_lens, absorbed_lens = ctx, None
    if options.absorb_threshold:
        mha_lens, absorbed_lens = route_context(ctx, query_lens, options.absorb_threshold, options.absorbed_capacity)
        if window_ctx is not None:
            absorbed_lens = whole_context_where_routed(window_ctx, absorbed_lens)
    schedule = schedule_checked(mha_lens, query_lens, options.workspace_size, options.policy, options.split_alignment)
    if first is not None:
        schedule = schedule.offset_starts(first)
    if not block_table.is_cpu:
        schedule = schedule.to(device, non_blocking=True)
    absorbed = token_loc = None
    routed = [] if absorbed_lens is None else [q for q, a in zip(query_lens, absorbed_lens) if a] if small else \
        query_lens[absorbed_lens > 0].tolist()
    if routed:
        # The absorbed lengths and each request's rows in the packed scratch, moved in one copy.
        if small:
            packed = [q if a else 0 for q, a in zip(query_lens, absorbed_lens)]
            values = [*absorbed_lens, 0, *itertools.accumulate(packed)]
        else:
            values = np.concatenate([absorbed_lens, [0], np.cumsum(np.where(absorbed_lens > 0, query_lens, 0))])
        batch = len(absorbed_lens)
        lens_and_loc = torch.as_tensor(values, dtype=torch.int32).to(device, non_blocking=True)
        absorbed, token_loc = lens_and_loc.split([batch, batch + 1])
    else:  # one type always: a [B] tensor of zeros (a memset on the device, no copy)
        absorbed = torch.zeros(len(ctx), dtype=torch.int32, device=device)
    if not (query_start_loc.is_cpu and block_table.is_cpu) and query_start_loc.device != device:
        query_start_loc = query_start_loc.to(device, non_blocking=True)
        context_lens = context_lens.to(device, non_blocking=True)
    return frozen_instance(PrefillPlan, dict(
        query_start_loc=query_start_loc, context_lens=context_lens,
        block_table=block_table, absorbed_context_lens=absorbed, schedule=schedule, device_schedule=None,
        truncated=None, block_size=block_size, workspace_size=options.workspace_size,
        # the routed requests' longest query: a tighter static bound than the threshold
        absorbed_query_bound=max(routed, default=0), num_tokens=int(qsl[-1]), max_block_id=max_block_id,
        absorbed_rows=sum(routed), context_parallel=None, absorbed_token_loc=token_loc, options=options,
        index_topk=options.index_topk or 0, sparse=sparse, index_schedule=index_schedule,
        suffix_query_start_loc=suffix_loc, suffix_rows=suffix_rows, sliding_window=options.window,
    ))


def plan_device(query_start_loc, context_lens, block_table, options: PlanOptions) -> PrefillPlan:
    """The device form (module doc): tensor code on the block table's device, no host read."""
    check_on_plan_device(query_start_loc, context_lens, block_table)
    block_size, workspace_size, max_chunks = options.block_size, options.workspace_size, options.max_chunks
    threshold, capacity = options.absorb_threshold, options.absorbed_capacity
    num_tokens, max_block_id = None, -1
    if _checks.values_readable(query_start_loc, context_lens, block_table):
        qsl, _, max_block_id = host_values(query_start_loc, context_lens, block_table, block_size)
        num_tokens = int(qsl[-1])
    elif _checks.debug_enabled():
        _checks.assert_lengths_async(query_start_loc, context_lens, block_table, block_size)
    absorbed = sparse = index_schedule = suffix_loc = None
    mha_lens = context_lens
    if options.index_topk:
        sparse = sparse_requests(query_start_loc, context_lens, options.index_topk)
        dense_queries = torch.where(sparse, 0, query_start_loc[1:] - query_start_loc[:-1])
        suffix_loc = torch.nn.functional.pad(torch.cumsum(dense_queries, 0), (1, 0)).int()
        index_schedule = device_index_schedule(query_start_loc, context_lens, sparse, options.workspace_size,
                                               options.index_tokens, options.index_capacity)
        mha_lens = torch.where(sparse, 0, context_lens)
    first = None
    if options.window:  # only the rows the window covers are chunked or routed
        mha_lens, first = window_rows(mha_lens, options.window)
    if threshold and capacity:
        mha_lens, absorbed = route_context(mha_lens, query_start_loc[1:] - query_start_loc[:-1], threshold,
                                           capacity)
        if first is not None:
            absorbed = whole_context_where_routed(context_lens, absorbed)
    else:
        threshold = capacity = 0
        absorbed = torch.zeros_like(context_lens)
    schedule = plan_context_chunks_device(mha_lens, workspace_size, max_chunks)
    if first is not None:  # the chunks' rows from each window's first position on
        schedule = dataclasses.replace(
            schedule, starts=torch.where(schedule.seq_lens > 0, schedule.starts + first, 0).to(torch.int32))
    if not torch.compiler.is_compiling():
        # Passed into a compiled function, K stays a constant: under dynamic=True, duck sizing
        # would otherwise tie a dynamic size equal to K (e.g. B+1 = K) to it and specialize both.
        for t in (schedule.starts, schedule.seq_lens, schedule.cu_seq_lens):
            torch._dynamo.mark_static(t, 0)
        if index_schedule is not None:
            for t in (index_schedule.starts, index_schedule.seq_lens, index_schedule.cu_seq_lens,
                      index_schedule.token_start, index_schedule.token_end):
                torch._dynamo.mark_static(t, 0)
    if _checks.debug_enabled():
        torch._assert_async(~schedule.overflow, "mla_ops debug: the batch needs more chunks than max_chunks")
        if index_schedule is not None:
            torch._assert_async(~index_schedule.truncated.any(),
                                "mla_ops debug: the batch needs more indexer chunks than max_index_chunks")
    truncated = (torch.cumsum(mha_lens, 0) > max_chunks * workspace_size) & (mha_lens > 0)
    if index_schedule is not None:
        truncated = truncated | index_schedule.truncated
    return PrefillPlan(
        query_start_loc=query_start_loc, context_lens=context_lens, block_table=block_table,
        absorbed_context_lens=absorbed, schedule=None, device_schedule=schedule, truncated=truncated,
        block_size=block_size, workspace_size=workspace_size, absorbed_query_bound=threshold,
        num_tokens=num_tokens, max_block_id=max_block_id, absorbed_rows=capacity,
        absorbed_token_loc=absorbed_token_loc(query_start_loc, absorbed) if capacity else None,
        options=options, index_topk=options.index_topk or 0, sparse=sparse, index_schedule=index_schedule,
        suffix_query_start_loc=suffix_loc, sliding_window=options.window,
    )
