"""``run_prefill`` / ``mla_prefill``: MLA prefill attention with a chunked, paged latent context.

q                 [T, N, P+R]   rotated queries of the new tokens
kv_c              [T, L]        latent rows of the new tokens      k_pe [T, R] (rotated)
kv_cache          [num_blocks, block_size, L+R]   every request's context rows
kv_b_proj_weight  [N*(P+V), L]
plan              PrefillPlan   (``mla_ops.plan_prefill``: lengths, block table, schedule, routing)
-> out            [T, N, V]

causal suffix attention over the new tokens -> context partial: absorbed requests, then per chunk
gather, up-project, attend, fold in -> one merge of the two partials.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import backends
from . import validation as V
from .context_parallel import run_context_parallel
from .merge import lse_dtype
from .plan import PrefillPlan, plan_prefill

BACKENDS = ("auto", "torch", "triton", "flashmla")


def check_run(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, plan, k_scale, backend, out) -> "_Dims":
    """Every check of a ``run_prefill`` call (shapes, dtypes, devices, the plan's fit); the dims."""
    V.check_tensor(q, "q", 3, "[T, N, P+R]")
    device = q.device
    if q.dtype not in V.FLOAT_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    V.check_tensor(kv_c, "kv_c", 2, "[T, L]", device, "q", dtype=q.dtype)
    V.check_tensor(k_pe, "k_pe", 2, "[T, R]", device, "q", dtype=q.dtype)
    V.check_tensor(kv_cache, "kv_cache", 3, "[num_blocks, block_size, L+R]", device, "q")
    V.check_tensor(kv_b_proj_weight, "kv_b_proj_weight", 2, "[N*(P+V), L]", device, "q", dtype=q.dtype)
    if kv_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise TypeError(f"kv_cache must have the dtype of q ({q.dtype}) or float8_e4m3fn, got {kv_cache.dtype}")

    num_tokens, num_heads, qk_dim = q.shape
    rope_dim, latent_dim = k_pe.shape[1], kv_c.shape[1]
    nope_dim = qk_dim - rope_dim
    if nope_dim < 0:
        raise ValueError(f"k_pe width R={rope_dim} exceeds the q head dim P+R={qk_dim}")
    if kv_c.shape[0] != num_tokens or k_pe.shape[0] != num_tokens:
        raise ValueError(
            f"q, kv_c and k_pe must have one row per new token: q has {num_tokens}, kv_c "
            f"{kv_c.shape[0]}, k_pe {k_pe.shape[0]}"
        )
    if kv_cache.shape[2] != latent_dim + rope_dim:
        raise ValueError(
            f"kv_cache rows must be L+R = {latent_dim}+{rope_dim} = {latent_dim + rope_dim} wide "
            f"(kv_c and k_pe widths), got {kv_cache.shape[2]}"
        )
    rows, cols = kv_b_proj_weight.shape
    if cols != latent_dim or rows % num_heads or rows // num_heads <= nope_dim:
        raise ValueError(
            f"kv_b_proj_weight must be [N*(P+V), L] with N={num_heads}, P={nope_dim}, L={latent_dim}, "
            f"V >= 1, got {list(kv_b_proj_weight.shape)}"
        )
    dims = _Dims(num_heads, latent_dim, nope_dim, rope_dim, rows // num_heads - nope_dim)
    V.check_softmax_scale(softmax_scale)
    V.check_choice(backend, "backend", BACKENDS)
    V.check_k_scale(k_scale, kv_cache, device)

    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan must be a PrefillPlan (mla_ops.plan_prefill), got {type(plan).__name__}")
    if plan.device != device:
        raise ValueError(f"plan must be on {device} (the device of q), got a plan on {plan.device}")
    if plan.num_tokens is not None and plan.num_tokens != num_tokens:
        raise ValueError(f"plan was made for T={plan.num_tokens} tokens (its query_start_loc[-1]), but q has {num_tokens}")
    if plan.block_size != kv_cache.shape[1]:
        raise ValueError(f"plan was made for block_size {plan.block_size}, but kv_cache has {kv_cache.shape[1]}")
    if plan.max_block_id >= kv_cache.shape[0]:
        raise ValueError(
            f"plan.block_table uses block {plan.max_block_id}, past the {kv_cache.shape[0]} blocks of kv_cache"
        )
    if plan.max_chunks is None and torch.compiler.is_compiling():
        raise ValueError(
            "run_prefill under torch.compile needs a device plan (plan_prefill(..., max_chunks=K)): a host "
            "plan's chunks are Python values that would be baked into the graph"
        )
    if out is not None:
        V.check_tensor(out, "out", 3, "[T, N, V]", device, "q", dtype=q.dtype)
        if tuple(out.shape) != (num_tokens, num_heads, dims.value):
            raise ValueError(f"out must be [T, N, V] = {[num_tokens, num_heads, dims.value]}, got {list(out.shape)}")
    return dims


def run_prefill(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    softmax_scale: float,
    plan: PrefillPlan,
    k_scale: float | torch.Tensor | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each request's new tokens over its cached context and, causally, itself.

    Request r's queries ``q[query_start_loc[r]:query_start_loc[r+1]]`` see its ``context_lens[r]``
    context keys (latent rows ``kv_cache[block_table[r, p // block_size], p % block_size]``,
    up-projected with ``kv_b_proj_weight``) and, causally, the keys of its own new tokens, which
    need not be in ``kv_cache``; lengths and block table come from ``plan``. ``k_scale``
    dequantizes a float8_e4m3fn cache (ignored for other cache dtypes). ``out`` ``[T, N, V]`` is
    written in place if given. With a device plan nothing is read on the host; tokens of requests
    whose context does not fit the plan's ``max_chunks`` come out as NaN, never silently wrong.

    Returns ``[T, N, V]`` in the dtype of q.
    """
    dims = check_run(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, plan, k_scale, backend, out)
    result = launch(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, plan, k_scale, backend, dims)
    if out is None:
        return result
    out.copy_(result)
    return out


def mla_prefill(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    softmax_scale: float,
    workspace_size: int = 65536,
    policy: str = "packed",
    k_scale: float | torch.Tensor | None = None,
    backend: str = "auto",
    *,
    split_alignment: int = 1,
    max_chunks: int | None = None,
    absorb_max_query_len: int | None = None,
    max_absorbed_tokens: int | None = None,
    plan: PrefillPlan | None = None,
) -> torch.Tensor:
    """``plan_prefill`` + ``run_prefill`` in one call (see both).

    ``plan=``: a plan made once per step (then the planning arguments must be left at their
    defaults, and ``block_table``, ``query_start_loc``, ``context_lens`` must be the plan's).
    """
    V.check_tensor(q, "q", 3, "[T, N, P+R]")
    for name, x, ndim, doc in (("block_table", block_table, 2, "[B, max_blocks]"),
                               ("query_start_loc", query_start_loc, 1, "[B+1]"), ("context_lens", context_lens, 1, "[B]")):
        V.check_tensor(x, name, ndim, doc, q.device, "q")
    if plan is None:
        plan = plan_prefill(
            query_start_loc, context_lens, block_table, block_size=_block_size(kv_cache),
            workspace_size=workspace_size, policy=policy, split_alignment=split_alignment,
            max_chunks=max_chunks, absorb_max_query_len=absorb_max_query_len,
            max_absorbed_tokens=max_absorbed_tokens,
        )
    else:
        if not isinstance(plan, PrefillPlan):
            raise TypeError(f"plan must be a PrefillPlan (mla_ops.plan_prefill), got {type(plan).__name__}")
        given = dict(workspace_size=(workspace_size, 65536), policy=(policy, "packed"),
                     split_alignment=(split_alignment, 1), max_chunks=(max_chunks, None),
                     absorb_max_query_len=(absorb_max_query_len, None),
                     max_absorbed_tokens=(max_absorbed_tokens, None))
        for name, (value, default) in given.items():
            if value != default:
                raise ValueError(f"{name} is part of the plan: pass it to plan_prefill, not with plan= ({name}={value!r})")
        for name, x, planned in (("block_table", block_table, plan.block_table),
                                 ("query_start_loc", query_start_loc, plan.query_start_loc),
                                 ("context_lens", context_lens, plan.context_lens)):
            if not isinstance(x, torch.Tensor) or x.shape != planned.shape:
                raise ValueError(
                    f"{name} does not fit plan: shape {tuple(getattr(x, 'shape', ()))}, the plan's is "
                    f"{tuple(planned.shape)}"
                )
    return run_prefill(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, plan, k_scale, backend)


def _block_size(kv_cache) -> int:
    V.check_tensor(kv_cache, "kv_cache", 3, "[num_blocks, block_size, L+R]")
    return kv_cache.shape[1]


def launch(q, kv_c, k_pe, kv_cache, weight, softmax_scale, plan, k_scale, backend, dims) -> torch.Tensor:
    """``run_prefill`` after ``check_run`` (for callers that check everything first)."""
    softmax_scale = float(softmax_scale)  # a compile-time constant: kernels take it as a float
    kernels = backends.select(backend, q.device, plan.absorb_max_query_len)
    if kv_cache.dtype != torch.float8_e4m3fn:
        k_scale = None
    elif not isinstance(k_scale, torch.Tensor):
        k_scale = torch.tensor([float(k_scale)], device=q.device)

    # Suffix partial: every token over its own request's new keys, causally.
    num_tokens = q.shape[0]
    k_nope, v = dims.heads(torch.mm(kv_c, weight.t()))
    suffix_out = q.new_empty(num_tokens, dims.heads_n, dims.value)
    suffix_lse = q.new_empty(dims.heads_n, num_tokens, dtype=lse_dtype(q.dtype))
    kernels.suffix_attention(q, k_nope, k_pe, v, plan.query_start_loc, softmax_scale, suffix_out, suffix_lse)

    step = _Step(kernels, dims, q, kv_cache, weight, softmax_scale, k_scale, plan)
    if plan.context_parallel is not None:  # a sharded cache: mla_ops/context_parallel.py
        return run_context_parallel(step, suffix_out, suffix_lse)
    if plan.max_chunks is not None:
        return _device_plan_context(step, suffix_out, suffix_lse)
    return _host_plan_context(step, suffix_out, suffix_lse)


class _Dims(NamedTuple):
    heads_n: int
    latent: int
    nope: int
    rope: int
    value: int

    def heads(self, kv: torch.Tensor):
        """[S, N*(P+V)] up-projected rows -> k_nope [S, N, P], v [S, N, V] (views)."""
        return kv.view(-1, self.heads_n, self.nope + self.value).split([self.nope, self.value], dim=-1)


class _Step(NamedTuple):
    """What both context paths of one ``run_prefill`` call share."""

    kernels: backends.Kernels
    dims: _Dims
    q: torch.Tensor
    kv_cache: torch.Tensor
    weight: torch.Tensor
    softmax_scale: float
    k_scale: torch.Tensor | None
    plan: PrefillPlan

    def absorbed(self, context_out, context_lse) -> None:
        """The absorbed requests' context partials, written into their rows only; the kernels pack
        the routed tokens into ``plan.max_absorbed_tokens`` rows of scratch."""
        p = self.plan
        self.kernels.absorbed_context_attention(
            self.q, self.kv_cache, p.block_table, p.query_start_loc, p.absorbed_context_lens, self.weight,
            self.softmax_scale, self.k_scale, context_out, context_lse, p.max_absorbed_tokens,
        )


def _device_plan_context(step: _Step, suffix_out, suffix_lse) -> torch.Tensor:
    """K static chunk steps over the device plan; no host read of a device value."""
    kernels, dims, q, plan = step.kernels, step.dims, step.q, step.plan
    context_out = torch.zeros_like(suffix_out)
    context_lse = torch.full_like(suffix_lse, float("-inf"))
    if plan.absorbed_context_lens is not None:  # first: its scratch is freed before the chunk buffers exist
        step.absorbed(context_out, context_lse)
    schedule = plan.device_schedule
    workspace = q.new_empty(plan.workspace_size, dims.latent + dims.rope)
    kv = q.new_empty(plan.workspace_size, step.weight.shape[0])
    latent, rope = workspace.split([dims.latent, dims.rope], dim=1)
    chunk_k_nope, chunk_v = dims.heads(kv)
    for k in range(schedule.max_chunks):  # chunks past the device count touch nothing
        cu_seq_lens, starts = schedule.cu_seq_lens.select(0, k), schedule.starts.select(0, k)
        kernels.gather_context(step.kv_cache, plan.block_table, cu_seq_lens, starts, step.k_scale, workspace)
        kernels.up_project(latent, step.weight, cu_seq_lens, kv)
        kernels.context_attention(q, chunk_k_nope, rope, chunk_v, plan.query_start_loc, cu_seq_lens, starts,
                                  step.softmax_scale, context_out, context_lse)
    out, _ = kernels.merge_attn_states(context_out, context_lse, suffix_out, suffix_lse)
    # Requests whose chunked context runs past chunk K were not fully attended: say so with NaN.
    token = torch.arange(q.shape[0], device=q.device, dtype=plan.query_start_loc.dtype)
    request = torch.searchsorted(plan.query_start_loc, token, right=True) - 1  # [T]
    truncated = plan.truncated.index_select(0, request.clamp(0, max(plan.num_requests - 1, 0)))
    return torch.where(truncated.view(-1, 1, 1), torch.full_like(out, float("nan")), out)


def _host_plan_context(step: _Step, suffix_out, suffix_lse) -> torch.Tensor:
    """The host schedule's chunks, each over its own requests only."""
    kernels, dims, q, plan = step.kernels, step.dims, step.q, step.plan
    schedule, num_tokens = plan.schedule, q.shape[0]
    if plan.absorbed_context_lens is not None:  # any token may get an absorbed partial
        covered = num_tokens
        context_out = torch.zeros_like(suffix_out)
        context_lse = torch.full_like(suffix_lse, float("-inf"))
        step.absorbed(context_out, context_lse)
    elif schedule.num_chunks == 0:
        return suffix_out
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
        kernels.gather_context(step.kv_cache, plan.block_table.narrow(0, chunk.request_start, chunk.num_requests),
                               chunk.cu_seq_lens, chunk.starts, step.k_scale, rows)
        latent, rope = rows.split([dims.latent, dims.rope], dim=1)
        chunk_k_nope, chunk_v = dims.heads(torch.mm(latent, step.weight.t()))  # the host knows the live rows
        tokens = chunk.token_end - chunk.token_start
        kernels.context_attention(
            q.narrow(0, chunk.token_start, tokens), chunk_k_nope, rope, chunk_v, chunk.query_start_loc,
            chunk.cu_seq_lens, chunk.starts, step.softmax_scale,
            context_out.narrow(0, chunk.token_start, tokens), context_lse.narrow(1, chunk.token_start, tokens),
        )

    merged, _ = kernels.merge_attn_states(
        context_out, context_lse, suffix_out.narrow(0, 0, covered), suffix_lse.narrow(1, 0, covered)
    )
    if covered == num_tokens:
        return merged
    return torch.cat([merged, suffix_out.narrow(0, covered, num_tokens - covered)])
