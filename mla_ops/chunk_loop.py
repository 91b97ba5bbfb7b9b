"""The context partial of a step, chunk by chunk, and its merge with the suffix partial.

``LayerCall`` is what one layer's call (``PrefillStep.attend``) hands the loops: the selected kernels, the
dims, the layer's tensors and the step's plan. Three ways through the context, one per plan form:

* ``host_context``: the host schedule's chunks, each over its own requests and token range only;
* ``device_context``: K static chunk steps over the device schedule (no host read of a device
  value); chunks past the device count touch nothing;
* context parallel (``mla_ops.parallel.run``) reuses ``attend_chunks`` with rows fetched across
  ranks, and ``mark_truncated``.

Per chunk: the chunk's latent rows (gathered from the paged cache) are up-projected to per-head
keys and values and attended by the chunk's queries, folding into the running context partial.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ._mla import MLADims, lse_dtype
from .ops.backends import Kernels
from .planning.plan import PrefillPlan


class LayerCall(NamedTuple):
    """One layer's call: kernels, dims, the layer's tensors and scale, and the step's plan."""

    kernels: Kernels
    dims: MLADims
    q: torch.Tensor
    kv_cache: torch.Tensor
    weight: torch.Tensor
    softmax_scale: float
    k_scale: torch.Tensor | None
    plan: PrefillPlan
    truncated_tokens: torch.Tensor | None  # [T] bool (``truncated_tokens``); None: no token can be
    suffix_tokens: torch.Tensor | None = None  # [T'] (``suffix_tokens``); None: every token

    def suffix(self, kv_c: torch.Tensor, k_pe: torch.Tensor):
        """The suffix partial ``(out [T, N, V], lse [N, T])``: every token over its own request's new
        keys, causally. In a DSA step only the dense-routed requests' tokens (``suffix_tokens``): the sparse
        attention attends a sparse request's own new keys itself and overwrites its rows, which get the
        empty partial here."""
        q, dims = self.q, self.dims
        if self.suffix_tokens is None:
            k_nope, v = dims.split_kv(torch.mm(kv_c, self.weight.t()))
            out = q.new_empty(q.shape[0], dims.num_heads, dims.value)
            lse = q.new_empty(dims.num_heads, q.shape[0], dtype=lse_dtype(q.dtype))
            self.kernels.suffix_attention(q, k_nope, k_pe, v, self.plan.query_start_loc, self.softmax_scale, out,
                                          lse, *self.window())
            return out, lse
        tokens = self.suffix_tokens
        rows = tokens.shape[0]
        k_nope, v = dims.split_kv(torch.mm(kv_c.index_select(0, tokens), self.weight.t()))
        # Empty partials first: the device form's slots past the dense tokens are padding the kernel skips.
        part_out = q.new_zeros(rows, dims.num_heads, dims.value)
        part_lse = q.new_full((dims.num_heads, rows), float("-inf"), dtype=lse_dtype(q.dtype))
        self.kernels.suffix_attention(q.index_select(0, tokens), k_nope, k_pe.index_select(0, tokens), v,
                                      self.plan.suffix_query_start_loc, self.softmax_scale, part_out, part_lse,
                                      *self.window())
        out = q.new_zeros(q.shape[0], dims.num_heads, dims.value).index_copy_(0, tokens, part_out)
        lse = q.new_full((dims.num_heads, q.shape[0]), float("-inf"), dtype=part_lse.dtype)
        return out, lse.index_copy_(1, tokens, part_lse)

    def absorbed(self, context_out, context_lse) -> None:
        """The absorbed requests' context partials, written into their rows only; the kernels pack
        the routed tokens into ``plan.absorbed_rows`` rows of scratch."""
        p = self.plan
        self.kernels.absorbed_context_attention(
            self.q, self.kv_cache, p.block_table, p.query_start_loc, p.absorbed_context_lens, self.weight,
            self.softmax_scale, self.k_scale, context_out, context_lse, p.absorbed_rows, p.absorbed_token_loc,
            *self.window(),
        )

    def window(self) -> tuple:
        """The attention ops' trailing ``sliding_window`` argument where the plan has a window (DESIGN §11);
        none otherwise, so a step without one calls (and traces) the ops as before."""
        return (self.plan.sliding_window,) if self.plan.sliding_window else ()

    def context_window(self, context_lens: torch.Tensor) -> tuple:
        """``context_attention``'s trailing ``(context_lens, sliding_window)`` where the plan has a window:
        the chunk's requests' context lengths place its rows and queries."""
        return (context_lens, self.plan.sliding_window) if self.plan.sliding_window else ()


def empty_partial(out: torch.Tensor, lse: torch.Tensor):
    """The merge's identity shaped like ``(out, lse)``: ``0 / -inf``."""
    return torch.zeros_like(out), torch.full_like(lse, float("-inf"))


def attend_chunks(call: LayerCall, num_chunks: int, chunk_rows: Callable[..., torch.Tensor], cu_seq_lens: torch.Tensor,
                  starts: torch.Tensor, kv: torch.Tensor, context_out: torch.Tensor, context_lse: torch.Tensor) -> None:
    """For each chunk k: its workspace rows ``chunk_rows(k, cu_seq_lens[k], starts[k])`` ``[W, L+R]`` are
    up-projected into ``kv`` ``[W, N*(P+V)]`` and attended by every query (``cu_seq_lens`` ``[K, B+1]``
    and ``starts`` ``[K, B]``: the chunks over the whole batch)."""
    kernels, dims = call.kernels, call.dims
    chunk_k_nope, chunk_v = dims.split_kv(kv)
    for k in range(num_chunks):
        cu_k, starts_k = cu_seq_lens.select(0, k), starts.select(0, k)
        latent, rope = chunk_rows(k, cu_k, starts_k).split([dims.latent, dims.rope], dim=1)
        kernels.up_project(latent, call.weight, cu_k, kv)
        kernels.context_attention(call.q, chunk_k_nope, rope, chunk_v, call.plan.query_start_loc, cu_k, starts_k,
                                  call.softmax_scale, context_out, context_lse,
                                  *call.context_window(call.plan.context_lens))


def suffix_tokens(plan: PrefillPlan, num_tokens: int) -> torch.Tensor | None:
    """[T'] int64: the tokens of a DSA step's suffix attention, in its order (``plan.suffix_query_start_loc``):
    the dense-routed requests' tokens, then (device form, T' = T) the others, which it skips as padding.
    None: every token, in order. Depends only on the step: made once (``begin_step``)."""
    if plan.suffix_query_start_loc is None:
        return None
    token = torch.arange(num_tokens, device=plan.device)
    request = (torch.searchsorted(plan.query_start_loc, token.to(plan.query_start_loc.dtype), right=True) - 1)
    request = request.clamp(0, max(plan.num_requests - 1, 0))
    dense = ~plan.sparse.index_select(0, request) & (token < plan.query_start_loc[-1])
    rank = torch.cumsum(dense, 0) - 1  # dense tokens first, in order; then the others, in order
    rank = torch.where(dense, rank, dense.sum() + torch.cumsum(~dense, 0) - 1)
    order = torch.empty_like(token).scatter_(0, rank, token)
    return order if plan.suffix_rows < 0 else order.narrow(0, 0, plan.suffix_rows)


def truncated_tokens(plan: PrefillPlan, num_tokens: int) -> torch.Tensor | None:
    """[T] bool: the tokens of requests whose chunked context runs past the device plan's capacity
    (None where no request can be); it depends only on the step, so a model computes it once."""
    if plan.truncated is None:
        return None
    token = torch.arange(num_tokens, device=plan.device, dtype=plan.query_start_loc.dtype)
    request = torch.searchsorted(plan.query_start_loc, token, right=True) - 1  # [T]
    return plan.truncated.index_select(0, request.clamp(0, max(plan.num_requests - 1, 0)))


def mark_truncated(out: torch.Tensor, lse: torch.Tensor, truncated: torch.Tensor | None):
    """Requests whose chunked context runs past the device plan's capacity were not fully attended:
    their tokens (``truncated_tokens``) become NaN in ``out`` [T, N, V] and ``lse`` [N, T], never
    silently wrong."""
    if truncated is None:
        return out, lse
    nan = float("nan")
    return (torch.where(truncated.view(-1, 1, 1), torch.full_like(out, nan), out),
            torch.where(truncated.view(1, -1), torch.full_like(lse, nan), lse))


def device_context(call: LayerCall, suffix_out: torch.Tensor, suffix_lse: torch.Tensor):
    """K static chunk steps over the device plan, merged with the suffix: ``(out, lse)``; no host read of
    a device value."""
    dims, q, plan = call.dims, call.q, call.plan
    context_out, context_lse = empty_partial(suffix_out, suffix_lse)
    if plan.has_absorbed_path:  # first: its scratch is freed before the chunk buffers exist
        call.absorbed(context_out, context_lse)
    schedule = plan.device_schedule
    workspace = q.new_empty(plan.workspace_size, dims.latent + dims.rope)
    kv = q.new_empty(plan.workspace_size, call.weight.shape[0])

    def gathered(k: int, cu_seq_lens: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        call.kernels.gather_context(call.kv_cache, plan.block_table, cu_seq_lens, starts, call.k_scale, workspace)
        return workspace

    attend_chunks(call, schedule.max_chunks, gathered, schedule.cu_seq_lens, schedule.starts, kv, context_out,
                  context_lse)
    out, lse = call.kernels.merge_attn_states(context_out, context_lse, suffix_out, suffix_lse)
    return mark_truncated(out, lse, call.truncated_tokens)


def host_context(call: LayerCall, suffix_out: torch.Tensor, suffix_lse: torch.Tensor):
    """The host schedule's chunks, each over its own requests only, merged with the suffix: ``(out, lse)``."""
    kernels, dims, q, plan = call.kernels, call.dims, call.q, call.plan
    schedule, num_tokens = plan.schedule, q.shape[0]
    if plan.has_absorbed_path:  # any token may get an absorbed partial
        covered = num_tokens
        context_out, context_lse = empty_partial(suffix_out, suffix_lse)
        call.absorbed(context_out, context_lse)
    elif schedule.num_chunks == 0:
        return suffix_out, suffix_lse
    else:  # the context partial of every token up to the last request with context
        covered = schedule.prefill_tokens_with_context
        context_out = suffix_out.new_empty(covered, *suffix_out.shape[1:])
        context_lse = suffix_lse.new_empty(suffix_lse.shape[0], covered)
        for start, end in schedule.empty_token_ranges:
            if start < covered:
                context_out[start:end].zero_()
                context_lse[:, start:end].fill_(float("-inf"))

    if schedule.num_chunks:
        workspace = q.new_empty(max(c.num_context_tokens for c in schedule.chunks), dims.latent + dims.rope)
    for chunk in schedule.chunks:
        rows = workspace.narrow(0, 0, chunk.num_context_tokens)
        kernels.gather_context(call.kv_cache, plan.block_table.narrow(0, chunk.request_start, chunk.num_requests),
                               chunk.cu_seq_lens, chunk.starts, call.k_scale, rows)
        latent, rope = rows.split([dims.latent, dims.rope], dim=1)
        chunk_k_nope, chunk_v = dims.split_kv(torch.mm(latent, call.weight.t()))  # the host knows the live rows
        tokens = chunk.token_end - chunk.token_start
        kernels.context_attention(
            q.narrow(0, chunk.token_start, tokens), chunk_k_nope, rope, chunk_v, chunk.query_start_loc,
            chunk.cu_seq_lens, chunk.starts, call.softmax_scale,
            context_out.narrow(0, chunk.token_start, tokens), context_lse.narrow(1, chunk.token_start, tokens),
            *call.context_window(plan.context_lens.narrow(0, chunk.request_start, chunk.num_requests)),
        )

    merged, merged_lse = kernels.merge_attn_states(
        context_out, context_lse, suffix_out.narrow(0, 0, covered), suffix_lse.narrow(1, 0, covered)
    )
    if covered == num_tokens:
        return merged, merged_lse
    rest = num_tokens - covered  # tokens after the last request with context: the suffix alone
    return (torch.cat([merged, suffix_out.narrow(0, covered, rest)]),
            torch.cat([merged_lse, suffix_lse.narrow(1, covered, rest)], dim=1))
