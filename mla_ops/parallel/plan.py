"""Context-parallel planning over D ranks (DESIGN §10): the latent cache sharded by token.

Layout (vLLM's decode context parallel, interleave I): context token ``p`` of a request lives on
rank ``(p // I) % D`` at local position ``(p // (I*D)) * I + p % I`` of that rank's own paged cache
and block table. A *stripe* is I*D consecutive tokens: I on every rank. Each rank holds its own
query heads (``q``, ``kv_b_proj_weight`` and the output are its tensor-parallel shard) and the new
tokens' ``kv_c`` / ``k_pe`` in full. ``shard_context`` cuts a single-device cache this way.

    plan = mla_ops.plan_prefill(query_start_loc, context_lens, local_block_table, ...,
                                context_parallel=mla_ops.ContextParallel(group, interleave=I))
    out = mla_ops.run_prefill(q_local_heads, kv_c, k_pe, local_cache, local_kv_b_proj_weight, scale, plan)

Every rank passes the *global* ``query_start_loc`` / ``context_lens`` and plans the same schedule,
so the collectives line up. Per request, one of two context paths (the suffix stays local):

* all-gather (vLLM's prefill way; traffic grows with the context): chunks are planned in whole
  stripes, at most ``workspace_size // (I*D)`` per chunk, so every rank's share of a chunk fits
  its part of the workspace (``part_rows``: that times I in the device form; in the host form each
  chunk's parts are as long as the largest share a rank has of it, so short chunks move less). Each
  rank gathers its rows of the chunk into its part (``gather_context``), the parts are
  all-gathered, reordered to request order by an index planned once per step, and every rank
  up-projects and attends for its own heads (``up_project``, ``context_attention``). Memory per
  rank: the chunk's D parts, the reordered workspace and its up-projection, all at most
  ``workspace_size`` rows.
* absorbed queries (vLLM's decode way; traffic grows with the queries): each rank folds its
  heads' queries (``_mla.fold_queries``: ``q_nope @ W_UK``, with ``q_pe``: width L+R); these are
  all-gathered, so every rank holds every head's queries; each rank attends over its own shard
  only (``latent_context_attention``, one KV head in the latent space); an all-to-all sends the
  latent partials with their LSEs (float32, one extra column) back to each head's owner, who
  merges the D partials (``merge_attn_states``) and applies ``W_UV`` (``_mla.unfold_outputs``).

Both are exact: the per-rank partials are the single-device partials of disjoint key sets. The
context partial then merges with the local suffix partial as on one device.

Routing (``plan_prefill(absorb_max_query_len=...)``): None asks ``CostModel`` per request (bytes
each rank receives, turned into FLOPs at the machine balance ``flops_per_byte``, plus FLOPs);
an int routes requests with at most that many new tokens to the absorbed-queries path; 0 turns
that path off. The device form (``max_chunks=K``) needs a static size for the gathered queries:
``plan_prefill(max_absorbed_tokens=A)`` (requests past it take the all-gather path; with None the
device form has no absorbed-queries path). In the host form A, when given, caps it likewise.

Collectives: ``torch.distributed``'s functional collectives (``all_gather_single``,
``all_to_all_single``) on the group's backend (NCCL on GPU, gloo on CPU), eager and under
``torch.compile``, where they become graph nodes (device plan: no host read). Ranks that plan
different steps would hang or mix silently; ``ContextParallel(check=True)`` (or
``mla_ops.set_debug(True)``) all-gathers a checksum of the lengths and planning arguments at plan
time and raises a ValueError naming the rank that disagrees (device-side asserts under compile).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from .. import _checks
from ..planning.device_schedule import plan_context_chunks_device
from ..planning.options import PlanOptions
from ..planning.plan import PrefillPlan, check_on_plan_device, register_plan_pytree
from ..planning.schedule import plan_context_chunks
from . import collectives
from .config import ContextParallel
from .layout import local_context_lens


@dataclass(frozen=True)
class ContextParallelPlan:
    """This rank's part of a context-parallel ``PrefillPlan`` (``PrefillPlan.context_parallel``).

    All-gather path, K chunk slots spread over the whole batch (B requests, most with no rows in a
    given chunk; host form: K = the chunks the step needs; device form: K = ``max_chunks``).
    Absorbed-queries path: a compact batch of A token slots, its requests' offsets and local rows.
    """

    local_context_lens: torch.Tensor  # [B] int32: this rank's rows of every request
    local_starts: torch.Tensor  # [K, B] int32: first local position this rank gathers per request
    local_cu_seq_lens: torch.Tensor  # [K, B+1] int32: offsets in this rank's part of the workspace
    starts: torch.Tensor  # [K, B] int32: global context offset of each piece (> 0: a continuation)
    cu_seq_lens: torch.Tensor  # [K, B+1] int32: offsets in the request-ordered workspace
    reorder: torch.Tensor  # [K, D * part_rows] int32: all-gathered row of each request-ordered row
    absorbed_query_start_loc: torch.Tensor  # [B+1] int32: slots of the absorbed requests' tokens
    absorbed_local_lens: torch.Tensor  # [B] int32: this rank's rows of the absorbed requests, else 0
    config: ContextParallel
    rank: int
    world_size: int
    part_rows: int  # rows of this rank's part of the workspace (the widest chunk's)
    chunk_part_rows: tuple[int, ...] | None  # host form: each chunk's part rows (all-gathered per chunk)
    num_absorbed_tokens: int  # A: token slots of the absorbed-queries batch (0: path unused)

    @property
    def num_chunks(self) -> int:
        return self.starts.shape[0]


# The config and sizes are static context (compared, not traced); the tensors are the leaves.
register_plan_pytree(ContextParallelPlan, ("config", "rank", "world_size", "part_rows", "chunk_part_rows",
                                           "num_absorbed_tokens"))


def plan_context_parallel(query_start_loc, context_lens, block_table, options: PlanOptions,
                          cp: ContextParallel) -> PrefillPlan:
    """``plan_prefill(..., context_parallel=cp)`` after its input and option checks (module doc)."""
    if not isinstance(cp, ContextParallel):
        raise TypeError(f"context_parallel must be a mla_ops.ContextParallel, got {type(cp).__name__}")
    world_size, rank, interleave = cp.world_size, cp.rank, cp.interleave
    stripe, workspace_size, split_alignment = interleave * world_size, options.workspace_size, options.split_alignment
    if workspace_size < stripe:
        raise ValueError(f"workspace_size must hold at least one stripe of interleave * world_size = {stripe} "
                         f"rows under context parallel, got {workspace_size}")
    if split_alignment != 1 and split_alignment % stripe:
        raise ValueError(f"split_alignment must be 1 or a multiple of interleave * world_size = {stripe} under "
                         f"context parallel (chunks split requests at whole stripes), got {split_alignment}")
    threshold = options.absorb_max_query_len
    # The absorbed-queries path's token slots: a static size in the device form, where its collectives
    # run every step, so None there means no such path; no cap in the host form.
    capacity = (options.max_absorbed_tokens or 0) if options.device_form else options.max_absorbed_tokens
    stripes = _Stripes(rank, world_size, interleave, workspace_size, workspace_size // stripe,
                       max(1, split_alignment // stripe), threshold, 0 if threshold == 0 else capacity, cp)
    if options.device_form:
        plan = _device_plan(query_start_loc, context_lens, block_table, options, stripes)
    else:
        plan = _host_plan(query_start_loc, context_lens, block_table, options, stripes)
    if cp.check if cp.check is not None else _checks.debug_enabled():
        _check_ranks_agree(plan, options.max_chunks, stripes)
    return plan


@dataclass(frozen=True)
class _Stripes:
    rank: int
    world_size: int
    interleave: int
    workspace_size: int
    stripes_per_chunk: int
    stripe_alignment: int
    threshold: int | None  # absorb_max_query_len; None: the cost model
    capacity: int | None  # max_absorbed_tokens: the absorbed-queries path's token slots; None: no cap
    config: ContextParallel

    @property
    def part_rows(self) -> int:
        return self.stripes_per_chunk * self.interleave

    def absorbed(self, context_lens, query_lens, capacity: int | None):
        """Bool per request: takes the absorbed-queries path (numpy or tensors)."""
        if self.threshold is None:
            absorbed = self.config.cost_model.prefers_absorbed(context_lens, query_lens, self.world_size)
        else:
            absorbed = query_lens <= self.threshold if self.threshold > 0 else context_lens < 0  # 0: none
        absorbed = absorbed & (context_lens > 0)
        if capacity is not None:  # the gathered queries have a static size: the first requests that fit it
            taken = absorbed * query_lens
            taken = taken.cumsum(0) if isinstance(taken, torch.Tensor) else np.cumsum(taken)
            absorbed = absorbed & (taken <= capacity)
        return absorbed

    def stripes(self, context_lens):
        stripe = self.interleave * self.world_size
        return (context_lens + stripe - 1) // stripe


def _host_plan(query_start_loc, context_lens, block_table, options: PlanOptions, args: _Stripes) -> PrefillPlan:
    device, block_size = block_table.device, options.block_size
    qsl, ctx = query_start_loc.cpu().numpy(), context_lens.cpu().numpy()  # a sync for GPU lengths
    local = local_context_lens(ctx, args.rank, args.world_size, args.interleave)
    readable = device.type == "cpu"
    table = block_table.numpy() if readable else np.zeros((ctx.size, block_table.shape[1]), np.int32)
    max_block_id = _checks.check_lengths(qsl, local, table, block_size)  # on a GPU table: the lengths only
    if not readable:
        max_block_id = -1
    query_lens = np.diff(qsl)
    absorbed, gathered_ctx, stripe_starts, stripe_lens, schedule = _host_schedule(ctx, query_lens, options.policy,
                                                                                  args)
    host = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    to_device = lambda a: host(a).to(device)  # noqa: E731
    # The pieces are planned on the host, where each chunk's parts can shrink to the largest share a
    # rank has of it (the device form's parts have the static size of a full chunk).
    pieces = _chunk_pieces(host(stripe_starts), host(stripe_lens), host(gathered_ctx), args)
    part_rows = tuple(max(int(x), 1) for x in pieces.local_cu_seq_lens[..., -1].amax(0))
    absorbed_qsl = np.concatenate([[0], np.cumsum(np.where(absorbed, query_lens, 0))]).astype(np.int32)
    cp_plan = _context_parallel_plan(_Pieces(*(t.to(device) for t in pieces)), to_device(local.astype(np.int32)),
                                     to_device(absorbed_qsl), to_device(np.where(absorbed, local, 0).astype(np.int32)),
                                     int(absorbed_qsl[-1]), part_rows, args)
    return PrefillPlan(
        query_start_loc=query_start_loc.to(device), context_lens=context_lens.to(device), block_table=block_table,
        absorbed_context_lens=to_device(np.where(absorbed, ctx, 0).astype(np.int32)),
        schedule=schedule.to(device), device_schedule=None, truncated=None, block_size=block_size,
        workspace_size=args.workspace_size,
        absorbed_query_bound=int(query_lens[absorbed].max()) if absorbed.any() else 0,
        num_tokens=int(qsl[-1]), max_block_id=max_block_id, context_parallel=cp_plan, options=options,
    )


def _host_schedule(ctx: np.ndarray, query_lens: np.ndarray, policy: str, args: _Stripes):
    """Routing and the stripe schedule on the host: ``(absorbed [B], gathered_ctx [B], stripe_starts
    [K, B], stripe_lens [K, B], schedule)``, the chunks spread over the whole batch."""
    absorbed = args.absorbed(ctx, query_lens, args.capacity)
    gathered_ctx = np.where(absorbed, 0, ctx)
    schedule = plan_context_chunks(args.stripes(gathered_ctx), query_lens, args.stripes_per_chunk, policy=policy,
                                   split_alignment=args.stripe_alignment)
    stripe_starts, stripe_lens = schedule.dense(ctx.size)
    return absorbed, gathered_ctx, stripe_starts, stripe_lens, schedule


def _device_plan(query_start_loc, context_lens, block_table, options: PlanOptions, args: _Stripes) -> PrefillPlan:
    check_on_plan_device(query_start_loc, context_lens, block_table)
    block_size, max_chunks = options.block_size, options.max_chunks
    local = local_context_lens(context_lens, args.rank, args.world_size, args.interleave)
    num_tokens, max_block_id = None, -1
    if _checks.values_readable(query_start_loc, context_lens, block_table):
        qsl = query_start_loc.numpy()
        max_block_id = _checks.check_lengths(qsl, local.numpy(), block_table.numpy(), block_size)
        num_tokens = int(qsl[-1])
    elif _checks.debug_enabled():
        _checks.assert_lengths_async(query_start_loc, local, block_table, block_size)
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    capacity = args.capacity  # static: A token slots
    absorbed = args.absorbed(context_lens, query_lens, capacity)
    gathered_ctx = torch.where(absorbed, 0, context_lens)
    stripes = args.stripes(gathered_ctx)
    schedule = plan_context_chunks_device(stripes, args.stripes_per_chunk, max_chunks)
    if _checks.debug_enabled():
        torch._assert_async(~schedule.overflow, "mla_ops debug: the batch needs more chunks than max_chunks")
    absorbed_qsl = F.pad(torch.cumsum(torch.where(absorbed, query_lens, 0), 0), (1, 0)).int()
    pieces = _chunk_pieces(schedule.starts, schedule.seq_lens, gathered_ctx, args)
    cp_plan = _context_parallel_plan(pieces, local, absorbed_qsl, torch.where(absorbed, local, 0), capacity,
                                     args.part_rows, args)
    return PrefillPlan(
        query_start_loc=query_start_loc, context_lens=context_lens, block_table=block_table,
        absorbed_context_lens=torch.where(absorbed, context_lens, 0) if capacity else torch.zeros_like(context_lens),
        schedule=None, device_schedule=schedule,
        truncated=(torch.cumsum(stripes, 0) > max_chunks * args.stripes_per_chunk) & (stripes > 0),
        block_size=block_size, workspace_size=args.workspace_size, absorbed_query_bound=capacity,
        num_tokens=num_tokens, max_block_id=max_block_id, context_parallel=cp_plan, options=options,
    )


class _Pieces(NamedTuple):
    """Every rank's piece of every chunk, [K, B] stripe pieces turned into rows (tensors, int64)."""

    starts: torch.Tensor  # [K, B] global context offset of each piece
    cu_seq_lens: torch.Tensor  # [K, B+1] offsets in the request-ordered workspace
    local_starts: torch.Tensor  # [K, B] first local position, the same on every rank (whole stripes)
    local_cu_seq_lens: torch.Tensor  # [D, K, B+1] offsets in each rank's part


def _chunk_pieces(stripe_starts, stripe_lens, gathered_ctx, args: _Stripes) -> _Pieces:
    d, i = args.world_size, args.interleave
    s0, n, c = stripe_starts.long(), stripe_lens.long(), gathered_ctx.long()
    live = n > 0
    starts = torch.where(live, s0 * (i * d), 0)
    rows = torch.where(live, torch.minimum((s0 + n) * (i * d), c) - starts, 0)
    every_rank = torch.arange(d, device=c.device).view(d, 1, 1)
    local_starts = torch.where(live, s0 * i, 0)
    local_rows = (torch.minimum((s0 + n) * i, local_context_lens(c, every_rank, d, i)) - local_starts).clamp(min=0)
    local_rows = torch.where(live, local_rows, 0)  # [D, K, B]
    return _Pieces(starts, F.pad(rows.cumsum(-1), (1, 0)), local_starts, F.pad(local_rows.cumsum(-1), (1, 0)))


def _context_parallel_plan(pieces: _Pieces, local, absorbed_qsl, absorbed_local, num_absorbed_tokens: int,
                           part_rows: int | tuple[int, ...], args: _Stripes) -> ContextParallelPlan:
    """This rank's plan: its pieces and the reorder index of the all-gathered parts (tensor code).

    ``part_rows``: the rows of every chunk's parts (device form), or of each chunk's (host form).
    """
    d, i = args.world_size, args.interleave
    num_chunks, batch = pieces.starts.shape
    cu, lcu = pieces.cu_seq_lens, pieces.local_cu_seq_lens
    chunk_rows = part_rows if isinstance(part_rows, tuple) else None
    widest = max(part_rows, default=1) if chunk_rows is not None else part_rows
    per_chunk = torch.tensor(chunk_rows, device=cu.device).view(-1, 1) if chunk_rows is not None else part_rows
    # Request-ordered row w of chunk k is row t of request `req`'s piece: global position starts + t, held
    # by rank (t // I) % D at local offset (t // (I*D)) * I + t % I from the piece's local start.
    rows = torch.arange(d * widest, device=cu.device).expand(num_chunks, -1).contiguous()  # [K, W]
    req = (torch.searchsorted(cu, rows, right=True) - 1).clamp(0, batch)  # B: rows past the chunk's count
    t = rows - cu.gather(1, req)
    owner = (t // i) % d
    chunk = torch.arange(num_chunks, device=cu.device).view(-1, 1).expand_as(rows)
    reorder = owner * per_chunk + lcu[owner, chunk, req] + (t // (i * d)) * i + t % i
    reorder = torch.where(rows < cu[:, -1:], reorder, 0).int()
    mine = lcu[args.rank]
    return ContextParallelPlan(
        local_context_lens=local.int(),
        local_starts=torch.where(mine[:, 1:] > mine[:, :-1], pieces.local_starts, 0).int(),
        local_cu_seq_lens=mine.int(), starts=pieces.starts.int(), cu_seq_lens=cu.int(), reorder=reorder,
        absorbed_query_start_loc=absorbed_qsl.int(), absorbed_local_lens=absorbed_local.int(), config=args.config,
        rank=args.rank, world_size=d, part_rows=widest, chunk_part_rows=chunk_rows,
        num_absorbed_tokens=num_absorbed_tokens,
    )


# ---- agreement check -----------------------------------------------------------------------------

_FINGERPRINT = ("requests", "interleave", "workspace_size", "max_chunks", "absorb_max_query_len", "chunks",
                "absorbed_tokens", "tokens", "query_start_loc checksum", "context_lens checksum")


def _check_ranks_agree(plan: PrefillPlan, max_chunks: int | None, args: _Stripes) -> None:
    """All-gather a checksum of this rank's plan; raise naming the rank(s) that differ (module doc)."""
    cp_plan = plan.context_parallel
    qsl, ctx = plan.query_start_loc.long(), plan.context_lens.long()
    weights = (torch.arange(qsl.shape[0], device=qsl.device) * 40503 + 12345) % 65521 + 1  # position-sensitive
    static = [args.interleave, args.workspace_size, -1 if max_chunks is None else max_chunks,
              -1 if args.threshold is None else args.threshold, cp_plan.num_chunks, cp_plan.num_absorbed_tokens]
    mine = torch.cat([torch.full((1,), ctx.shape[0], dtype=torch.long, device=qsl.device),
                      torch.tensor(static, dtype=torch.long, device=qsl.device),
                      torch.stack([qsl[-1], (qsl * weights).sum(), (ctx * weights[:-1]).sum()])])
    every = collectives.wait(collectives.all_gather(mine, args.config.process_group)).view(args.world_size, -1)
    if max_chunks is not None and not _checks.values_readable(every):
        for r in range(args.world_size):  # device-side: no host read
            torch._assert_async((every[r] == every[0]).all(),
                                f"mla_ops context parallel: rank {r} disagrees with rank 0 on the step's lengths "
                                "or planning arguments")
        return
    rows = [tuple(row) for row in every.tolist()]
    reference = collections.Counter(rows).most_common(1)[0][0]  # ties: rank 0's
    ref_rank = rows.index(reference)
    odd = [r for r, row in enumerate(rows) if row != reference]
    if odd:
        fields = ", ".join(f"{name} {rows[odd[0]][f]} vs {reference[f]}"
                           for f, name in enumerate(_FINGERPRINT) if rows[odd[0]][f] != reference[f])
        raise ValueError(
            f"context parallel ranks disagree on the step: rank{'s' if len(odd) > 1 else ''} "
            f"{', '.join(map(str, odd))} differ{'' if len(odd) > 1 else 's'} from rank {ref_rank} "
            f"(rank {odd[0]}: {fields}); every rank must pass the same query_start_loc, context_lens and "
            f"planning arguments (this is rank {args.rank})"
        )
