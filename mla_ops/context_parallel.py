"""Context parallel prefill over D ranks (DESIGN §10): the latent cache sharded by token.

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
  heads' queries (``absorbed.fold_queries``: ``q_nope @ W_UK``, with ``q_pe``: width L+R); these are
  all-gathered, so every rank holds every head's queries; each rank attends over its own shard
  only (``latent_context_attention``, one KV head in the latent space); an all-to-all sends the
  latent partials with their LSEs (float32, one extra column) back to each head's owner, who
  merges the D partials (``merge_attn_states``) and applies ``W_UV`` (``absorbed.unfold_outputs``).

Both are exact: the per-rank partials are the single-device partials of disjoint key sets. The
context partial then merges with the local suffix partial as on one device.

Routing (``plan_prefill(absorb_max_query_len=...)``): None asks ``CostModel`` per request (bytes
each rank receives, turned into FLOPs at the machine balance ``flops_per_byte``, plus FLOPs);
an int routes requests with at most that many new tokens to the absorbed-queries path; 0 turns
that path off. The device form (``max_chunks=K``) needs a static size for the gathered queries:
``ContextParallel(max_absorbed_tokens=A)`` (requests past it take the all-gather path; with None
the device form has no absorbed-queries path). In the host form A, when given, caps it likewise.

Collectives: ``torch.distributed``'s functional collectives (``all_gather_single``,
``all_to_all_single``) on the group's backend (NCCL on GPU, gloo on CPU), eager and under
``torch.compile``, where they become graph nodes (device plan: no host read). Ranks that plan
different steps would hang or mix silently; ``ContextParallel(check=True)`` (or
``mla_ops.set_debug(True)``) all-gathers a checksum of the lengths and planning arguments at plan
time and raises a ValueError naming the rank that disagrees (device-side asserts under compile).
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from . import validation as V
from .absorbed import fold_queries, split_kv_b_proj, token_requests, unfold_outputs
from .device_schedule import plan_context_chunks_device
from .latent_attention import latent_kernel
from .merge import lse_dtype
from .plan import PrefillPlan, _register_pytree
from .schedule import plan_context_chunks


@dataclass(frozen=True)
class CostModel:
    """Per-request cost of each context path, per rank and layer, in bytes received and FLOPs.

    c context rows, q new tokens, D ranks, H = num_heads / D heads per rank:

    * all-gather: bytes ``c (D-1)/D (L+R) a`` (the other ranks' rows, in the activation dtype the
      workspace holds); FLOPs ``H c (2L(P+V) + q 2(P+R+V))`` (up-projection and attention).
    * absorbed queries: bytes ``q H (D-1) ((L+R) a + (L+1) p)`` (the other ranks' folded queries,
      then their latent partials and LSEs); FLOPs ``H q (2PL + 2LV + c 2(2L+R))`` (fold, attention
      of D*H heads over c/D local rows, unfold).

    A request takes the absorbed-queries path when ``bytes * flops_per_byte + FLOPs`` is smaller
    there. Defaults: DeepSeek-V3 (128 heads, L=512, P=128, R=64, V=128), bf16 activations, float32
    partials, and an H200's balance of dense bf16 FLOP/s over NVLink bytes/s per direction
    (989e12 / 450e9 ~ 2,200). None of it is measured on a multi-GPU machine yet.
    """

    num_heads: int = 128
    latent: int = 512
    nope: int = 128
    rope: int = 64
    value: int = 128
    activation_bytes: int = 2
    partial_bytes: int = 4
    flops_per_byte: float = 2200.0

    def path_costs(self, context_lens, query_lens, world_size: int) -> dict:
        """``{all_gather,absorbed}_{bytes,flops}`` per request (float64 arrays or tensors)."""
        c, q = _as_float64(context_lens), _as_float64(query_lens)
        d, heads = world_size, self.num_heads / world_size
        lat, nope, rope, value = self.latent, self.nope, self.rope, self.value
        return {
            "all_gather_bytes": c * ((d - 1) / d * (lat + rope) * self.activation_bytes),
            "all_gather_flops": heads * c * (2 * lat * (nope + value) + q * (2 * (nope + rope + value))),
            "absorbed_bytes": q * (heads * (d - 1) * ((lat + rope) * self.activation_bytes
                                                     + (lat + 1) * self.partial_bytes)),
            "absorbed_flops": heads * q * (2 * nope * lat + 2 * lat * value + c * (2 * (2 * lat + rope))),
        }

    def prefers_absorbed(self, context_lens, query_lens, world_size: int):
        """Bool per request: the absorbed-queries path costs less (class doc)."""
        k = self.path_costs(context_lens, query_lens, world_size)
        absorbed = k["absorbed_bytes"] * self.flops_per_byte + k["absorbed_flops"]
        return absorbed < k["all_gather_bytes"] * self.flops_per_byte + k["all_gather_flops"]


def _as_float64(x):
    return x.double() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)


@dataclass(frozen=True)
class ContextParallel:
    """How a step is spread over a process group (module doc); pass to ``plan_prefill``.

    group: the ``torch.distributed`` process group of the D ranks (None: the default group).
    interleave: I, consecutive context tokens per rank (vLLM's ``cp_kv_cache_interleave_size``).
    cost_model: per-request choice of path when ``absorb_max_query_len`` is None.
    max_absorbed_tokens: the most new tokens whose queries one step all-gathers (a static size;
      the device form needs it for the absorbed-queries path, module doc).
    check: all-gather a checksum of every rank's plan and raise on disagreement; None follows
      ``mla_ops.set_debug``.
    """

    group: Any = None
    interleave: int = 1
    _: dataclasses.KW_ONLY
    cost_model: CostModel = CostModel()
    max_absorbed_tokens: int | None = None
    check: bool | None = None

    def __post_init__(self):
        V.check_positive_int(self.interleave, "interleave")
        if self.max_absorbed_tokens is not None:
            V.check_nonnegative_int(self.max_absorbed_tokens, "max_absorbed_tokens")
        if not isinstance(self.cost_model, CostModel):
            raise TypeError("cost_model must be a mla_ops.context_parallel.CostModel, got "
                            f"{type(self.cost_model).__name__}")
        if self.check is not None and not isinstance(self.check, bool):
            raise TypeError(f"check must be True, False or None, got {type(self.check).__name__}")

    @property
    def world_size(self) -> int:
        self._require_group()
        return torch.distributed.get_world_size(self.group)

    @property
    def rank(self) -> int:
        self._require_group()
        return torch.distributed.get_rank(self.group)

    @property
    def process_group(self):
        return torch.distributed.group.WORLD if self.group is None else self.group

    def _require_group(self) -> None:
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            raise ValueError("context_parallel needs an initialized torch.distributed process group "
                             "(torch.distributed.init_process_group, e.g. under torchrun)")


# ---- layout --------------------------------------------------------------------------------------


def local_context_lens(context_lens, rank, world_size: int, interleave: int = 1):
    """Context rows of each request held by ``rank``: ``(c // (I*D)) * I + clamp(c % (I*D) - rank*I, 0, I)``.

    Tensors (``rank`` may be a tensor that broadcasts) or numpy arrays.
    """
    stripe = interleave * world_size
    rest = context_lens % stripe - rank * interleave
    rest = rest.clamp(0, interleave) if isinstance(rest, torch.Tensor) else np.clip(rest, 0, interleave)
    return (context_lens // stripe) * interleave + rest


def shard_context(kv_cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor, *, rank: int,
                  world_size: int, interleave: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard of a single-device paged cache: ``(local_cache, local_block_table)``.

    kv_cache [num_blocks, block_size, L+R], block_table [B, max_blocks] int32, context_lens [B] int32
    (host-readable) -> local_cache [n, block_size, L+R] (same dtype; the rank's rows, request after
    request, in fresh blocks) and local_block_table [B, m] int32: context token p of request r
    (with ``(p // I) % D == rank``) sits at local position ``(p // (I*D)) * I + p % I``.
    """
    V.check_tensor(kv_cache, "kv_cache", 3, "[num_blocks, block_size, L+R]")
    V.check_int32(block_table, "block_table", 2, "[B, max_blocks]")
    V.check_int32(context_lens, "context_lens", 1, "[B]")
    world_size = V.check_positive_int(world_size, "world_size")
    interleave = V.check_positive_int(interleave, "interleave")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
    ctx = context_lens.cpu().numpy().astype(np.int64)
    block_size = kv_cache.shape[1]
    if block_table.shape[0] < ctx.size:
        raise ValueError(f"block_table must have a row per request (B={ctx.size}), got {block_table.shape[0]} rows")
    V.check_lengths(np.zeros(1, np.int64), ctx, block_table.cpu().numpy(), block_size)  # the table fits
    local = local_context_lens(ctx, rank, world_size, interleave)
    blocks = -(-local // block_size)
    first_block = np.concatenate([[0], np.cumsum(blocks)])
    stored = kv_cache.view(torch.uint8) if kv_cache.dtype == torch.float8_e4m3fn else kv_cache  # bytes copy
    local_cache = stored.new_zeros(max(int(first_block[-1]), 1), block_size, kv_cache.shape[2])
    local_table = torch.zeros(ctx.size, max(int(blocks.max(initial=0)), 1), dtype=torch.int32)
    stripe, table, device = interleave * world_size, block_table.cpu().long(), kv_cache.device
    for r in range(ctx.size):
        if local[r] == 0:
            continue
        j = torch.arange(int(local[r]))
        p = (j // interleave) * stripe + rank * interleave + j % interleave  # global positions, local order
        ids = torch.arange(int(first_block[r]), int(first_block[r + 1]), dtype=torch.int32)
        local_table[r, : ids.numel()] = ids
        rows = stored[table[r, p // block_size].to(device), (p % block_size).to(device)]
        local_cache[ids.long()[j // block_size].to(device), (j % block_size).to(device)] = rows
    if kv_cache.dtype == torch.float8_e4m3fn:
        local_cache = local_cache.view(torch.float8_e4m3fn)
    return local_cache, local_table.to(block_table.device)


# ---- the plan ------------------------------------------------------------------------------------


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
_register_pytree(ContextParallelPlan, ("config", "rank", "world_size", "part_rows", "chunk_part_rows",
                                       "num_absorbed_tokens"))


def plan_context_parallel(query_start_loc, context_lens, block_table, block_size, workspace_size, policy,
                          split_alignment, max_chunks, absorb_max_query_len, cp) -> PrefillPlan:
    """``plan_prefill(..., context_parallel=cp)`` after its shape and argument checks (module doc)."""
    if not isinstance(cp, ContextParallel):
        raise TypeError(f"context_parallel must be a mla_ops.ContextParallel, got {type(cp).__name__}")
    world_size, rank, interleave = cp.world_size, cp.rank, cp.interleave
    stripe = interleave * world_size
    if workspace_size < stripe:
        raise ValueError(f"workspace_size must hold at least one stripe of interleave * world_size = {stripe} "
                         f"rows under context parallel, got {workspace_size}")
    if split_alignment != 1 and split_alignment % stripe:
        raise ValueError(f"split_alignment must be 1 or a multiple of interleave * world_size = {stripe} under "
                         f"context parallel (chunks split requests at whole stripes), got {split_alignment}")
    if absorb_max_query_len is not None:
        V.check_nonnegative_int(absorb_max_query_len, "absorb_max_query_len", " (0 disables)")
    args = _Args(rank, world_size, interleave, workspace_size, workspace_size // stripe,
                 max(1, split_alignment // stripe), absorb_max_query_len, cp)
    if max_chunks is not None:
        max_chunks = V.check_positive_int(max_chunks, "max_chunks")
        if policy != "packed" or split_alignment != 1:
            raise ValueError("max_chunks plans the packed schedule (split_alignment=1) on the device: it cannot be "
                             f"combined with policy={policy!r} or split_alignment={split_alignment}")
        plan = _device_plan(query_start_loc, context_lens, block_table, block_size, max_chunks, args)
    else:
        if torch.compiler.is_compiling():
            raise ValueError("plan_prefill under torch.compile needs max_chunks=K (a static capacity): the host "
                             "planner reads the lengths' values")
        plan = _host_plan(query_start_loc, context_lens, block_table, block_size, policy, args)
    if cp.check if cp.check is not None else V.debug_enabled():
        _check_ranks_agree(plan, max_chunks, args)
    return plan


@dataclass(frozen=True)
class _Args:
    rank: int
    world_size: int
    interleave: int
    workspace_size: int
    stripes_per_chunk: int
    stripe_alignment: int
    threshold: int | None  # absorb_max_query_len; None: the cost model
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


def _host_plan(query_start_loc, context_lens, block_table, block_size, policy, args: _Args) -> PrefillPlan:
    device = block_table.device
    qsl, ctx = query_start_loc.cpu().numpy(), context_lens.cpu().numpy()  # a sync for GPU lengths
    local = local_context_lens(ctx, args.rank, args.world_size, args.interleave)
    readable = device.type == "cpu"
    table = block_table.numpy() if readable else np.zeros((ctx.size, block_table.shape[1]), np.int32)
    max_block_id = V.check_lengths(qsl, local, table, block_size) if readable else -1
    if not readable:  # the lengths are checked all the same, against a table of the right width
        V.check_lengths(qsl, local, table, block_size)
    query_lens = np.diff(qsl)
    absorbed, gathered_ctx, stripe_starts, stripe_lens, schedule = _host_schedule(ctx, query_lens, policy, args)
    host = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    to_device = lambda a: host(a).to(device)  # noqa: E731
    # The pieces are planned on the host, where each chunk's parts can shrink to the largest share a
    # rank has of it (the device form's parts have the static size of a full chunk).
    pieces = _chunk_pieces(host(stripe_starts), host(stripe_lens), host(gathered_ctx), args)
    part_rows = tuple(max(int(x), 1) for x in pieces.local_cu_seq_lens[..., -1].amax(0))
    absorbed_qsl = np.concatenate([[0], np.cumsum(np.where(absorbed, query_lens, 0))]).astype(np.int32)
    cpp = _context_parallel_plan(_Pieces(*(t.to(device) for t in pieces)), to_device(local.astype(np.int32)),
                                 to_device(absorbed_qsl), to_device(np.where(absorbed, local, 0).astype(np.int32)),
                                 int(absorbed_qsl[-1]), part_rows, args)
    return PrefillPlan(
        query_start_loc=query_start_loc.to(device), context_lens=context_lens.to(device), block_table=block_table,
        absorbed_context_lens=to_device(np.where(absorbed, ctx, 0).astype(np.int32)) if absorbed.any() else None,
        schedule=schedule.to(device), device_schedule=None, truncated=None, block_size=block_size,
        workspace_size=args.workspace_size,
        absorb_max_query_len=int(query_lens[absorbed].max()) if absorbed.any() else 0,
        num_tokens=int(qsl[-1]), max_block_id=max_block_id, context_parallel=cpp,
    )


def _host_schedule(ctx: np.ndarray, query_lens: np.ndarray, policy: str, args: _Args):
    """Routing and the stripe schedule on the host: ``(absorbed [B], gathered_ctx [B], stripe_starts
    [K, B], stripe_lens [K, B], schedule)``, the chunks spread over the whole batch."""
    absorbed = args.absorbed(ctx, query_lens, args.config.max_absorbed_tokens)
    gathered_ctx = np.where(absorbed, 0, ctx)
    schedule = plan_context_chunks(args.stripes(gathered_ctx), query_lens, args.stripes_per_chunk, policy=policy,
                                   split_alignment=args.stripe_alignment)
    stripe_starts = np.zeros((schedule.num_chunks, ctx.size), np.int64)
    stripe_lens = np.zeros_like(stripe_starts)
    for k, chunk in enumerate(schedule.chunks):
        stripe_starts[k, chunk.request_start : chunk.request_end] = chunk.starts.numpy()
        stripe_lens[k, chunk.request_start : chunk.request_end] = chunk.seq_lens.numpy()
    return absorbed, gathered_ctx, stripe_starts, stripe_lens, schedule


def _device_plan(query_start_loc, context_lens, block_table, block_size, max_chunks, args: _Args) -> PrefillPlan:
    for name, x in (("query_start_loc", query_start_loc), ("context_lens", context_lens)):
        if x.device != block_table.device:
            raise ValueError(f"{name} must be on {block_table.device} (the device of block_table) for a device plan "
                             f"(max_chunks), got {x.device}")
    local = local_context_lens(context_lens, args.rank, args.world_size, args.interleave)
    num_tokens, max_block_id = None, -1
    if V.values_readable(query_start_loc, context_lens, block_table):
        qsl = query_start_loc.numpy()
        max_block_id = V.check_lengths(qsl, local.numpy(), block_table.numpy(), block_size)
        num_tokens = int(qsl[-1])
    elif V.debug_enabled():
        V.assert_lengths_async(query_start_loc, local, block_table, block_size)
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    capacity = 0 if args.threshold == 0 else args.config.max_absorbed_tokens or 0  # static: A token slots
    absorbed = args.absorbed(context_lens, query_lens, capacity)
    gathered_ctx = torch.where(absorbed, 0, context_lens)
    stripes = args.stripes(gathered_ctx)
    schedule = plan_context_chunks_device(stripes, args.stripes_per_chunk, max_chunks)
    if V.debug_enabled():
        torch._assert_async(~schedule.overflow, "mla_ops debug: the batch needs more chunks than max_chunks")
    absorbed_qsl = F.pad(torch.cumsum(torch.where(absorbed, query_lens, 0), 0), (1, 0)).int()
    pieces = _chunk_pieces(schedule.starts, schedule.seq_lens, gathered_ctx, args)
    cpp = _context_parallel_plan(pieces, local, absorbed_qsl, torch.where(absorbed, local, 0), capacity, args.part_rows,
                                 args)
    return PrefillPlan(
        query_start_loc=query_start_loc, context_lens=context_lens, block_table=block_table,
        absorbed_context_lens=torch.where(absorbed, context_lens, 0) if capacity else None,
        schedule=None, device_schedule=schedule,
        truncated=(torch.cumsum(stripes, 0) > max_chunks * args.stripes_per_chunk) & (stripes > 0),
        block_size=block_size, workspace_size=args.workspace_size, absorb_max_query_len=capacity,
        num_tokens=num_tokens, max_block_id=max_block_id, context_parallel=cpp,
    )


class _Pieces(NamedTuple):
    """Every rank's piece of every chunk, [K, B] stripe pieces turned into rows (tensors, int64)."""

    starts: torch.Tensor  # [K, B] global context offset of each piece
    cu_seq_lens: torch.Tensor  # [K, B+1] offsets in the request-ordered workspace
    local_starts: torch.Tensor  # [K, B] first local position, the same on every rank (whole stripes)
    local_cu_seq_lens: torch.Tensor  # [D, K, B+1] offsets in each rank's part


def _chunk_pieces(stripe_starts, stripe_lens, gathered_ctx, args: _Args) -> _Pieces:
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
                           part_rows: int | tuple[int, ...], args: _Args) -> ContextParallelPlan:
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


def _check_ranks_agree(plan: PrefillPlan, max_chunks: int | None, args: _Args) -> None:
    """All-gather a checksum of this rank's plan; raise naming the rank(s) that differ (module doc)."""
    cpp = plan.context_parallel
    qsl, ctx = plan.query_start_loc.long(), plan.context_lens.long()
    weights = (torch.arange(qsl.shape[0], device=qsl.device) * 40503 + 12345) % 65521 + 1  # position-sensitive
    static = [args.interleave, args.workspace_size, -1 if max_chunks is None else max_chunks,
              -1 if args.threshold is None else args.threshold, cpp.num_chunks, cpp.num_absorbed_tokens]
    mine = torch.cat([torch.full((1,), ctx.shape[0], dtype=torch.long, device=qsl.device),
                      torch.tensor(static, dtype=torch.long, device=qsl.device),
                      torch.stack([qsl[-1], (qsl * weights).sum(), (ctx * weights[:-1]).sum()])])
    every = _wait(_all_gather(mine, args.config.process_group)).view(args.world_size, -1)
    if max_chunks is not None and not V.values_readable(every):
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


# ---- collectives ---------------------------------------------------------------------------------

_funcol = None


def _collectives():
    global _funcol
    if _funcol is None:
        import torch.distributed._functional_collectives as funcol

        _funcol = funcol
    return _funcol


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """[n, ...] from every rank -> [D * n, ...], rank after rank."""
    funcol = _collectives()
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # torch 2.11: the latter
    return gather(x.contiguous(), 0, group)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """[D, ...]: block e goes to rank e; returns [D, ...], block d from rank d."""
    return _collectives().all_to_all_single(x.contiguous(), None, None, group)


def _wait(x: torch.Tensor) -> torch.Tensor:
    """The plain tensor of an eager functional collective (traced ones are plain already)."""
    return x.wait() if isinstance(x, _collectives().AsyncCollectiveTensor) else x


# ---- the run -------------------------------------------------------------------------------------


def run_context_parallel(step, suffix_out: torch.Tensor, suffix_lse: torch.Tensor) -> torch.Tensor:
    """``run_prefill``'s context partial for a context-parallel plan, merged with the suffix.

    ``step``: ``mla_ops.prefill._Step`` (kernels, dims, q, kv_cache, weight, softmax_scale, k_scale, plan).
    """
    plan, cpp = step.plan, step.plan.context_parallel
    context_out = torch.zeros_like(suffix_out)
    context_lse = torch.full_like(suffix_lse, float("-inf"))
    if cpp.num_chunks:
        _all_gather_path(step, cpp, context_out, context_lse)
    if cpp.num_absorbed_tokens:
        context_out, context_lse = _absorbed_queries_path(step, cpp, context_out, context_lse)
    out, _ = step.kernels.merge_attn_states(context_out, context_lse, suffix_out, suffix_lse)
    if plan.truncated is None:
        return out
    # Requests whose gathered context runs past chunk K were not fully attended: say so with NaN.
    request, _, _ = token_requests(plan.query_start_loc, out.shape[0])
    truncated = plan.truncated.index_select(0, request)
    return torch.where(truncated.view(-1, 1, 1), torch.full_like(out, float("nan")), out)


def _all_gather_path(step, cpp: ContextParallelPlan, context_out, context_lse) -> None:
    """Per chunk: gather local rows, all-gather the parts, reorder, up-project and attend (own heads)."""
    kernels, dims, plan, group = step.kernels, step.dims, step.plan, cpp.config.process_group
    part = step.q.new_empty(cpp.part_rows, dims.latent + dims.rope)
    kv = step.q.new_empty(cpp.world_size * cpp.part_rows, step.weight.shape[0])
    chunk_k_nope, chunk_v = dims.heads(kv)
    for k in range(cpp.num_chunks):  # device form: chunks past the device count touch nothing
        cu_seq_lens, starts = cpp.cu_seq_lens.select(0, k), cpp.starts.select(0, k)
        kernels.gather_context(step.kv_cache, plan.block_table, cpp.local_cu_seq_lens.select(0, k),
                               cpp.local_starts.select(0, k), step.k_scale, part)
        rows = cpp.part_rows if cpp.chunk_part_rows is None else cpp.chunk_part_rows[k]
        workspace = _wait(_all_gather(part.narrow(0, 0, rows), group)).index_select(0, cpp.reorder.select(0, k))
        latent, rope = workspace.split([dims.latent, dims.rope], dim=1)
        kernels.up_project(latent, step.weight, cu_seq_lens, kv)
        kernels.context_attention(step.q, chunk_k_nope, rope, chunk_v, plan.query_start_loc, cu_seq_lens, starts,
                                  step.softmax_scale, context_out, context_lse)


def _absorbed_queries_path(step, cpp: ContextParallelPlan, context_out, context_lse):
    """All-gather folded queries, attend over the local shard, all-to-all the partials, merge, unfold."""
    kernels, dims, q, plan, group = step.kernels, step.dims, step.q, step.plan, cpp.config.process_group
    d, heads, latent, slots = cpp.world_size, dims.heads_n, dims.latent, cpp.num_absorbed_tokens
    aqsl = cpp.absorbed_query_start_loc
    # Slot a of the compact batch holds token `token[a]` (slots past the absorbed tokens: token 0, no request).
    slot_request, slot_position, slot_live = token_requests(aqsl, slots)
    token = torch.where(slot_live, plan.query_start_loc.long()[slot_request] + slot_position, 0)
    q_slots = q.index_select(0, token)  # [A, H, P+R]
    w_uk, w_uv = split_kv_b_proj(step.weight, heads, dims.nope)
    q_abs = torch.cat([fold_queries(q_slots, w_uk, q.dtype).transpose(0, 1), q_slots[..., dims.nope:]], dim=-1)
    every_q = _wait(_all_gather(q_abs, group)).view(d, slots, heads, -1).transpose(0, 1).reshape(slots, d * heads, -1)

    acc = lse_dtype(q.dtype)  # partials travel in float32 (float64 for float64 q)
    o_lat = q.new_zeros(slots, d * heads, latent, dtype=acc)  # [A, D*H, L]: every rank's heads, local keys
    lse = q.new_full((d * heads, slots), float("-inf"), dtype=acc)
    latent_kernel(kernels)(every_q, step.kv_cache, plan.block_table, aqsl, cpp.absorbed_local_lens,
                           step.softmax_scale, step.k_scale, o_lat, lse)
    send = torch.cat([o_lat.view(slots, d, heads, latent).transpose(0, 1),
                      lse.view(d, heads, slots).transpose(1, 2).unsqueeze(-1)], dim=-1)  # [D, A, H, L+1]
    received = _wait(_all_to_all(send, group))  # block r: rank r's partial of this rank's heads
    merged_out, merged_lse = received[0, ..., :latent], received[0, ..., latent].t()
    for r in range(1, d):
        merged_out, merged_lse = kernels.merge_attn_states(
            merged_out.contiguous(), merged_lse.contiguous(), received[r, ..., :latent].contiguous(),
            received[r, ..., latent].t().contiguous())
    out_slots = unfold_outputs(merged_out.transpose(0, 1), w_uv).transpose(0, 1).to(context_out.dtype)  # [A, H, V]

    # Back to token order: the absorbed requests' tokens take their slot, the others keep theirs.
    request, position, valid = token_requests(plan.query_start_loc, q.shape[0])
    absorbed = valid & (aqsl[1:] - aqsl[:-1] > 0)[request]
    slot = (aqsl.long()[request] + position).clamp(0, slots - 1)
    context_out = torch.where(absorbed.view(-1, 1, 1), out_slots.index_select(0, slot), context_out)
    context_lse = torch.where(absorbed.view(1, -1), merged_lse.index_select(1, slot).to(context_lse.dtype), context_lse)
    return context_out, context_lse
