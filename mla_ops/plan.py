"""One plan per prefill step, shared by every layer: ``plan_prefill`` -> ``PrefillPlan``.

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
frozen dataclass and a pytree: tensors are its leaves, the sizes it was planned for static ints.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.utils._pytree as pytree

from . import validation as V
from .device_schedule import DeviceSchedule, plan_context_chunks_device
from .routing import DEFAULT_ABSORB_MAX_QUERY_LEN, route_context
from .schedule import POLICIES, SMALL_BATCH, ContextSchedule, plan_context_chunks

if TYPE_CHECKING:  # context_parallel builds on this module
    from .context_parallel import ContextParallel, ContextParallelPlan


@dataclass(frozen=True)
class PrefillPlan:
    """A step's plan (module doc). ``B = context_lens.shape[0]`` requests."""

    query_start_loc: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [>= B, max_blocks] int32, the caller's tensor (not copied)
    absorbed_context_lens: torch.Tensor | None  # [B] context read by the absorbed path; None: no request
    schedule: ContextSchedule | None  # host form: chunks of the MHA-routed context, tensors on the device
    device_schedule: DeviceSchedule | None  # device form: [K, B] chunk slots
    truncated: torch.Tensor | None  # device form: [B] bool, MHA context running past chunk K
    block_size: int
    workspace_size: int
    absorb_max_query_len: int  # 0: no absorbed path
    num_tokens: int | None  # T, where the lengths were readable
    max_block_id: int  # largest block id a context uses; -1 if none or not readable
    # Rows of the absorbed path's packed scratch: the routed tokens (host form) or its capacity (device
    # form); -1: T.
    max_absorbed_tokens: int = -1
    # Context parallel (mla_ops/context_parallel.py): this rank's chunk pieces and reorder index; a pytree
    # node whose tensors are leaves and whose ContextParallel config and sizes are static context.
    # Its plans keep ``schedule`` / ``device_schedule`` in stripes of interleave * world_size rows.
    context_parallel: ContextParallelPlan | None = None

    @property
    def num_requests(self) -> int:
        return self.context_lens.shape[0]

    @property
    def max_chunks(self) -> int | None:
        """K of the device form; None for the host form."""
        return None if self.device_schedule is None else self.device_schedule.max_chunks

    @property
    def device(self) -> torch.device:
        return self.block_table.device


def _register_pytree(cls, static: tuple[str, ...]) -> None:
    children = tuple(f.name for f in fields(cls) if f.name not in static)

    def flatten(obj):
        return [getattr(obj, n) for n in children], tuple(getattr(obj, n) for n in static)

    def unflatten(values, context):
        return cls(**dict(zip(children, values)), **dict(zip(static, context)))

    pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name=f"mla_ops.{cls.__name__}")


_register_pytree(PrefillPlan, ("block_size", "workspace_size", "absorb_max_query_len", "num_tokens", "max_block_id",
                               "max_absorbed_tokens"))
_register_pytree(DeviceSchedule, ("workspace_size",))


def plan_prefill(
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int = 16,
    workspace_size: int = 65536,
    policy: str = "packed",
    split_alignment: int = 1,
    max_chunks: int | None = None,
    absorb_max_query_len: int | None = None,
    *,
    max_absorbed_tokens: int | None = None,
    context_parallel: ContextParallel | None = None,
) -> PrefillPlan:
    """Plan a prefill step once for all layers (module doc).

    query_start_loc [B+1] int32, context_lens [B] int32, block_table [>= B, max_blocks] int32 (its
    device is the plan's). ``max_chunks=K`` gives the device form (packed, ``split_alignment=1``).
    ``absorb_max_query_len``: requests with at most this many new tokens (and some context) take the
    absorbed path; None is ``routing.DEFAULT_ABSORB_MAX_QUERY_LEN``, 0 disables the path.
    ``max_absorbed_tokens``: the most new tokens the absorbed path takes in one step; the first routed
    requests that fit take it, the rest stay on the chunked path (exact either way). Its packed
    scratch has this many rows in the device form, where it is static; None: no cap on the host,
    ``workspace_size // 4`` on the device (at DeepSeek's dims its scratch, 2 x N x L per token, is then
    the size of the chunk loop's up-projected workspace, N x (P+V) per row, allocated after it is freed).
    ``context_parallel=mla_ops.ContextParallel(group, interleave)``: the latent cache is sharded over
    the group's ranks; ``block_table`` is this rank's, the lengths are global, and
    ``absorb_max_query_len`` routes between the all-gather and absorbed-queries paths (None: their
    cost model); see ``mla_ops/context_parallel.py``.

    Checks shapes and arguments always, and the lengths' values and the block ids the contexts use
    wherever they are readable for free (CPU tensors, not traced). Raises before anything runs.
    """
    V.check_int32(block_table, "block_table", 2, "[B, max_blocks]")
    device = block_table.device
    V.check_int32(context_lens, "context_lens", 1, "[B]")
    V.check_int32(query_start_loc, "query_start_loc", 1, "[B+1]")
    batch = context_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(
            f"query_start_loc must be [B+1] = [{batch + 1}] for B={batch} context_lens, "
            f"got {list(query_start_loc.shape)}"
        )
    if block_table.shape[0] < batch:
        raise ValueError(f"block_table must have a row per request (B={batch}), got {block_table.shape[0]} rows")
    block_size = V.check_positive_int(block_size, "block_size")
    workspace_size = V.check_positive_int(workspace_size, "workspace_size")
    split_alignment = V.check_positive_int(split_alignment, "split_alignment")
    if workspace_size < split_alignment:
        raise ValueError(
            f"workspace_size must hold at least one split_alignment step ({split_alignment} rows), "
            f"got {workspace_size}"
        )
    V.check_choice(policy, "policy", POLICIES)
    if context_parallel is not None:
        from .context_parallel import plan_context_parallel  # that module builds on this one

        return plan_context_parallel(query_start_loc, context_lens, block_table, block_size, workspace_size, policy,
                                     split_alignment, max_chunks, absorb_max_query_len, context_parallel)
    if absorb_max_query_len is None:
        absorb_max_query_len = DEFAULT_ABSORB_MAX_QUERY_LEN
    absorb_max_query_len = V.check_nonnegative_int(absorb_max_query_len, "absorb_max_query_len", " (0 disables)")
    if max_absorbed_tokens is not None:
        max_absorbed_tokens = V.check_nonnegative_int(max_absorbed_tokens, "max_absorbed_tokens")
    if max_chunks is not None:
        max_chunks = V.check_positive_int(max_chunks, "max_chunks")
        if policy != "packed" or split_alignment != 1:
            raise ValueError(
                "max_chunks plans the packed schedule (split_alignment=1) on the device: it cannot be "
                f"combined with policy={policy!r} or split_alignment={split_alignment}"
            )
        return _device_plan(query_start_loc, context_lens, block_table, block_size, workspace_size, max_chunks,
                            absorb_max_query_len, device_absorbed_capacity(workspace_size, max_absorbed_tokens))
    if torch.compiler.is_compiling():
        raise ValueError(
            "plan_prefill under torch.compile needs max_chunks=K (a static capacity): the host planner "
            "reads the lengths' values. Pick K per batch bucket, e.g. ceil(max total context / workspace_size)."
        )
    return _host_plan(query_start_loc, context_lens, block_table, block_size, workspace_size, policy,
                      split_alignment, absorb_max_query_len, max_absorbed_tokens, device)


def device_absorbed_capacity(workspace_size: int, max_absorbed_tokens: int | None) -> int:
    """The device form's absorbed token capacity: ``max_absorbed_tokens``, by default a quarter of the
    workspace rows (``plan_prefill``'s docstring)."""
    return workspace_size // 4 if max_absorbed_tokens is None else max_absorbed_tokens


def _host_values(query_start_loc, context_lens, block_table, block_size):
    """The lengths on the host, checked: lists for a small batch, arrays for a large one (as the host
    planner takes them); ``(qsl, ctx, max_block_id)``."""
    small = context_lens.shape[0] <= SMALL_BATCH
    qsl, ctx = (t.cpu().numpy() for t in (query_start_loc, context_lens))  # a GPU tensor: a sync
    if small:
        qsl, ctx = qsl.tolist(), ctx.tolist()  # (numpy's tolist: several times quicker than a tensor's)
    readable_table = block_table.device.type == "cpu"
    table = block_table.numpy() if readable_table else np.zeros((len(ctx), block_table.shape[1]), np.int32)
    max_block_id = V.check_lengths(qsl, ctx, table, block_size)
    return qsl, ctx, (max_block_id if readable_table else -1)


def _host_plan(query_start_loc, context_lens, block_table, block_size, workspace_size, policy, split_alignment,
               absorb_max_query_len, max_absorbed_tokens, device) -> PrefillPlan:
    qsl, ctx, max_block_id = _host_values(query_start_loc, context_lens, block_table, block_size)
    query_lens = [b - a for a, b in zip(qsl, qsl[1:])] if isinstance(qsl, list) else np.diff(qsl)
    mha_lens, absorbed_lens = route_context(ctx, query_lens, absorb_max_query_len, max_absorbed_tokens)
    schedule = plan_context_chunks(mha_lens, query_lens, workspace_size, policy=policy, split_alignment=split_alignment)
    if device.type != "cpu":
        schedule = schedule.to(device, non_blocking=True)
    absorbed = None
    routed = [q for q, a in zip(query_lens, absorbed_lens) if a] if isinstance(qsl, list) else \
        query_lens[absorbed_lens > 0].tolist()
    if routed:
        absorbed = torch.tensor(absorbed_lens, dtype=torch.int32).to(device, non_blocking=True)
        absorb_max_query_len = max(routed)  # a tighter static bound
    else:
        absorb_max_query_len = 0
    if query_start_loc.device != device:
        query_start_loc = query_start_loc.to(device, non_blocking=True)
        context_lens = context_lens.to(device, non_blocking=True)
    return PrefillPlan(
        query_start_loc=query_start_loc, context_lens=context_lens,
        block_table=block_table, absorbed_context_lens=absorbed, schedule=schedule, device_schedule=None,
        truncated=None, block_size=block_size, workspace_size=workspace_size,
        absorb_max_query_len=absorb_max_query_len, num_tokens=int(qsl[-1]), max_block_id=max_block_id,
        max_absorbed_tokens=sum(routed),
    )


def _device_plan(query_start_loc, context_lens, block_table, block_size, workspace_size, max_chunks,
                 absorb_max_query_len, max_absorbed_tokens) -> PrefillPlan:
    for name, x in (("query_start_loc", query_start_loc), ("context_lens", context_lens)):
        if x.device != block_table.device:
            raise ValueError(
                f"{name} must be on {block_table.device} (the device of block_table) for a device plan "
                f"(max_chunks), got {x.device}"
            )
    num_tokens, max_block_id = None, -1
    if V.values_readable(query_start_loc, context_lens, block_table):
        qsl, _, max_block_id = _host_values(query_start_loc, context_lens, block_table, block_size)
        num_tokens = int(qsl[-1])
    elif V.debug_enabled():
        V.assert_lengths_async(query_start_loc, context_lens, block_table, block_size)
    absorbed = None
    mha_lens = context_lens
    if absorb_max_query_len and max_absorbed_tokens:
        mha_lens, absorbed = route_context(context_lens, query_start_loc[1:] - query_start_loc[:-1],
                                           absorb_max_query_len, max_absorbed_tokens)
    else:
        absorb_max_query_len = max_absorbed_tokens = 0
    schedule = plan_context_chunks_device(mha_lens, workspace_size, max_chunks)
    if not torch.compiler.is_compiling():
        # Passed into a compiled function, K stays a constant: under dynamic=True, duck sizing
        # would otherwise tie a dynamic size equal to K (e.g. B+1 = K) to it and specialize both.
        for t in (schedule.starts, schedule.seq_lens, schedule.cu_seq_lens):
            torch._dynamo.mark_static(t, 0)
    if V.debug_enabled():
        torch._assert_async(~schedule.overflow, "mla_ops debug: the batch needs more chunks than max_chunks")
    truncated = (torch.cumsum(mha_lens, 0) > max_chunks * workspace_size) & (mha_lens > 0)
    return PrefillPlan(
        query_start_loc=query_start_loc, context_lens=context_lens, block_table=block_table,
        absorbed_context_lens=absorbed, schedule=None, device_schedule=schedule, truncated=truncated,
        block_size=block_size, workspace_size=workspace_size, absorb_max_query_len=absorb_max_query_len,
        num_tokens=num_tokens, max_block_id=max_block_id, max_absorbed_tokens=max_absorbed_tokens,
    )
