"""``plan_prefill`` / ``run_prefill`` / ``mla_prefill``: MLA prefill attention with a chunked, paged
latent context, the face of the library.

q                 [T, N, P+R]   rotated queries of the new tokens
kv_c              [T, L]        latent rows of the new tokens      k_pe [T, R] (rotated)
kv_cache          [num_blocks, block_size, L+R]   every request's context rows
kv_b_proj_weight  [N*(P+V), L]
plan              PrefillPlan   (``plan_prefill``: lengths, block table, schedule, routing)
-> out            [T, N, V]     (and ``lse`` [N, T] with ``return_lse=True``)

A step takes three calls: ``plan_prefill`` checks the step's lengths and options and plans them once (the
single-device planners of ``planning/`` or context parallel's, ``parallel/``); ``begin_step`` and
``PrefillStep.run`` (``mla_ops/step.py``) set the step up against the caches once and run it per layer.
``run_prefill`` is the last two for one layer with a plan made beforehand; ``mla_prefill`` all of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import _checks as checks
from .parallel.plan import plan_context_parallel
from .planning import plan as planning
from .planning.options import PlanOptions, options_from
from .planning.plan import PrefillPlan
from .step import begin_step

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
    index_topk: int | None = None,
    index_scores_budget: int = PlanOptions.index_scores_budget,
    max_index_chunks: int | None = None,
    sliding_window: int | None = None,
    masked_mha_ratio: float | None = None,
    options: PlanOptions | None = None,
) -> PrefillPlan:
    """Plan a prefill step once for all layers: the chunk schedule, the routing, the checked lengths.

    query_start_loc [B+1] int32, context_lens [B] int32 (context tokens only: vLLM's ``seq_lens``
    minus the query lengths), block_table [>= B, max_blocks] int32 (its device is the plan's).
    ``options``: a ``mla_ops.PlanOptions`` holding every planning option; or pass them as the loose
    keywords, which build one (not both). ``max_chunks=K`` gives the device form (packed,
    ``split_alignment=1``), planned with tensor code and no host read: the form for ``torch.compile``
    and CUDA graphs. ``absorb_max_query_len``: requests with at most this many new tokens (and some
    context) take the absorbed path; None is ``routing.DEFAULT_ABSORB_MAX_QUERY_LEN``, 0 disables the
    path. ``max_absorbed_tokens``: the most new tokens the absorbed path takes in one step; the first
    routed requests that fit take it, the rest stay on the chunked path (exact either way). Its packed
    scratch has this many rows in the device form, where it is static; None: no cap on the host,
    ``workspace_size // 4`` on the device (at DeepSeek's dims its scratch, 2 x N x L per token, is then
    the size of the chunk loop's up-projected workspace, N x (P+V) per row, allocated after it is freed).
    ``context_parallel=mla_ops.ContextParallel(group, interleave)``: the latent cache is sharded over
    the group's ranks; ``block_table`` is this rank's, the lengths are global, and
    ``absorb_max_query_len`` routes between the all-gather and absorbed-queries paths (None: their
    cost model); see ``mla_ops/parallel/plan.py``. ``index_topk=K_I``: a DeepSeek Sparse Attention step
    (DESIGN §12): requests with more than K_I keys (context + new tokens) take the sparse path
    (``index_topk`` selects their keys, ``run_prefill(topk_indices=)`` attends them), the others the
    dense paths; the plan holds the indexer's chunks, each scoring at most ``index_scores_budget``
    (query tokens x key rows); ``max_index_chunks``: the device form's indexer chunk slots (default
    ``max_chunks``); ``masked_mha_ratio``: which sparse requests are attended as top-k-masked MHA instead
    (``PlanOptions``; None: the measured default). ``sliding_window=w`` (DESIGN §11): query ``c_r + j`` sees only keys ``c_r + j - w + 1 ..
    c_r + j``; each request's context is clamped to the rows its window covers (its last ``min(c_r, w - 1)``),
    so the work grows with the window, not the context. A model whose layers have different windows (or none)
    plans one step per kind of layer.

    Checks shapes and arguments always, and the lengths' values and the block ids the contexts use
    wherever they are readable for free (CPU tensors, not traced). Raises before anything runs.
    """
    planning.check_inputs(query_start_loc, context_lens, block_table)
    options = options_from(options, block_size=block_size, workspace_size=workspace_size, policy=policy,
                           split_alignment=split_alignment, max_chunks=max_chunks,
                           absorb_max_query_len=absorb_max_query_len, max_absorbed_tokens=max_absorbed_tokens,
                           index_topk=index_topk, index_scores_budget=index_scores_budget,
                           max_index_chunks=max_index_chunks, sliding_window=sliding_window,
                           masked_mha_ratio=masked_mha_ratio)
    return plan_with_options(query_start_loc, context_lens, block_table, options, context_parallel)


def plan_with_options(query_start_loc, context_lens, block_table, options: PlanOptions,
                      context_parallel: ContextParallel | None = None) -> PrefillPlan:
    """``plan_prefill`` with its options already in a ``PlanOptions`` (inputs checked by the caller)."""
    if not options.device_form and torch.compiler.is_compiling():
        checks.raise_value_error(
            "plan_prefill under torch.compile needs max_chunks=K (a static capacity): the host planner "
            "reads the lengths' values. Pick K per batch bucket, e.g. ceil(max total context / workspace_size)."
        )
    if not options.device_form and query_start_loc.is_meta:
        raise ValueError("the host form of plan_prefill reads the lengths' values, which meta tensors do not "
                         "have: pass max_chunks=K for a device plan")
    if context_parallel is not None:
        if options.index_topk:
            raise ValueError("context_parallel does not serve DeepSeek Sparse Attention (index_topk) yet: plan a "
                             "DSA step on one device (docs/limitations.md)")
        if options.sliding_window:
            raise ValueError("context_parallel does not serve a sliding_window yet: plan a windowed step on one "
                             "device (docs/limitations.md)")
        return plan_context_parallel(query_start_loc, context_lens, block_table, options, context_parallel)
    if options.device_form:
        return planning.plan_device(query_start_loc, context_lens, block_table, options)
    return planning.plan_host(query_start_loc, context_lens, block_table, options)


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
    *,
    return_lse: bool = False,
    topk_indices: torch.Tensor | None = None,
    kv_cache_format: str = "auto",
    v_head_dim: int | None = None,
    sinks: torch.Tensor | None = None,
):
    """Attention of each request's new tokens over its cached context and, causally, itself.

    Request r's queries ``q[query_start_loc[r]:query_start_loc[r+1]]`` see its ``context_lens[r]``
    context keys (latent rows ``kv_cache[block_table[r, p // block_size], p % block_size]``,
    up-projected with ``kv_b_proj_weight``) and, causally, the keys of its own new tokens, which
    need not be in ``kv_cache``; lengths and block table come from ``plan``. ``k_scale``
    dequantizes a float8_e4m3fn cache (ignored for other cache dtypes). ``out`` ``[T, N, V]`` is
    written in place if given. With a device plan nothing is read on the host; tokens of requests
    whose context does not fit the plan's ``max_chunks`` come out as NaN, never silently wrong.
    Several layers of one step: ``begin_step`` once, then ``PrefillStep.run`` per layer.

    Returns ``[T, N, V]`` in the dtype of q; with ``return_lse=True``, ``(out, lse)``: ``lse``
    ``[N, T]`` (float32, float64 for float64 q, natural log; NaN where ``out`` is), the partial an
    engine merges with its own (``mla_ops.merge_attn_states``).

    DeepSeek Sparse Attention (a plan with ``index_topk=K_I``, DESIGN §12): ``topk_indices`` [T, K_I]
    int32 (``mla_ops.index_topk``), required there and refused otherwise, lists each token's selected
    positions in its request's sequence (-1 pads). The plan's sparse requests attend only those (a
    position past the query's own never); their rows on the CPU must lie in ``-1 .. c_r + q_r - 1``.
    Dense-routed requests' rows are ignored (they attend every key).

    Dims: N, L and R are read from q, kv_c and k_pe; P and V from q and kv_b_proj_weight
    (P = q's last dim - R, V = rows / N - P), which any P/V split fits. ``v_head_dim=V`` fixes V, and q's
    last dim is then checked to be P+R: pass it (or ``out=``) where q is not made from the same config.

    ``sinks`` [N] float32 (DESIGN §11): a learned logit per head that joins every softmax as one more key
    without a value: ``out * sigmoid(lse - sinks[h])``, and the returned ``lse`` includes it (``logaddexp(lse,
    sinks[h])``). A plan with a ``sliding_window`` masks every path (``plan_prefill``).

    ``kv_cache_format="fp8_ds_mla"``: ``kv_cache`` in vLLM's DeepSeek-V3.2 layout ([num_blocks, block_size,
    656] uint8, a float32 scale per 128 values; L = 512, R = 64; no ``k_scale``), see ``begin_step``.
    """
    step = begin_step(plan, kv_cache, k_scale=k_scale, backend=backend, kv_cache_format=kv_cache_format)
    return step.run(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, out=out, return_lse=return_lse,
                    topk_indices=topk_indices, v_head_dim=v_head_dim, sinks=sinks)


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
    kv_cache_format: str = "auto",
    v_head_dim: int | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``plan_prefill`` + ``run_prefill`` in one call (see both).

    ``plan=``: a plan made once per step (then the planning arguments must be left at their
    defaults, and ``block_table``, ``query_start_loc``, ``context_lens`` must be the plan's).
    ``v_head_dim``: V, to check q's P+R against (``run_prefill``). ``sliding_window`` (a planning option,
    ``plan_prefill``) and ``sinks`` [N] float32 (``run_prefill``): DESIGN §11's attention variants.
    """
    checks.check_tensor(q, "q", 3, "[T, N, P+R]")
    for name, x, ndim, doc in (("block_table", block_table, 2, "[B, max_blocks]"),
                               ("query_start_loc", query_start_loc, 1, "[B+1]"), ("context_lens", context_lens, 1, "[B]")):
        checks.check_tensor(x, name, ndim, doc, q.device, "q")
    checks.check_tensor(kv_cache, "kv_cache", 3, "[num_blocks, block_size, L+R]")
    loose = dict(workspace_size=workspace_size, policy=policy, split_alignment=split_alignment, max_chunks=max_chunks,
                 absorb_max_query_len=absorb_max_query_len, max_absorbed_tokens=max_absorbed_tokens,
                 sliding_window=sliding_window)
    if plan is None:
        planning.check_inputs(query_start_loc, context_lens, block_table)
        options = options_from(None, block_size=kv_cache.shape[1], **loose)
        plan = plan_with_options(query_start_loc, context_lens, block_table, options)
    else:
        if not isinstance(plan, PrefillPlan):
            raise TypeError(f"plan must be a PrefillPlan (mla_ops.plan_prefill), got {type(plan).__name__}")
        options_from(None, **loose)  # the loose arguments are still checked
        for name, value in loose.items():
            if value != getattr(PlanOptions, name):
                raise ValueError(f"{name} is part of the plan: pass it to plan_prefill, not with plan= ({name}={value!r})")
        for name, x, planned in (("block_table", block_table, plan.block_table),
                                 ("query_start_loc", query_start_loc, plan.query_start_loc),
                                 ("context_lens", context_lens, plan.context_lens)):
            if x.shape != planned.shape:
                raise ValueError(f"{name} does not fit plan: shape {tuple(x.shape)}, the plan's is {tuple(planned.shape)}")
        planning.check_inputs(query_start_loc, context_lens, block_table)
        planning.check_step_tensors(plan, block_table=block_table, query_start_loc=query_start_loc,
                                    context_lens=context_lens)
    return run_prefill(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, plan, k_scale, backend,
                       kv_cache_format=kv_cache_format, v_head_dim=v_head_dim, sinks=sinks)
