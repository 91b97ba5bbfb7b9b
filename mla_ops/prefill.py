"""``plan_prefill`` / ``begin_step`` / ``run_prefill``: MLA prefill attention with a chunked, paged
latent context.

q                 [T, N, P+R]   rotated queries of the new tokens
kv_c              [T, L]        latent rows of the new tokens      k_pe [T, R] (rotated)
kv_cache          [num_blocks, block_size, L+R]   every request's context rows
kv_b_proj_weight  [N*(P+V), L]
plan              PrefillPlan   (``plan_prefill``: lengths, block table, schedule, routing)
-> out            [T, N, V]     (and ``lse`` [N, T] with ``return_lse=True``)

The face of the library, in three calls per step:

* ``plan_prefill`` checks the step's lengths and options and plans them once (the single-device
  planners of ``planning/`` or context parallel's, ``parallel/``);
* ``begin_step`` checks the plan against the caches, the slot mapping and ``k_scale`` and selects
  the kernels, once: a ``PrefillStep``, shared by every layer;
* ``PrefillStep.run`` is one layer's call: it checks only that layer's tensors, writes its new rows
  into its cache (when the step has a slot mapping) and runs the causal suffix attention, the
  context partial (``chunk_loop``, or ``parallel.run``) and their merge; in a DeepSeek Sparse
  Attention step (``index_topk``), the sparse requests' tokens are then overwritten by their
  attention over the selected keys (``ops/sparse.py``).

``run_prefill`` is the three for one layer with a plan made beforehand; ``mla_prefill`` all of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import _checks as checks
from ._mla import MLADims
from .chunk_loop import Step, device_context, host_context, suffix_tokens, truncated_tokens
from .ops import backends
from .ops.backends import BACKENDS
from .ops.cache import CACHE_DTYPES, check_slot_mapping, write_checked
from .ops.cache_formats import check_latent_format, latent_width
from .ops.indexer import check_index_layer, check_index_step, index_topk_checked
from .ops.sparse import check_topk_indices, check_topk_values, topk_rows
from .parallel.plan import plan_context_parallel
from .parallel.run import run_context_parallel
from .planning import plan as planning
from .planning.options import PlanOptions, options_from
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
    index_topk: int | None = None,
    index_scores_budget: int = PlanOptions.index_scores_budget,
    max_index_chunks: int | None = None,
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
    ``max_chunks``).

    Checks shapes and arguments always, and the lengths' values and the block ids the contexts use
    wherever they are readable for free (CPU tensors, not traced). Raises before anything runs.
    """
    planning.check_inputs(query_start_loc, context_lens, block_table)
    options = options_from(options, block_size=block_size, workspace_size=workspace_size, policy=policy,
                           split_alignment=split_alignment, max_chunks=max_chunks,
                           absorb_max_query_len=absorb_max_query_len, max_absorbed_tokens=max_absorbed_tokens,
                           index_topk=index_topk, index_scores_budget=index_scores_budget,
                           max_index_chunks=max_index_chunks)
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
        return plan_context_parallel(query_start_loc, context_lens, block_table, options, context_parallel)
    if options.device_form:
        return planning.plan_device(query_start_loc, context_lens, block_table, options)
    return planning.plan_host(query_start_loc, context_lens, block_table, options)


class PrefillStep:
    """A step's attention set up once for every layer (``begin_step``): the plan checked against the
    caches, the slot mapping and the scale, the kernels selected (and any per-step kernel metadata,
    FlashMLA's), the truncated-token map made. ``run`` is one layer's call; no layer writes to it."""

    def __init__(self, plan: PrefillPlan, slot_mapping: torch.Tensor | None, k_scale: torch.Tensor | None,
                 truncated: torch.Tensor | None, kernels: backends.Kernels, cache_blocks: tuple[int, int],
                 cache_dtype: torch.dtype, truncated_made: bool, k_scale_index: torch.Tensor | None = None,
                 suffix_tokens: torch.Tensor | None = None, formats: tuple[str, str] = ("auto", "auto")):
        self.plan, self.slot_mapping, self.k_scale, self.kernels = plan, slot_mapping, k_scale, kernels
        self.kv_cache_format, self.index_cache_format = formats  # checked against the caches by begin_step
        self.k_scale_index = k_scale_index  # a float8 index cache's, as the kernels take it (begin_step)
        self.truncated = truncated  # [T] bool, chunk_loop.truncated_tokens (where truncated_made)
        self.suffix_tokens = suffix_tokens  # [T'] chunk_loop.suffix_tokens (where truncated_made)
        self.truncated_made = truncated_made  # T was known at begin_step: else each layer makes both
        self.cache_blocks = cache_blocks  # (num_blocks, block_size) every layer's cache has
        self.cache_dtype = cache_dtype
        # DSA: the requests whose tokens the sparse op writes. Requests the device plan truncated keep
        # the NaN that mark_truncated gave the merged result.
        self.sparse_rows = None
        self._topk_rows = None  # eager only: ops.sparse.topk_rows of the step (begin_step, or its first DSA layer)
        if plan.index_topk:
            self.sparse_rows = plan.sparse if plan.truncated is None else plan.sparse & ~plan.truncated

    def run(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
            kv_b_proj_weight: torch.Tensor, softmax_scale: float, *, out: torch.Tensor | None = None,
            return_lse: bool = False, topk_indices: torch.Tensor | None = None, write: bool = True,
            v_head_dim: int | None = None):
        """One layer: ``attend``, then its new rows written into ``kv_cache`` at the step's slots (when
        ``begin_step`` had a ``slot_mapping`` and ``write``; nothing otherwise: ``write=False`` for rows that
        are written elsewhere). Checks only this layer's tensors, all before anything is written. Returns
        ``out`` [T, N, V], or ``(out, lse)`` with ``return_lse=True`` (``lse`` [N, T], float32 or float64 for
        float64 q, natural log). ``topk_indices`` [T, index_topk] int32: required with a DSA plan, refused
        without one (see ``run_prefill``). ``v_head_dim``: V, to check q's P+R against (see ``run_prefill``)."""
        if not isinstance(write, bool):
            raise TypeError(f"write must be a bool, got {type(write).__name__}")
        result = self.attend(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, out=out,
                             return_lse=return_lse, topk_indices=topk_indices, v_head_dim=v_head_dim)
        if write:  # after the attention, which takes the new rows as given (never from the cache)
            self.write(kv_c, k_pe, kv_cache)
        return result

    def attend(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
               kv_b_proj_weight: torch.Tensor, softmax_scale: float, *, out: torch.Tensor | None = None,
               return_lse: bool = False, topk_indices: torch.Tensor | None = None, v_head_dim: int | None = None):
        """One layer's attention (``run``'s) without the cache write: the new tokens' rows ``kv_c``, ``k_pe``
        are read as given, the context's from ``kv_cache``."""
        dims = self._check_layer(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, out, return_lse,
                                 v_head_dim)
        self._check_topk(topk_indices, q.shape[0])
        truncated, suffix = self.truncated, self.suffix_tokens
        if not self.truncated_made:
            truncated, suffix = truncated_tokens(self.plan, q.shape[0]), suffix_tokens(self.plan, q.shape[0])
        step = Step(self.kernels, dims, q, kv_cache, kv_b_proj_weight, float(softmax_scale), self.k_scale, self.plan,
                    truncated, suffix)
        suffix_out, suffix_lse = step.suffix(kv_c, k_pe)
        if self.plan.context_parallel is not None:  # a sharded cache
            result, lse = run_context_parallel(step, suffix_out, suffix_lse)
        elif self.plan.max_chunks is not None:
            result, lse = device_context(step, suffix_out, suffix_lse)
        else:
            result, lse = host_context(step, suffix_out, suffix_lse)
        if self.sparse_rows is not None:
            # The dense paths gave the sparse requests' tokens the empty partial (their context is in no dense
            # schedule, their suffix not run: Step.suffix): overwritten here, in the merged result, which no
            # one else holds.
            p = self.plan
            self.kernels.sparse_attention(q, kv_c, k_pe, kv_cache, p.block_table, p.query_start_loc, p.context_lens,
                                          self.sparse_rows, topk_indices, kv_b_proj_weight, step.softmax_scale,
                                          self.k_scale, result, lse)
        if out is not None:
            result = out.copy_(result)
        return (result, lse) if return_lse else result

    def write(self, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """A layer's new rows into ``kv_cache`` at the step's slots (nothing without a slot mapping)."""
        if self.slot_mapping is not None:
            write_checked(kv_c, k_pe, self.slot_mapping, kv_cache, self.k_scale, self.kv_cache_format)

    def select(self, q_index: torch.Tensor, index_weights: torch.Tensor, k_index: torch.Tensor,
               index_cache: torch.Tensor) -> torch.Tensor:
        """One DSA layer's top-k (``mla_ops.index_topk``) on the step its index cache was checked for once
        (``begin_step(..., index_cache=)``): only this layer's tensors are checked here."""
        check_index_layer(q_index, index_weights, k_index, index_cache, self.plan, self.index_cache_format)
        return index_topk_checked(q_index, index_weights, k_index, index_cache, self.plan, self.k_scale_index)

    def write_index(self, k_index: torch.Tensor, index_cache: torch.Tensor) -> None:
        """A DSA layer's new index keys into ``index_cache`` at the step's slots (nothing without a slot
        mapping)."""
        if self.slot_mapping is not None:
            write_checked(k_index, k_index[:, :0], self.slot_mapping, index_cache, self.k_scale_index,
                          self.index_cache_format)

    def _check_topk(self, topk_indices, num_tokens: int) -> None:
        """``topk_indices``: with a DSA plan and only there, ``[T, index_topk]`` int32 on the plan's device,
        its sparse requests' entries in ``-1 .. c_r + q_r - 1`` where readable (CPU)."""
        plan = self.plan
        if not plan.index_topk:
            if topk_indices is not None:
                raise ValueError("topk_indices is for a DeepSeek Sparse Attention step, but plan was made without "
                                 "index_topk: plan the step with plan_prefill(..., index_topk=K)")
            return
        if topk_indices is None:
            raise ValueError(f"plan is a DeepSeek Sparse Attention plan (index_topk={plan.index_topk}): pass "
                             f"topk_indices [T, {plan.index_topk}] int32, the keys each query attends "
                             "(mla_ops.index_topk)")
        check_topk_indices(topk_indices, num_tokens, plan.index_topk, plan.device, "plan")
        rows = None
        if checks.values_readable(topk_indices):  # eager: the step's rows made once, for every layer
            if self._topk_rows is None or self._topk_rows[0].shape[0] != num_tokens:
                self._topk_rows = topk_rows(plan.query_start_loc, plan.context_lens, plan.sparse, num_tokens)
            rows = self._topk_rows
        check_topk_values(topk_indices, plan.query_start_loc, plan.context_lens, plan.sparse, rows)

    def _check_layer(self, q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, out, return_lse,
                     v_head_dim=None) -> MLADims:
        """Shapes, dtypes and devices of one layer's tensors, against each other and the step.

        N, L and R are read from q, kv_c and k_pe; P and V are not: kv_b_proj_weight's N*(P+V) rows and q's
        P+R fit any split, so a q of the wrong width would be read as another P/V split. ``v_head_dim`` fixes V
        and P+R is then checked against q (``out``, checked against the V read, catches it too)."""
        device = self.plan.device
        checks.check_tensor(q, "q", 3, "[T, N, P+R]", device, "plan")
        if q.dtype not in checks.FLOAT_DTYPES:
            raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
        checks.check_tensor(kv_c, "kv_c", 2, "[T, L]", device, "q", dtype=q.dtype)
        checks.check_tensor(k_pe, "k_pe", 2, "[T, R]", device, "q", dtype=q.dtype)
        checks.check_tensor(kv_cache, "kv_cache", 3, "[num_blocks, block_size, L+R]", device, "q")
        checks.check_tensor(kv_b_proj_weight, "kv_b_proj_weight", 2, "[N*(P+V), L]", device, "q", dtype=q.dtype)
        packed = self.kv_cache_format == "fp8_ds_mla"
        if not packed and kv_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
            raise TypeError(f"kv_cache must have the dtype of q ({q.dtype}) or float8_e4m3fn, got {kv_cache.dtype}")
        if kv_cache.dtype != self.cache_dtype or tuple(kv_cache.shape[:2]) != self.cache_blocks:
            raise ValueError(
                f"kv_cache ({tuple(kv_cache.shape)} {kv_cache.dtype}) is not shaped like the cache the step began "
                f"with ({self.cache_blocks} blocks of {self.cache_dtype}): pass that cache (or one layer of it)")
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
        if packed and (latent_dim, rope_dim) != (512, 64):
            raise ValueError(f"kv_cache_format='fp8_ds_mla' holds L = 512 and R = 64: kv_c must be [T, 512] and "
                             f"k_pe [T, 64], got widths {latent_dim} and {rope_dim}")
        if latent_width(kv_cache) != latent_dim + rope_dim:
            raise ValueError(
                f"kv_cache rows must be L+R = {latent_dim}+{rope_dim} = {latent_dim + rope_dim} wide "
                f"(kv_c and k_pe widths), got {kv_cache.shape[2]}"
            )
        rows, cols = kv_b_proj_weight.shape
        v_head_dim = checks.check_int(v_head_dim, "v_head_dim", 1, optional=True)
        if v_head_dim is not None and cols == latent_dim and rows % max(num_heads, 1) == 0 \
                and rows // max(num_heads, 1) - v_head_dim != nope_dim:
            nope = rows // max(num_heads, 1) - v_head_dim
            raise ValueError(
                f"q must be [T, N, P+R] with P+R = {nope}+{rope_dim} = {nope + rope_dim} (kv_b_proj_weight "
                f"[N*(P+V), L] = {list(kv_b_proj_weight.shape)} with N={num_heads}, V={v_head_dim}, and k_pe's "
                f"R={rope_dim}), got {list(q.shape)}")
        if cols != latent_dim or rows % num_heads or rows // num_heads <= nope_dim:
            raise ValueError(
                f"kv_b_proj_weight must be [N*(P+V), L] with N={num_heads}, P={nope_dim}, L={latent_dim}, "
                f"V >= 1, got {list(kv_b_proj_weight.shape)}"
            )
        dims = MLADims(num_heads, latent_dim, nope_dim, rope_dim, rows // num_heads - nope_dim)
        checks.check_softmax_scale(softmax_scale)
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        plan_tokens = self.plan.num_tokens
        if plan_tokens is not None and plan_tokens != num_tokens:
            raise ValueError(f"plan was made for T={plan_tokens} tokens (its query_start_loc[-1]), but q has {num_tokens}")
        if self.slot_mapping is not None and self.slot_mapping.shape[0] != num_tokens:
            raise ValueError(f"slot_mapping has {self.slot_mapping.shape[0]} entries, but q has {num_tokens} tokens")
        if isinstance(self.kernels.absorbed_context_attention, backends.FlashMLAStep):
            self.kernels.absorbed_context_attention.check_heads(num_heads)
        if out is not None:
            checks.check_tensor(out, "out", 3, "[T, N, V]", device, "q", dtype=q.dtype)
            if tuple(out.shape) != (num_tokens, num_heads, dims.value):
                raise ValueError(f"out must be [T, N, V] = {[num_tokens, num_heads, dims.value]} (V = "
                                 f"{dims.value}: kv_b_proj_weight's rows / N - P, P = q's last dim - R = {nope_dim}), "
                                 f"got {list(out.shape)}")
        return dims


def _unflatten_step(leaves, context) -> PrefillStep:
    plan, slot_mapping, k_scale, truncated, cache_blocks, sparse_rows, k_scale_index, suffix = leaves
    kernels, cache_dtype, truncated_made, formats = context
    step = PrefillStep(plan, slot_mapping, k_scale, truncated, kernels, cache_blocks, cache_dtype, truncated_made,
                       k_scale_index, suffix, formats)
    step.sparse_rows = sparse_rows
    return step


# A pytree, as a nested compile region's input must be (mla_ops.models.regions): every tensor a layer reads
# and the cache's sizes are leaves, the kernels and flags static context.
torch.utils._pytree.register_pytree_node(
    PrefillStep,
    lambda s: ((s.plan, s.slot_mapping, s.k_scale, s.truncated, s.cache_blocks, s.sparse_rows, s.k_scale_index,
                s.suffix_tokens),
               (s.kernels, s.cache_dtype, s.truncated_made, (s.kv_cache_format, s.index_cache_format))),
    _unflatten_step, serialized_type_name="mla_ops.PrefillStep")


def begin_step(plan: PrefillPlan, kv_cache: torch.Tensor, slot_mapping: torch.Tensor | None = None, *,
               k_scale: float | torch.Tensor | None = None, backend: str = "auto",
               index_cache: torch.Tensor | None = None,
               k_scale_index: float | torch.Tensor | None = None, kv_cache_format: str = "auto",
               index_cache_format: str = "auto") -> PrefillStep:
    """Set up a step's attention once for every layer: a ``PrefillStep`` whose ``run`` each layer calls.

    ``kv_cache``: one layer's cache ``[num_blocks, block_size, L+R]`` or every layer's stacked
    ``[layers, num_blocks, block_size, L+R]`` (the layers' caches share its geometry and dtype).
    ``slot_mapping`` [T] int64/int32: where each new token's latent row goes (block * block_size +
    offset; negative: padding, not written); None: the layers write nothing (the caller wrote the
    rows, or the new tokens are not to be cached). ``k_scale``: a float8_e4m3fn cache's scale
    (dequantized = stored * k_scale), ignored for other cache dtypes. ``backend``: see
    ``run_prefill``. ``index_cache``: a DSA step's index cache ``[num_blocks, block_size, D_I]`` (one
    layer's: every layer's shares its geometry), with ``k_scale_index`` for float8, for the step's
    ``select`` and ``write_index``. Checks, once: the plan's fit with the caches (block size, the block
    ids the contexts use, where readable), the slots (by value where readable), the scales and the backend.
    ``kv_cache_format`` / ``index_cache_format``: ``"auto"`` (the caches above) or vLLM's packed layouts,
    ``"fp8_ds_mla"`` (``kv_cache`` [.., num_blocks, block_size, 656] uint8) and ``"fp8_per_token"``
    (``index_cache`` [num_blocks, block_size, D_I + 4] uint8), which store their own scales
    (``mla_ops/ops/cache_formats.py``); every kernel but FlashMLA's dequantizes them as it reads.
    """
    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan must be a PrefillPlan (mla_ops.plan_prefill), got {type(plan).__name__}")
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache must be a torch.Tensor [num_blocks, block_size, L+R], got {type(kv_cache).__name__}")
    if kv_cache.dim() not in (3, 4):
        raise ValueError(f"kv_cache must be [num_blocks, block_size, L+R] or [layers, num_blocks, block_size, L+R], "
                         f"got shape {tuple(kv_cache.shape)}")
    device = plan.device
    if kv_cache.device != device:
        raise ValueError(f"plan must be on {kv_cache.device} (the device of kv_cache), got a plan on {device}")
    check_latent_format(kv_cache_format, kv_cache)
    if kv_cache_format != "auto" and plan.context_parallel is not None:
        raise ValueError(f"context_parallel does not read {kv_cache_format} caches yet: plan the step on one device "
                         "(docs/limitations.md)")
    if kv_cache_format == "auto" and kv_cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"kv_cache must be float16, bfloat16, float32, float64 or float8_e4m3fn, got {kv_cache.dtype}")
    num_blocks, block_size = kv_cache.shape[-3], kv_cache.shape[-2]
    if plan.block_size != block_size:
        raise ValueError(f"plan was made for block_size {plan.block_size}, but kv_cache has {block_size}")
    max_block_id = planning.current_max_block_id(plan)
    if max_block_id >= num_blocks:
        raise ValueError(f"plan.block_table uses block {max_block_id}, past the {num_blocks} blocks of kv_cache")
    if plan.max_chunks is None and torch.compiler.is_compiling():
        checks.raise_value_error(
            "run_prefill under torch.compile needs a device plan (plan_prefill(..., max_chunks=K)): a host "
            "plan's chunks are Python values that would be baked into the graph"
        )
    checks.check_choice(backend, "backend", BACKENDS)
    if kv_cache_format != "auto" and k_scale is not None:
        raise ValueError(f"k_scale is for a per-tensor float8_e4m3fn kv_cache: {kv_cache_format} stores its own "
                         "scales (pass None)")
    checks.check_k_scale(k_scale, kv_cache, device)
    if slot_mapping is not None:
        check_slot_mapping(slot_mapping, kv_cache)
        if plan.num_tokens is not None and slot_mapping.shape[0] != plan.num_tokens:
            raise ValueError(f"plan was made for T={plan.num_tokens} tokens (its query_start_loc[-1]), but "
                             f"slot_mapping has {slot_mapping.shape[0]}")
    if index_cache is not None:
        check_index_step(plan, index_cache, k_scale_index, index_cache_format)
        if index_cache.shape[-3] != num_blocks:  # then the slots checked against kv_cache fit it too
            raise ValueError(f"index_cache must have the {num_blocks} blocks of kv_cache, got {index_cache.shape[-3]}")
    elif k_scale_index is not None:
        raise ValueError("k_scale_index is the scale of a float8 index_cache: pass index_cache too")
    elif index_cache_format != "auto":
        raise ValueError(f"index_cache_format={index_cache_format!r} describes an index_cache: pass index_cache too")
    if kv_cache_format != "auto" and backend == "flashmla":
        raise ValueError(f"backend='flashmla' does not read {kv_cache_format} caches through mla-ops yet: use "
                         "backend='auto' (Triton), 'triton' or 'torch'")
    kernels = backends.select(backend, device, plan.absorbed_query_bound)
    num_tokens = plan.num_tokens if slot_mapping is None else slot_mapping.shape[0]
    truncated = None if num_tokens is None else truncated_tokens(plan, num_tokens)
    suffix = None if num_tokens is None else suffix_tokens(plan, num_tokens)
    # The plan's block size (an int), not the cache's size it equals: under torch.compile that one is a symbol
    # the check above fixed, which a nested region cannot be handed.
    index_scale = None if index_cache is None else checks.k_scale_tensor(k_scale_index, index_cache)
    step = PrefillStep(plan, slot_mapping, checks.k_scale_tensor(k_scale, kv_cache), truncated, kernels,
                       (num_blocks, plan.block_size), kv_cache.dtype, num_tokens is not None, index_scale, suffix,
                       (kv_cache_format, index_cache_format))
    if plan.index_topk and num_tokens is not None and checks.values_readable(plan.query_start_loc):
        step._topk_rows = topk_rows(plan.query_start_loc, plan.context_lens, plan.sparse, num_tokens)
    return step


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

    ``kv_cache_format="fp8_ds_mla"``: ``kv_cache`` in vLLM's DeepSeek-V3.2 layout ([num_blocks, block_size,
    656] uint8, a float32 scale per 128 values; L = 512, R = 64; no ``k_scale``), see ``begin_step``.
    """
    step = begin_step(plan, kv_cache, k_scale=k_scale, backend=backend, kv_cache_format=kv_cache_format)
    return step.run(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, out=out, return_lse=return_lse,
                    topk_indices=topk_indices, v_head_dim=v_head_dim)


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
) -> torch.Tensor:
    """``plan_prefill`` + ``run_prefill`` in one call (see both).

    ``plan=``: a plan made once per step (then the planning arguments must be left at their
    defaults, and ``block_table``, ``query_start_loc``, ``context_lens`` must be the plan's).
    ``v_head_dim``: V, to check q's P+R against (``run_prefill``).
    """
    checks.check_tensor(q, "q", 3, "[T, N, P+R]")
    for name, x, ndim, doc in (("block_table", block_table, 2, "[B, max_blocks]"),
                               ("query_start_loc", query_start_loc, 1, "[B+1]"), ("context_lens", context_lens, 1, "[B]")):
        checks.check_tensor(x, name, ndim, doc, q.device, "q")
    checks.check_tensor(kv_cache, "kv_cache", 3, "[num_blocks, block_size, L+R]")
    loose = dict(workspace_size=workspace_size, policy=policy, split_alignment=split_alignment, max_chunks=max_chunks,
                 absorb_max_query_len=absorb_max_query_len, max_absorbed_tokens=max_absorbed_tokens)
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
                       kv_cache_format=kv_cache_format, v_head_dim=v_head_dim)
