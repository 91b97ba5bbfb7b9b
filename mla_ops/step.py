"""``begin_step`` and ``PrefillStep``: a step's attention set up once, then run by every layer.

An engine plans a step (``plan_prefill``), begins it once against its caches (``begin_step``) and runs it in
every layer (``PrefillStep.run``; ``attend`` where the engine writes its own rows). What depends only on the
step is checked and made once, in ``begin_step``, so a layer's call checks only that layer's tensors (and
its own ``k_scale``: engines keep one per layer) and launches only that layer's work: the causal suffix
attention, the context partial (``chunk_loop``, or ``parallel.run``) and their merge; in a DeepSeek Sparse
Attention step, the sparse requests' tokens are then overwritten by their attention over the selected keys
(``ops/sparse.py``). The step is frozen, so no layer can change what the next one sees, and it is a pytree,
so a nested compile region (``mla_ops.models.regions``) takes it as input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _checks as checks
from .chunk_loop import LayerCall, device_context, host_context, suffix_tokens, truncated_tokens
from .ops import backends
from .ops.backends import BACKENDS
from .ops import cache as cache_writes
from .ops.cache import CACHE_DTYPES, check_slot_mapping, check_write_rows, write_checked
from .ops.cache_formats import check_index_format, check_latent_format
from .ops.indexer import check_index_layer, check_index_step, index_topk_checked
from .ops.layer_checks import check_layer
from .ops.masked_mha import attend_selected
from .ops.sinks import add_sinks, check_sinks
from .ops.sparse import check_topk_indices, check_topk_values, topk_rows
from .parallel.run import run_context_parallel
from .planning import plan as planning
from .planning.plan import PrefillPlan, register_plan_pytree

LATENT, INDEX = ("k_scale", "kv_cache"), ("k_scale_index", "index_cache")  # a scale's name, its cache's


@dataclass(frozen=True, eq=False)
class PrefillStep:
    """A step's attention, set up once for every layer by ``begin_step`` (module doc); its fields are made
    there and never change. ``run`` is one layer's call."""

    plan: PrefillPlan
    slot_mapping: torch.Tensor | None  # [T]: where each new token's rows go; None: the layers write nothing
    k_scale: torch.Tensor | None  # [1] float32: a float8_e4m3fn cache's scale for layers that pass none
    k_scale_index: torch.Tensor | None  # [1] float32: a float8 index cache's, likewise
    cache_blocks: tuple[int, int]  # (num_blocks, block_size) every layer's latent cache has
    truncated: torch.Tensor | None  # [T] bool, chunk_loop.truncated_tokens (where tokens_known)
    suffix_tokens: torch.Tensor | None  # [T'] chunk_loop.suffix_tokens (where tokens_known)
    # DSA: the requests whose tokens the sparse op writes; those the device plan truncated keep the NaN that
    # mark_truncated gave them. And what a layer's topk_indices are checked against (CPU, T known: else None).
    sparse_rows: torch.Tensor | None
    topk_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # Static (the pytree's context): the kernels, the caches' dtype and formats, and whether T was known at
    # begin_step (a device plan without slots: each layer makes truncated / suffix_tokens for its own T).
    kernels: backends.Kernels
    cache_dtype: torch.dtype
    tokens_known: bool
    kv_cache_format: str = "auto"
    index_cache_format: str = "auto"
    index_dtype: torch.dtype | None = None  # the dtype of the index cache begin_step checked; None: none given

    def attend(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
               kv_b_proj_weight: torch.Tensor, softmax_scale: float, *, k_scale: float | torch.Tensor | None = None,
               out: torch.Tensor | None = None, return_lse: bool = False, topk_indices: torch.Tensor | None = None,
               v_head_dim: int | None = None, sinks: torch.Tensor | None = None):
        """One layer's attention, no cache write: the new tokens' rows ``kv_c``, ``k_pe`` are read as given, the
        context's from ``kv_cache``. Returns ``out`` [T, N, V], or ``(out, lse)`` with ``return_lse=True``
        (``lse`` [N, T], float32 or float64 for float64 q, natural log). ``k_scale``: this layer's scale of a
        float8_e4m3fn cache (a float or a one-element float32 tensor), in place of the step's. ``topk_indices``
        [T, index_topk] int32: required with a DSA plan, refused without one (see ``run_prefill``).
        ``v_head_dim``: V, to check q's P+R against (see ``run_prefill``). ``sinks`` [N] float32: each head's sink
        logit, one more term in every softmax (``ops/sinks.py``; ``lse`` includes it). Checks only this layer's
        tensors."""
        call = self._layer_call(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, k_scale, out, return_lse,
                                topk_indices, v_head_dim, sinks)
        return self._attend(call, kv_c, k_pe, topk_indices, out, return_lse, sinks)

    def run(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
            kv_b_proj_weight: torch.Tensor, softmax_scale: float, *, k_scale: float | torch.Tensor | None = None,
            out: torch.Tensor | None = None, return_lse: bool = False, topk_indices: torch.Tensor | None = None,
            v_head_dim: int | None = None, sinks: torch.Tensor | None = None):
        """``attend``, then the layer's new rows written into ``kv_cache`` at the step's slots (where the step
        has a slot mapping), with the same ``k_scale``. Everything is checked before anything is written."""
        call = self._layer_call(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, k_scale, out, return_lse,
                                topk_indices, v_head_dim, sinks)
        result = self._attend(call, kv_c, k_pe, topk_indices, out, return_lse, sinks)
        if self.slot_mapping is not None:  # after the attention, which takes the new rows as given
            write_checked(kv_c, k_pe, self.slot_mapping, kv_cache, call.k_scale, self.kv_cache_format)
        return result

    def write(self, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, *,
              k_scale: float | torch.Tensor | None = None) -> None:
        """A layer's new rows into ``kv_cache`` at the step's slots (nothing without a slot mapping), stored with
        the layer's ``k_scale`` (or the step's). Everything is checked before anything is written."""
        self._check_cache(kv_cache)
        scale = self._layer_scale(k_scale, kv_cache, self.k_scale, self.kv_cache_format, LATENT)
        if self.slot_mapping is not None:
            check_write_rows(kv_c, k_pe, self.slot_mapping, kv_cache, cache_writes.LATENT, self.kv_cache_format)
            write_checked(kv_c, k_pe, self.slot_mapping, kv_cache, scale, self.kv_cache_format)

    def write_layers(self, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_caches: torch.Tensor, first: int, *,
                     k_scale: float | torch.Tensor | None = None) -> None:
        """The new rows of several layers at once, ``kv_c`` [n, T, L] and ``k_pe`` [n, T, R], into layers
        ``first`` .. ``first + n - 1`` of ``kv_caches``, one stacked tensor [layers, num_blocks, block_size, L+R],
        at the step's slots: one write, the stack read as one cache of ``layers * num_blocks`` blocks (a stacked
        model's run of layers, ``mla_ops.models.stacking``). ``k_scale``: the layers' one scale, as in ``write``."""
        checks.check_tensor(kv_caches, "kv_caches", 4, "[layers, num_blocks, block_size, L+R]", self.plan.device,
                            "plan")
        checks.check_tensor(kv_c, "kv_c", 3, "[n, T, L]", self.plan.device, "plan")
        checks.check_tensor(k_pe, "k_pe", 3, "[n, T, R]", self.plan.device, "plan")
        if not isinstance(first, int) or isinstance(first, bool):
            raise TypeError(f"first must be an int, got {type(first).__name__}")
        count = kv_c.shape[0]
        if k_pe.shape[:2] != kv_c.shape[:2]:
            raise ValueError(f"k_pe must have kv_c's layers and tokens {tuple(kv_c.shape[:2])}, got "
                             f"{tuple(k_pe.shape[:2])}")
        if not 0 <= first <= first + count <= kv_caches.shape[0]:
            raise ValueError(f"layers {first}..{first + count - 1} are not all in kv_caches ({kv_caches.shape[0]} "
                             "layers)")
        self._check_cache(kv_caches.select(0, first))
        if not kv_caches.is_contiguous():
            raise ValueError("kv_caches must be contiguous: its layers are written as one cache")
        cache = kv_caches.flatten(0, 1)  # a view at offset 0: every layer's blocks, in order
        scale = self._layer_scale(k_scale, cache, self.k_scale, self.kv_cache_format, LATENT)
        if self.slot_mapping is not None:
            per_layer = kv_caches.shape[1] * kv_caches.shape[2]
            offsets = torch.arange(first, first + count, device=kv_c.device).unsqueeze(1) * per_layer
            slots = torch.where(self.slot_mapping >= 0, self.slot_mapping + offsets, -1).flatten()
            rows, rope = kv_c.flatten(0, 1), k_pe.flatten(0, 1)
            check_write_rows(rows, rope, slots, cache, cache_writes.LATENT, self.kv_cache_format)
            write_checked(rows, rope, slots, cache, scale, self.kv_cache_format)

    def select(self, q_index: torch.Tensor, index_weights: torch.Tensor, k_index: torch.Tensor,
               index_cache: torch.Tensor, *, k_scale_index: float | torch.Tensor | None = None) -> torch.Tensor:
        """One DSA layer's top-k (``mla_ops.index_topk``) on the step its index cache was checked for once
        (``begin_step(..., index_cache=)``): only this layer's tensors (and its own ``k_scale_index``, in place of
        the step's) are checked here, its index cache against the one the step began with."""
        self._check_index_cache(index_cache, "select")
        check_index_layer(q_index, index_weights, k_index, index_cache, self.plan, self.index_cache_format)
        scale = self._layer_scale(k_scale_index, index_cache, self.k_scale_index, self.index_cache_format, INDEX)
        return index_topk_checked(q_index, index_weights, k_index, index_cache, self.plan, scale)

    def write_index(self, k_index: torch.Tensor, index_cache: torch.Tensor, *,
                    k_scale_index: float | torch.Tensor | None = None) -> None:
        """A DSA layer's new index keys into ``index_cache`` at the step's slots (nothing without a slot
        mapping), stored with the layer's ``k_scale_index`` (or the step's). Everything is checked before anything
        is written."""
        self._check_index_cache(index_cache, "write_index")
        scale = self._layer_scale(k_scale_index, index_cache, self.k_scale_index, self.index_cache_format, INDEX)
        if self.slot_mapping is not None:
            check_write_rows(k_index, None, self.slot_mapping, index_cache, cache_writes.INDEX, self.index_cache_format)
            write_checked(k_index, k_index[:, :0], self.slot_mapping, index_cache, scale, self.index_cache_format)

    def _attend(self, call: LayerCall, kv_c, k_pe, topk_indices, out, return_lse, sinks=None):
        suffix_out, suffix_lse = call.suffix(kv_c, k_pe)
        if self.plan.context_parallel is not None:  # a sharded cache
            result, lse = run_context_parallel(call, suffix_out, suffix_lse)
        elif self.plan.max_chunks is not None:
            result, lse = device_context(call, suffix_out, suffix_lse)
        else:
            result, lse = host_context(call, suffix_out, suffix_lse)
        if self.sparse_rows is not None:
            # The dense paths gave the sparse requests' tokens the empty partial (their context is in no dense
            # schedule, their suffix not run: LayerCall.suffix): overwritten here, in the merged result, which no
            # one else holds.
            # Each request by absorbed sparse attention or top-k-masked MHA, the cost model's pick (ops/masked_mha.py).
            attend_selected(call, kv_c, k_pe, self.sparse_rows, topk_indices, result, lse)
        if sinks is not None:  # one more term in every softmax: once, after every merge (ops/sinks.py)
            result, lse = add_sinks(result, lse, sinks)
        if out is not None:
            result = out.copy_(result)
        return (result, lse) if return_lse else result

    def _layer_call(self, q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, k_scale, out, return_lse,
                    topk_indices, v_head_dim, sinks) -> LayerCall:
        """One layer's tensors checked against each other and the step, before anything runs; its call."""
        dims = check_layer(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, device=self.plan.device,
                           device_of="plan", packed=self.kv_cache_format == "fp8_ds_mla", v_head_dim=v_head_dim,
                           out=out)
        self._check_cache(kv_cache)
        checks.check_bool(return_lse, "return_lse")
        check_sinks(sinks, dims.num_heads, self.plan.device, "plan")
        num_tokens = q.shape[0]
        if self.plan.num_tokens is not None and self.plan.num_tokens != num_tokens:
            raise ValueError(f"plan was made for T={self.plan.num_tokens} tokens (its query_start_loc[-1]), but q has "
                             f"{num_tokens}")
        if self.slot_mapping is not None and self.slot_mapping.shape[0] != num_tokens:
            raise ValueError(f"slot_mapping has {self.slot_mapping.shape[0]} entries, but q has {num_tokens} tokens")
        scale = self._layer_scale(k_scale, kv_cache, self.k_scale, self.kv_cache_format, LATENT)
        self._check_topk(topk_indices, num_tokens)
        if isinstance(self.kernels.absorbed_context_attention, backends.FlashMLAStep):
            self.kernels.absorbed_context_attention.check_heads(dims.num_heads)
        truncated, suffix = self.truncated, self.suffix_tokens
        if not self.tokens_known:
            truncated, suffix = truncated_tokens(self.plan, num_tokens), suffix_tokens(self.plan, num_tokens)
        return LayerCall(self.kernels, dims, q, kv_cache, kv_b_proj_weight, float(softmax_scale), scale, self.plan,
                         truncated, suffix)

    def _check_cache(self, kv_cache) -> None:
        """A layer's latent cache: shaped like the cache the step began with (its blocks and dtype), laid out as
        the step's format says."""
        checks.check_tensor(kv_cache, "kv_cache", 3, "[num_blocks, block_size, L+R]", self.plan.device, "plan")
        self._check_blocks(kv_cache, "kv_cache", self.cache_dtype)
        check_latent_format(self.kv_cache_format, kv_cache)

    def _check_index_cache(self, index_cache, call: str) -> None:
        """A DSA layer's index cache (for ``call``): the step is a DSA step begun with an index cache, and this
        one is shaped like it (the latent cache's blocks, its dtype), laid out as the step's format says."""
        if not self.plan.index_topk:
            raise ValueError(f"{call} is a DeepSeek Sparse Attention step's call, but plan was made without "
                             "index_topk: plan the step with plan_prefill(..., index_topk=K)")
        if self.index_dtype is None:
            raise ValueError(f"{call} reads the index cache the step was checked for: begin the step with "
                             "begin_step(..., index_cache=) (one layer's)")
        checks.check_tensor(index_cache, "index_cache", 3, "[num_blocks, block_size, D_I]", self.plan.device, "plan")
        self._check_blocks(index_cache, "index_cache", self.index_dtype)
        check_index_format(self.index_cache_format, index_cache)

    def _check_blocks(self, cache, name: str, dtype: torch.dtype) -> None:
        """``cache`` (``name``) has the step's blocks (the latent cache's ``(num_blocks, block_size)``, which the
        index cache shares) and ``dtype``, the dtype of the cache of its kind the step began with."""
        if cache.dtype != dtype or tuple(cache.shape[:2]) != self.cache_blocks:
            raise ValueError(
                f"{name} ({tuple(cache.shape)} {cache.dtype}) is not shaped like the cache the step began "
                f"with ({self.cache_blocks} blocks of {dtype}): pass that cache (or one layer of it)")

    def _layer_scale(self, k_scale, cache, step_scale, cache_format: str, names: tuple[str, str]):
        """A layer's scale as the kernels take it: its own (checked as ``begin_step`` checks the step's), else
        the step's; a float8_e4m3fn cache needs one of them."""
        scale = step_scale if k_scale is None else checked_scale(k_scale, cache, cache_format, self.plan.device, names)
        if scale is None and cache.dtype == torch.float8_e4m3fn:
            name, cache_name = names
            raise ValueError(f"{name} is required for a float8_e4m3fn {cache_name} (dequantized = stored * {name}): "
                             f"pass the layer's {name}= (or begin the step with one)")
        return scale

    def _check_topk(self, topk_indices, num_tokens: int) -> None:
        """``topk_indices``: with a DSA plan and only there, ``[T, index_topk]`` int32 on the plan's device,
        its sparse requests' entries in ``-2 .. c_r + q_r - 1`` where readable (CPU)."""
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
        check_topk_values(topk_indices, plan.query_start_loc, plan.context_lens, plan.sparse, self.topk_rows)


# A pytree, as a nested compile region's input must be: tensors and the cache's sizes are leaves, the rest context.
register_plan_pytree(PrefillStep, static=("kernels", "cache_dtype", "tokens_known", "kv_cache_format",
                                          "index_cache_format", "index_dtype"))


def checked_scale(k_scale, cache: torch.Tensor, cache_format: str, device: torch.device,
                  names: tuple[str, str] = LATENT) -> torch.Tensor | None:
    """A per-tensor float8 scale given for ``cache`` (a float, or a one-element float32 tensor on ``device``),
    checked and as the kernels take it: [1] float32 for a float8_e4m3fn cache, None for other dtypes (and for
    None). A packed format stores its own scales: refused there."""
    if k_scale is None:
        return None
    name, cache_name = names
    if cache_format != "auto":
        raise ValueError(f"{name} is for a per-tensor float8_e4m3fn {cache_name}: {cache_format} stores its own "
                         "scales (pass None)")
    checks.check_scale(k_scale, name, device)
    return checks.k_scale_tensor(k_scale, cache)


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
    (dequantized = stored * k_scale) for the layers that pass none of their own (an engine with a scale
    per layer passes each to the layer's call and none here); ignored for other cache dtypes. ``backend``:
    see ``run_prefill``. ``index_cache``: a DSA step's index cache ``[num_blocks, block_size, D_I]`` (one
    layer's: every layer's shares its geometry), with ``k_scale_index`` as ``k_scale``, for the step's
    ``select`` and ``write_index``. Checks, once: the plan's fit with the caches (block size, the block
    ids the contexts use, where readable), the slots (by value where readable), the scales and the backend.
    ``kv_cache_format`` / ``index_cache_format``: ``"auto"`` (the caches above) or vLLM's packed layouts,
    ``"fp8_ds_mla"`` (``kv_cache`` [.., num_blocks, block_size, 656] uint8) and ``"fp8_per_token"``
    (``index_cache`` [num_blocks, block_size, D_I + D_I/128*4] uint8), which store their own scales
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
    k_scale = checked_scale(k_scale, kv_cache, kv_cache_format, device)
    if slot_mapping is not None:
        check_slot_mapping(slot_mapping, kv_cache)
        if plan.num_tokens is not None and slot_mapping.shape[0] != plan.num_tokens:
            raise ValueError(f"plan was made for T={plan.num_tokens} tokens (its query_start_loc[-1]), but "
                             f"slot_mapping has {slot_mapping.shape[0]}")
    if index_cache is not None:
        check_index_step(plan, index_cache, k_scale_index, index_cache_format)
        if index_cache.shape[-3] != num_blocks:  # then the slots checked against kv_cache fit it too
            raise ValueError(f"index_cache must have the {num_blocks} blocks of kv_cache, got {index_cache.shape[-3]}")
        k_scale_index = None if k_scale_index is None else checks.k_scale_tensor(k_scale_index, index_cache)
    elif k_scale_index is not None:
        raise ValueError("k_scale_index is the scale of a float8 index_cache: pass index_cache too")
    elif index_cache_format != "auto":
        raise ValueError(f"index_cache_format={index_cache_format!r} describes an index_cache: pass index_cache too")
    if plan.sliding_window and backend == "flashmla":
        raise ValueError("backend='flashmla' has no sliding window: plan the step without sliding_window, or use "
                         "backend='auto' (Triton), 'triton' or 'torch'")
    if kv_cache_format != "auto" and backend == "flashmla":
        raise ValueError(f"backend='flashmla' does not read {kv_cache_format} caches through mla-ops yet: use "
                         "backend='auto' (Triton), 'triton' or 'torch'")
    kernels = backends.select(backend, device, plan.absorbed_query_bound)
    num_tokens = plan.num_tokens if slot_mapping is None else slot_mapping.shape[0]
    known = num_tokens is not None
    sparse_rows = rows = None
    if plan.index_topk:
        sparse_rows = plan.sparse if plan.truncated is None else plan.sparse & ~plan.truncated
        if known and checks.values_readable(plan.query_start_loc):
            rows = topk_rows(plan.query_start_loc, plan.context_lens, plan.sparse, num_tokens)
    # The plan's block size (an int), not the cache's size it equals: under torch.compile that one is a symbol
    # the check above fixed, which a nested region cannot be handed.
    return PrefillStep(plan, slot_mapping, k_scale, k_scale_index, (num_blocks, plan.block_size),
                       truncated_tokens(plan, num_tokens) if known else None,
                       suffix_tokens(plan, num_tokens) if known else None, sparse_rows, rows, kernels, kv_cache.dtype,
                       known, kv_cache_format, index_cache_format,
                       None if index_cache is None else index_cache.dtype)
