"""``run_prefill`` / ``mla_prefill``: MLA prefill attention with a chunked, paged latent context.

q                 [T, N, P+R]   rotated queries of the new tokens
kv_c              [T, L]        latent rows of the new tokens      k_pe [T, R] (rotated)
kv_cache          [num_blocks, block_size, L+R]   every request's context rows
kv_b_proj_weight  [N*(P+V), L]
plan              PrefillPlan   (``plan_prefill``: lengths, block table, schedule, routing)
-> out            [T, N, V]

The face of the library: ``plan_prefill`` checks the step's inputs and options once and dispatches
to the single-device planners (``planning/``) or context parallel's (``parallel/``);
``run_prefill`` checks a layer's tensors against the plan, selects the kernels and runs the causal
suffix attention, the context partial (``chunk_loop``, or ``parallel.run``) and their merge.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import _checks as checks
from ._mla import MLADims
from .chunk_loop import Step, device_context, host_context, truncated_tokens
from .ops import backends
from .ops.backends import BACKENDS
from .parallel.plan import plan_context_parallel
from .parallel.run import run_context_parallel
from .planning import plan as planning
from .planning.options import PlanOptions, plan_options
from .planning.plan import PrefillPlan

if TYPE_CHECKING:
    from .parallel.config import ContextParallel


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
    """Plan a prefill step once for all layers: the chunk schedule, the routing, the checked lengths.

    query_start_loc [B+1] int32, context_lens [B] int32, block_table [>= B, max_blocks] int32 (its
    device is the plan's). ``max_chunks=K`` gives the device form (packed, ``split_alignment=1``),
    planned with tensor code and no host read: the form for ``torch.compile`` and CUDA graphs.
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
    cost model); see ``mla_ops/parallel/plan.py``.

    Checks shapes and arguments always, and the lengths' values and the block ids the contexts use
    wherever they are readable for free (CPU tensors, not traced). Raises before anything runs.
    """
    planning.check_inputs(query_start_loc, context_lens, block_table)
    options = plan_options(block_size, workspace_size, policy, split_alignment, max_chunks, absorb_max_query_len,
                          max_absorbed_tokens)
    return plan_with_options(query_start_loc, context_lens, block_table, options, context_parallel)


def plan_with_options(query_start_loc, context_lens, block_table, options: PlanOptions,
                      context_parallel: ContextParallel | None = None) -> PrefillPlan:
    """``plan_prefill`` with its options already in a ``PlanOptions`` (inputs checked by the caller)."""
    if not options.device_form and torch.compiler.is_compiling():
        raise ValueError(
            "plan_prefill under torch.compile needs max_chunks=K (a static capacity): the host planner "
            "reads the lengths' values. Pick K per batch bucket, e.g. ceil(max total context / workspace_size)."
        )
    if not options.device_form and query_start_loc.is_meta:
        raise ValueError("the host form of plan_prefill reads the lengths' values, which meta tensors do not "
                         "have: pass max_chunks=K for a device plan")
    if context_parallel is not None:
        return plan_context_parallel(query_start_loc, context_lens, block_table, options, context_parallel)
    if options.device_form:
        return planning.plan_device(query_start_loc, context_lens, block_table, options)
    return planning.plan_host(query_start_loc, context_lens, block_table, options)


def check_run(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, plan, k_scale, backend, out) -> MLADims:
    """Every check of a ``run_prefill`` call (shapes, dtypes, devices, the plan's fit); the dims."""
    checks.check_tensor(q, "q", 3, "[T, N, P+R]")
    device = q.device
    if q.dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    checks.check_tensor(kv_c, "kv_c", 2, "[T, L]", device, "q", dtype=q.dtype)
    checks.check_tensor(k_pe, "k_pe", 2, "[T, R]", device, "q", dtype=q.dtype)
    checks.check_tensor(kv_cache, "kv_cache", 3, "[num_blocks, block_size, L+R]", device, "q")
    checks.check_tensor(kv_b_proj_weight, "kv_b_proj_weight", 2, "[N*(P+V), L]", device, "q", dtype=q.dtype)
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
    dims = MLADims(num_heads, latent_dim, nope_dim, rope_dim, rows // num_heads - nope_dim)
    checks.check_softmax_scale(softmax_scale)
    checks.check_choice(backend, "backend", BACKENDS)
    checks.check_k_scale(k_scale, kv_cache, device)

    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan must be a PrefillPlan (mla_ops.plan_prefill), got {type(plan).__name__}")
    if plan.device != device:
        raise ValueError(f"plan must be on {device} (the device of q), got a plan on {plan.device}")
    if plan.num_tokens is not None and plan.num_tokens != num_tokens:
        raise ValueError(f"plan was made for T={plan.num_tokens} tokens (its query_start_loc[-1]), but q has {num_tokens}")
    if plan.block_size != kv_cache.shape[1]:
        raise ValueError(f"plan was made for block_size {plan.block_size}, but kv_cache has {kv_cache.shape[1]}")
    max_block_id = planning.current_max_block_id(plan)
    if max_block_id >= kv_cache.shape[0]:
        raise ValueError(
            f"plan.block_table uses block {max_block_id}, past the {kv_cache.shape[0]} blocks of kv_cache"
        )
    if plan.max_chunks is None and torch.compiler.is_compiling():
        raise ValueError(
            "run_prefill under torch.compile needs a device plan (plan_prefill(..., max_chunks=K)): a host "
            "plan's chunks are Python values that would be baked into the graph"
        )
    if out is not None:
        checks.check_tensor(out, "out", 3, "[T, N, V]", device, "q", dtype=q.dtype)
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
    result = run_checked(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, plan, k_scale, backend, dims)
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
    checks.check_tensor(q, "q", 3, "[T, N, P+R]")
    for name, x, ndim, doc in (("block_table", block_table, 2, "[B, max_blocks]"),
                               ("query_start_loc", query_start_loc, 1, "[B+1]"), ("context_lens", context_lens, 1, "[B]")):
        checks.check_tensor(x, name, ndim, doc, q.device, "q")
    options = plan_options(_block_size(kv_cache), workspace_size, policy, split_alignment, max_chunks,
                          absorb_max_query_len, max_absorbed_tokens)
    if plan is None:
        planning.check_inputs(query_start_loc, context_lens, block_table)
        plan = plan_with_options(query_start_loc, context_lens, block_table, options)
    else:
        if not isinstance(plan, PrefillPlan):
            raise TypeError(f"plan must be a PrefillPlan (mla_ops.plan_prefill), got {type(plan).__name__}")
        for name, value in vars(options).items():
            if name != "block_size" and value != getattr(PlanOptions, name):
                raise ValueError(f"{name} is part of the plan: pass it to plan_prefill, not with plan= ({name}={value!r})")
        for name, x, planned in (("block_table", block_table, plan.block_table),
                                 ("query_start_loc", query_start_loc, plan.query_start_loc),
                                 ("context_lens", context_lens, plan.context_lens)):
            if x.shape != planned.shape:
                raise ValueError(f"{name} does not fit plan: shape {tuple(x.shape)}, the plan's is {tuple(planned.shape)}")
        planning.check_inputs(query_start_loc, context_lens, block_table)
        planning.check_step_tensors(plan, block_table=block_table, query_start_loc=query_start_loc,
                                    context_lens=context_lens)
    return run_prefill(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, plan, k_scale, backend)


def _block_size(kv_cache) -> int:
    checks.check_tensor(kv_cache, "kv_cache", 3, "[num_blocks, block_size, L+R]")
    return kv_cache.shape[1]


def run_checked(q, kv_c, k_pe, kv_cache, weight, softmax_scale, plan, k_scale, backend, dims,
                truncated: torch.Tensor | None = None) -> torch.Tensor:
    """``run_prefill`` after ``check_run`` (for callers that check everything first). ``truncated``:
    the step's ``chunk_loop.truncated_tokens``, when the caller made it once for every layer."""
    softmax_scale = float(softmax_scale)  # a compile-time constant: kernels take it as a float
    kernels = backends.select(backend, q.device, plan.absorb_max_query_len, dims.num_heads, plan.kernel_state)
    k_scale = checks.k_scale_tensor(k_scale, kv_cache)
    if truncated is None:
        truncated = truncated_tokens(plan, q.shape[0])
    step = Step(kernels, dims, q, kv_cache, weight, softmax_scale, k_scale, plan, truncated)
    suffix_out, suffix_lse = step.suffix(kv_c, k_pe)
    if plan.context_parallel is not None:  # a sharded cache
        return run_context_parallel(step, suffix_out, suffix_lse)
    if plan.max_chunks is not None:
        return device_context(step, suffix_out, suffix_lse)
    return host_context(step, suffix_out, suffix_lse)
