"""``run_prefill``'s context partial under context parallel: the all-gather path (the shared chunk
loop with rows fetched across ranks) and the absorbed-queries path (module doc of ``plan``)."""

from __future__ import annotations

import torch

from .._mla import fold_queries, lse_dtype, split_kv_b_proj, token_requests, unfold_outputs
from ..chunk_loop import LayerCall, attend_chunks, empty_partial, mark_truncated
from ..ops.gather import context_row_locations
from . import collectives
from .plan import ContextParallelPlan


def run_context_parallel(call: LayerCall, suffix_out: torch.Tensor, suffix_lse: torch.Tensor):
    """``run_prefill``'s context partial for a context-parallel plan, merged with the suffix: ``(out, lse)``."""
    cp_plan = call.plan.context_parallel
    context_out, context_lse = empty_partial(suffix_out, suffix_lse)
    if cp_plan.num_chunks:
        _all_gather_path(call, cp_plan, context_out, context_lse)
    if cp_plan.num_absorbed_tokens:
        context_out, context_lse = _absorbed_queries_path(call, cp_plan, context_out, context_lse)
    out, lse = call.kernels.merge_attn_states(context_out, context_lse, suffix_out, suffix_lse)
    return mark_truncated(out, lse, call.truncated_tokens)


def _all_gather_path(call: LayerCall, cp_plan: ContextParallelPlan, context_out, context_lse) -> None:
    """The chunk loop, each chunk's rows fetched from every rank: gather the local rows, all-gather
    the parts, reorder to request order; then up-project and attend (own heads).

    An fp8 cache's rows travel as stored (1 byte an element, ``local_part``) and are dequantized after
    the reorder, exactly as ``gather_context`` dequantizes them on one device (``stored * k_scale`` in
    float32, then the compute dtype). ``k_scale`` is one per-tensor scale that every rank passes to
    ``run_prefill`` with its shard of the same cache, so it does not travel."""
    dims, group = call.dims, cp_plan.config.process_group
    fp8 = call.kv_cache.dtype == torch.float8_e4m3fn
    part = None if fp8 else call.q.new_empty(cp_plan.part_rows, dims.latent + dims.rope)
    kv = call.q.new_empty(cp_plan.world_size * cp_plan.part_rows, call.weight.shape[0])

    def fetched(k: int, cu_seq_lens: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        every_part = collectives.wait(collectives.all_gather(local_part(call, cp_plan, k, part), group))
        rows = every_part.index_select(0, cp_plan.reorder.select(0, k))
        if fp8:
            rows = (rows.view(torch.float8_e4m3fn).float() * call.k_scale.float()).to(call.q.dtype)
        return rows

    attend_chunks(call, cp_plan.num_chunks, fetched, cp_plan.cu_seq_lens, cp_plan.starts, kv, context_out, context_lse)


def local_part(call: LayerCall, cp_plan: ContextParallelPlan, k: int, part: torch.Tensor | None = None) -> torch.Tensor:
    """What this rank all-gathers for chunk ``k``: its rows of the chunk, ``[rows, L+R]`` (``rows``: the
    chunk's part size, the same on every rank; rows past this rank's share are never read).

    From an fp8 cache, the rows as stored, viewed as uint8 (gloo has no float8 collectives): 1 byte an
    element. Otherwise ``gather_context`` writes them, dequantized, into ``part`` (the compute dtype)."""
    rows = cp_plan.part_rows if cp_plan.chunk_part_rows is None else cp_plan.chunk_part_rows[k]
    cu_seq_lens, starts = cp_plan.local_cu_seq_lens.select(0, k), cp_plan.local_starts.select(0, k)
    if call.kv_cache.dtype == torch.float8_e4m3fn:
        return _stored_rows(call.kv_cache, call.plan.block_table, cu_seq_lens, starts, rows)
    call.kernels.gather_context(call.kv_cache, call.plan.block_table, cu_seq_lens, starts, call.k_scale, part)
    return part.narrow(0, 0, rows)


def _stored_rows(kv_cache: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor, starts: torch.Tensor,
                 num_rows: int) -> torch.Tensor:
    """``gather_context``'s rows ``[0, num_rows)`` without its dequantization: the cache's bytes, uint8
    ``[num_rows, L+R]`` (tensor code, no host read). Row ``cu_seq_lens[i] + j`` is context position
    ``starts[i] + j`` of request ``i``; rows past ``cu_seq_lens[-1]`` (a device count) take cache row 0."""
    stored = kv_cache.view(torch.uint8)  # the same strides: no copy of the cache
    if kv_cache.shape[0] == 0 or kv_cache.shape[1] == 0 or block_table.shape[1] == 0:  # no rows on this rank
        return stored.new_zeros(num_rows, kv_cache.shape[2])
    block, offset = context_row_locations(block_table, cu_seq_lens, starts, num_rows, kv_cache.shape[1])
    return stored[block, offset]


def _absorbed_queries_path(call: LayerCall, cp_plan: ContextParallelPlan, context_out, context_lse):
    """All-gather folded queries, attend over the local shard, all-to-all the partials, merge, unfold."""
    kernels, dims, q, plan, group = call.kernels, call.dims, call.q, call.plan, cp_plan.config.process_group
    d, heads, latent, slots = cp_plan.world_size, dims.num_heads, dims.latent, cp_plan.num_absorbed_tokens
    aqsl = cp_plan.absorbed_query_start_loc
    # Slot a of the compact batch holds token `token[a]` (slots past the absorbed tokens: token 0, no request).
    slot_request, slot_position, slot_live = token_requests(aqsl, slots)
    token = torch.where(slot_live, plan.query_start_loc.long()[slot_request] + slot_position, 0)
    q_slots = q.index_select(0, token)  # [A, H, P+R]
    w_uk, w_uv = split_kv_b_proj(call.weight, heads, dims.nope)
    q_abs = torch.cat([fold_queries(q_slots, w_uk, q.dtype).transpose(0, 1), q_slots[..., dims.nope:]], dim=-1)
    every_q = collectives.wait(collectives.all_gather(q_abs, group))
    every_q = every_q.view(d, slots, heads, -1).transpose(0, 1).reshape(slots, d * heads, -1)

    acc = lse_dtype(q.dtype)  # partials travel in float32 (float64 for float64 q)
    o_lat = q.new_zeros(slots, d * heads, latent, dtype=acc)  # [A, D*H, L]: every rank's heads, local keys
    lse = q.new_full((d * heads, slots), float("-inf"), dtype=acc)
    kernels.latent_context_attention(every_q, call.kv_cache, plan.block_table, aqsl, cp_plan.absorbed_local_lens,
                                     call.softmax_scale, call.k_scale, o_lat, lse)
    send = torch.cat([o_lat.view(slots, d, heads, latent).transpose(0, 1),
                      lse.view(d, heads, slots).transpose(1, 2).unsqueeze(-1)], dim=-1)  # [D, A, H, L+1]
    received = collectives.wait(collectives.all_to_all(send, group))  # block r: rank r's partial of my heads
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
