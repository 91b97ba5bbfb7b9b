"""Greedy generation on the paged latent cache: ``Generator`` and ``mla_ops.generate`` (the command
line: ``mla_ops.serving.cli``).

Every step is one batched prefill with one plan (``mla_ops.plan_prefill``, from the Generator's
``PlanOptions``) shared by all layers: new prompts (minus what the prefix cache already holds) and,
as one-token prefills, the next token of every running sequence; the planner routes those to the
absorbed path (query length 1 with a context) unless the options' ``absorb_max_query_len`` says
otherwise. The block bookkeeping is ``mla_ops.serving.scheduler``'s, over a ``BlockManager``
(``mla_ops.serving.paged_cache``): full blocks are shared by content hash between the prompts of a
call and across calls, and freed when unused.

``compile=True`` runs each step through ``PrefillGraphs`` (``mla_ops.serving.graphs``), each step
padded to its bucket by the one padding contract of ``mla_ops.serving.buckets``, with a device plan;
a step beyond the buckets runs eagerly. The device plan has the packed schedule only
(``split_alignment=1``) and takes the options' routing. On a GPU the buckets are CUDA graphs,
captured for one cache tensor (pass ``num_blocks`` so that it never grows and is never recaptured);
elsewhere the model's layers are compiled regionally, once (``MLAModel.compile_layers``), and serve
every bucket, call and cache size: the cache may grow without a recompile.

A model across ranks (``MLAForCausalLM(..., context_parallel=cp)``, DESIGN §10) runs the same calls
on every rank: each rank's cache holds its context shard. The bookkeeping is the same on every rank,
from the global prompt lengths alone: a block id names ``block_size * D`` global tokens (local block
j of every rank holds global positions ``[j*block_size*D, (j+1)*block_size*D)``, ``block_size`` a
multiple of the interleave), so the ranks allocate, hash and reuse the same block ids and share one
block table; a new token's row is written by its owner only (``parallel.layout.slot_mapping``).
Every call all-gathers a fingerprint of its arguments first: ranks that disagree (or one that
refuses the call) raise a ValueError naming ``context_parallel`` on every rank, instead of hanging.

Arguments are checked before anything is written: a refused call (a bad prompt, token id,
``max_new_tokens`` or ``eos_token_id``, a fixed ``num_blocks`` too small for the call, or a cache
past the device's memory or int32 block ids) raises a TypeError or ValueError that names the
argument, allocates no cache, takes no block and leaves the prefix index as it was, so the
``Generator`` stays usable. The cache is allocated before the bookkeeping changes, so an allocation
that fails anyway leaves it usable too. A call that may pass ``max_position_embeddings`` warns.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .. import _checks as checks
from .._env import available_memory
from ..models.kv_caches import cache_widths, grown
from ..parallel import collectives
from ..planning.options import PlanOptions, options_from
from ..prefill import plan_with_options
from .graphs import PrefillGraphs, routed_options
from .paged_cache import BlockManager, CacheUsage
from .prompts import check_eos, check_prompts
from .scheduler import Request, Scheduler


@dataclass
class GenerationStats:
    """Counts of the last ``Generator.generate`` call."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose cache rows were reused, not recomputed
    generated_tokens: int = 0
    steps: int = 0
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class GeneratorSettings:
    """What a ``Generator`` was made with: ``generate`` keeps its per-model one while these match."""

    options: PlanOptions
    num_blocks: int | None
    compile: bool
    prefix_caching: bool


INT32_MAX = 2**31 - 1


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _settings(options, num_blocks, compile, prefix_caching, **loose) -> GeneratorSettings:
    """The checked settings of ``Generator`` / ``generate``: ``options`` (a ``PlanOptions``) or the
    loose planning keywords that build one, never both."""
    options = options_from(options, **loose)
    if options.max_chunks is not None:
        raise ValueError(f"options.max_chunks must be None, got {options.max_chunks}: eager steps plan on the "
                         "host, and compile=True picks each step's chunk capacity from its buckets")
    if num_blocks is not None:
        num_blocks = checks.check_positive_int(num_blocks, "num_blocks")
    checks.check_bool(compile, "compile")
    checks.check_bool(prefix_caching, "prefix_caching")
    if compile and (options.policy != "packed" or options.split_alignment != 1):
        raise ValueError(
            "options: compile=True plans each step on the device, which has the packed schedule only; got "
            f"policy={options.policy!r}, split_alignment={options.split_alignment} (use the defaults, or "
            "compile=False)"
        )
    return GeneratorSettings(options, num_blocks, compile, prefix_caching)


@dataclass(frozen=True)
class CacheSettings:
    """A ``Generator``'s caches: the dtype it allocates them in, and how they are stored (``allocate_kv_caches``'
    formats and scales, which travel in the caches' record to every step)."""

    dtype: torch.dtype | None  # None: the model's
    storage: dict  # kv_cache_format, index_cache_format, k_scale, k_scale_index


def _cache_settings(model, cache_dtype, k_scale, k_scale_index, kv_cache_format, index_cache_format) -> CacheSettings:
    """Checked once, at construction: formats the model's dims hold, scales where a float8 cache needs them."""
    from ..ops.cache import CACHE_DTYPES

    cache_widths(model.config, kv_cache_format, index_cache_format)  # refuses formats the model cannot hold
    if cache_dtype is not None and cache_dtype not in CACHE_DTYPES:
        raise TypeError(f"cache_dtype must be None or one of {CACHE_DTYPES}, got {cache_dtype!r}")
    device = model.lm_head.weight.device
    fp8 = cache_dtype == torch.float8_e4m3fn
    scales = {}
    for name, scale, packed, applies in (("k_scale", k_scale, kv_cache_format != "auto", True),
                                         ("k_scale_index", k_scale_index, index_cache_format != "auto",
                                          model.config.is_sparse)):
        if scale is not None:
            if not applies:
                raise ValueError(f"{name} is the scale of a sparse (index_topk) model's index cache; this model has none")
            if packed:
                raise ValueError(f"{name} is for a per-tensor float8_e4m3fn cache: the packed format stores its "
                                 "own scales (pass None)")
            checks.check_scale(scale, name, device)
        elif fp8 and applies and not packed:
            raise ValueError(f"cache_dtype=torch.float8_e4m3fn needs {name} (dequantized = stored * {name})")
        scales[name] = scale
    return CacheSettings(cache_dtype, dict(kv_cache_format=kv_cache_format, index_cache_format=index_cache_format,
                                           **scales))


class Generator:
    """A model, its paged latent cache and the prefix-cache index, kept across ``generate`` calls.

    A sparse (DSA) model's index cache lives beside the latent cache (``KVCaches.index``, same block ids): the
    prefix cache shares and evicts a block's rows in both, and every step is planned with the model's
    ``index_topk``.

    model: an ``MLAForCausalLM``. options: a ``PlanOptions``, how every step is planned (the routing
    included); or, instead, the loose keywords ``block_size``, ``workspace_size``,
    ``absorb_max_query_len`` and ``max_absorbed_tokens`` (``plan_prefill``'s meanings) that build
    one. num_blocks: cache blocks (None: as many as each call needs, the cache growing when a call
    needs more). compile=True: steps run through ``PrefillGraphs`` (module doc), planned on the
    device: the packed policy with ``split_alignment=1`` only. prefix_caching=False recomputes every
    prompt in full. The caches (``model.allocate_kv_caches``): ``cache_dtype`` (None: the model's; float8_e4m3fn
    needs ``k_scale``, and a sparse model's index cache ``k_scale_index``: dequantized = stored * scale), or
    vLLM's packed layouts ``kv_cache_format="fp8_ds_mla"`` / ``index_cache_format="fp8_per_token"`` (DESIGN
    §12), which keep their own scales.
    """

    def __init__(self, model, *, options: PlanOptions | None = None, block_size: int = 16,
                 num_blocks: int | None = None, workspace_size: int = 65536,
                 absorb_max_query_len: int | None = None, max_absorbed_tokens: int | None = None,
                 compile: bool = False, prefix_caching: bool = True, cache_dtype: torch.dtype | None = None,
                 k_scale: float | torch.Tensor | None = None, k_scale_index: float | torch.Tensor | None = None,
                 kv_cache_format: str = "auto", index_cache_format: str = "auto"):
        _check_model(model)
        self.cache = _cache_settings(model, cache_dtype, k_scale, k_scale_index, kv_cache_format, index_cache_format)
        self.settings = _settings(
            options, num_blocks, compile, prefix_caching, block_size=block_size, workspace_size=workspace_size,
            absorb_max_query_len=absorb_max_query_len, max_absorbed_tokens=max_absorbed_tokens)
        self.model = model
        self.context_parallel = cp = getattr(model, "context_parallel", None)
        self.options = self.settings.options  # every step's (routing: the default at the model's dims)
        if cp is None:
            self.options = routed_options(model.config, self.options)
        self.block_size, self.workspace_size = self.options.block_size, self.options.workspace_size
        self._layout = (cp.rank, cp.world_size, cp.interleave) if cp is not None else (0, 1, 1)
        self.compile = compile
        if num_blocks is not None:
            self._check_cache_fits(num_blocks, f"num_blocks={num_blocks}")
        self.manager = BlockManager(num_blocks or 1, self.block_size, prefix_caching)
        self.scheduler = Scheduler(self.manager, self._layout, self.settings.num_blocks)
        self.tokens_per_block = self.scheduler.tokens_per_block  # global tokens per block id
        self.kv_caches = None  # the model's allocate_kv_caches: a KVCaches
        self.stats = GenerationStats()
        self._fingerprint = None
        self._runner: PrefillGraphs | None = None  # compile=True: the step runner and the cache it was built for
        self._runner_caches: torch.Tensor | None = None
        self._call_sizes = (1, 1)  # compile=True: the token and request buckets a call needs

    # ---- the cache -------------------------------------------------------------------------------

    @property
    def cache_usage(self) -> CacheUsage:
        """The cache's blocks now: ``total``, ``in_use`` (held by a running sequence: 0 between calls),
        ``cached`` (prefixes kept for later prompts, evicted when needed) and ``free``."""
        return self.manager.usage()

    def _weights_fingerprint(self):
        """Cached rows are only valid for the weights that wrote them (moves and in-place writes show)."""
        return tuple((t.data_ptr(), t._version, t.dtype) for t in (*self.model.parameters(), *self.model.buffers()))

    def _cache_is_stale(self, fingerprint) -> tuple[bool, bool]:
        """(the prefix index is stale, the cache tensor must be reallocated): read only."""
        weight = self.model.lm_head.weight
        first = None if self.kv_caches is None else self.kv_caches.tensors[0]
        dtype = torch.uint8 if self.cache.storage["kv_cache_format"] != "auto" else self.cache.dtype or weight.dtype
        realloc = first is None or first.dtype != dtype or first.device != weight.device
        return realloc or fingerprint != self._fingerprint, realloc

    def _check_cache_fits(self, num_blocks: int, asked: str) -> None:
        """A cache of ``num_blocks`` blocks must fit the model's device (and its block ids an int32): what
        ``asked`` for one is refused by name, before anything changes, instead of failing in the allocation
        (or growing the bookkeeping to billions of blocks first)."""
        if num_blocks > INT32_MAX:
            raise ValueError(f"{asked} needs a cache of {num_blocks} blocks, past the int32 block ids of the block "
                             f"table ({INT32_MAX})")
        weight = self.model.lm_head.weight
        available = available_memory(weight.device)
        if available is None:
            return
        one_block = sum(t.numel() * t.element_size() for t in self._allocate(1, device="meta").tensors)
        if num_blocks * one_block > available:
            raise ValueError(f"{asked} needs a cache of {num_blocks} blocks of {self.block_size} rows "
                             f"({num_blocks * one_block / 2**30:.3g} GiB), more than the {available / 2**30:.3g} GiB "
                             f"available on {weight.device}")

    def _prepare_cache(self, fingerprint, extra: int) -> None:
        """The cache for this call: (re)allocated for the model's dtype and device, or grown by ``extra`` blocks
        (block ids, and the cached rows, latent and index, stay valid); the new tensors are allocated before
        anything else changes, so a failed allocation leaves the Generator as it was. Then a prefix index
        the weights made stale is forgotten."""
        stale, realloc = self._cache_is_stale(fingerprint)
        caches = self.kv_caches
        if realloc or extra:
            caches = self._allocate(self.manager.num_blocks + extra)
            if not realloc:
                caches = grown(self.kv_caches, caches)
        if stale:
            self.manager.clear_cache()
            self._fingerprint = fingerprint
        self.kv_caches = caches

    def _allocate(self, num_blocks: int, **where):
        """The model's caches of ``num_blocks`` blocks in this Generator's dtype and formats."""
        return self.model.allocate_kv_caches(num_blocks, self.block_size, self.cache.dtype, **where,
                                             **self.cache.storage)

    # ---- one step ------------------------------------------------------------------------------

    def _step_tensors(self, batch: list[Request], table_width: int):
        """A step's model inputs (the scheduler allocates the blocks its new tokens need)."""
        ids, positions, slots, table, qsl, ctx = self.scheduler.step_inputs(batch, table_width)
        device = self.kv_caches.tensors[0].device
        table = torch.from_numpy(table).to(device)
        input_ids, positions, slots = (torch.as_tensor(x, device=device) for x in (ids, positions, slots))
        qsl_t, ctx_t = torch.tensor(qsl, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32)
        return input_ids, positions, slots, table, qsl_t, ctx_t

    def _run_step(self, input_ids, positions, slots, table, qsl, ctx) -> list[int]:
        """The step's next token per sequence (greedy)."""
        if self.compile:
            hidden = self._graphs(table.shape[1])(input_ids, positions, self.kv_caches, slots, table, qsl, ctx)
        else:
            plan = plan_with_options(qsl, ctx, table, self.options, self.context_parallel)  # host plan, all layers
            hidden = self.model.model(input_ids, positions, self.kv_caches, slots, plan)
        last = (qsl[1:] - 1).to(hidden.device)
        return self.model.logits(hidden.index_select(0, last)).argmax(-1).tolist()

    def _graphs(self, max_blocks_per_request: int) -> PrefillGraphs:
        """The step runner of ``compile=True``: ``PrefillGraphs`` over the model (mode ``"cuda_graph"``
        on CUDA, ``"compile"`` elsewhere), sized for this call and kept while its cache and sizes hold."""
        runner, sizes = self._runner, self._call_sizes
        fits = runner is not None and (runner.regional or self._runner_caches is self.kv_caches) and \
            runner.buckets.tokens[-1] >= sizes[0] and runner.buckets.requests[-1] >= sizes[1] and \
            runner.max_blocks_per_request >= max_blocks_per_request
        if not fits:
            from ..lowering import enable

            enable()
            mode = "cuda_graph" if self.kv_caches.tensors[0].device.type == "cuda" else "compile"
            self._runner = PrefillGraphs(  # the device plan's K comes from the buckets
                self.model.model, max_tokens=sizes[0], max_requests=sizes[1],
                max_blocks_per_request=max_blocks_per_request, mode=mode, options=self.options)
            self._runner_caches = self.kv_caches
        return self._runner

    # ---- a call --------------------------------------------------------------------------------

    def _check_call(self, prompts, max_new_tokens, eos_token_id, callback):
        vocab_size = self.model.config.vocab_size
        prompts = check_prompts(prompts, vocab_size)
        max_new_tokens = checks.check_nonnegative_int(max_new_tokens, "max_new_tokens")
        stops = check_eos(eos_token_id, vocab_size)
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
        return prompts, max_new_tokens, stops

    def _check_ranks_agree(self, call) -> None:
        """Across ranks (context parallel): every rank must make the same call on the same state, or all
        raise; ``call`` None: this rank refused it (and raises its own error). One small all-gather of a
        digest of the call, the settings, the model's dtype and device type, the cache's geometry and
        the prefix cache's state: ranks that would compute different steps (or crash in a collective)
        are named instead."""
        if self.context_parallel is None:
            return
        weight = self.model.lm_head.weight
        caches = None if self.kv_caches is None else \
            tuple((tuple(t.shape), str(t.dtype)) for t in self.kv_caches.tensors)
        state = (call, self.settings, str(weight.dtype), weight.device.type, caches, self.manager.fingerprint())
        digest = hashlib.sha256(repr(state).encode()).digest()
        fingerprint = 0 if call is None else int.from_bytes(digest[:8], "little", signed=True) | 1
        every = collectives.gather_fingerprints(fingerprint, self.context_parallel.process_group)
        if call is None or len(set(every)) == 1:
            return
        refused = [r for r, f in enumerate(every) if f == 0]
        differ = [r for r, f in enumerate(every) if f not in (0, every[0])]
        why = f"rank(s) {refused} refused the call" if refused else \
            f"rank(s) {differ} passed other prompts, max_new_tokens, eos_token_id or settings than rank 0, or " \
            "hold the model in another dtype, another cache or another prefix cache state"
        raise ValueError(f"context_parallel: every rank must make the same generate call (this is rank "
                         f"{self._layout[0]}); {why}")

    def _agree_to_go_on(self, failure: BaseException | None) -> None:
        """Across ranks, once a step: every rank says whether it got here cleanly. A rank that raised
        (a callback, the scheduler) would otherwise leave the others blocked in the next step's
        collectives until the group's timeout; now every rank raises at once. One int64 all-gather."""
        if self.context_parallel is None:
            return
        every = collectives.gather_fingerprints(int(failure is None), self.context_parallel.process_group)
        failed = [r for r, ok in enumerate(every) if not ok]
        if failed and failure is None:
            raise RuntimeError(f"context_parallel: rank(s) {failed} raised during generate, so this rank "
                               f"({self._layout[0]}) stops too (see that rank's error)")

    def _plan_call(self, prompts: list[list[int]], max_new_tokens: int):
        """Read only: the call's requests, the weights' fingerprint, each prompt's cached prefix blocks, the
        blocks the call needs and the blocks the cache grows by. Refuses (ValueError naming ``num_blocks`` or
        ``max_new_tokens``) a call whose cache is past a fixed ``num_blocks``, the device's memory or int32 ids."""
        scheduler = self.scheduler
        requests = scheduler.requests(prompts)
        fingerprint = self._weights_fingerprint()
        stale, realloc = self._cache_is_stale(fingerprint)
        matches, need, available = scheduler.blocks_needed(requests, max_new_tokens, stale)
        extra = scheduler.growth(need, available)
        if realloc or extra:
            fixed = self.settings.num_blocks
            asked = f"max_new_tokens={max_new_tokens} with these prompts" if fixed is None else f"num_blocks={fixed}"
            self._check_cache_fits(self.manager.num_blocks + extra, asked)
        return requests, fingerprint, matches, need, extra

    def _warn_past_max_positions(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """A call that may feed the model positions past ``max_position_embeddings`` (the rotary tables and
        YaRN were made for those) runs, with one warning saying so."""
        limit, longest = self.model.config.max_position_embeddings, max(map(len, prompts))
        last = longest + max_new_tokens - 2  # the last token fed back: the final one never is
        if last >= limit:
            warnings.warn(f"generate: max_new_tokens={max_new_tokens} takes the longest prompt ({longest} "
                          f"tokens) to position {last}, past the model's max_position_embeddings={limit} (positions "
                          f"0..{limit - 1}): the tokens there are extrapolated, not what the model was trained for",
                          stacklevel=_caller_stacklevel())

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, eos_token_id=None,
                 callback: Callable[[GenerationStats], None] | None = None) -> list[list[int]]:
        """Greedy: up to ``max_new_tokens`` new token ids per prompt (fewer after ``eos_token_id``,
        which is kept). ``callback(stats)`` runs after every step.

        prompts: a non-empty list of prompts, each a non-empty list (or tuple) of int token ids in
        [0, vocab_size) (Python or numpy ints, not bools) or a 1-D integer tensor or array; the
        prompts are read, never modified. max_new_tokens: an int >= 0. eos_token_id: None, an int,
        a list/tuple/set of ints, or a 0-d/1-D integer tensor of them. Refused calls change
        nothing (module doc)."""
        try:
            prompts, max_new_tokens, stops = self._check_call(prompts, max_new_tokens, eos_token_id, callback)
            call = self._plan_call(prompts, max_new_tokens) if max_new_tokens else None  # the last refusals
        except (TypeError, ValueError):
            self._check_ranks_agree(None)  # the other ranks must not wait for this one
            raise
        self._check_ranks_agree((prompts, max_new_tokens, sorted(stops)))
        outputs: list[list[int]] = [[] for _ in prompts]
        self.stats = stats = GenerationStats(prompt_tokens=sum(map(len, prompts)))
        if call is None:
            return outputs
        self._warn_past_max_positions(prompts, max_new_tokens)
        scheduler = self.scheduler
        requests, fingerprint, matches, need, extra = call
        start = time.perf_counter()
        try:
            self._prepare_cache(fingerprint, extra)  # allocates first: nothing has changed if that fails
            scheduler.reserve(requests, matches, need)  # grows the bookkeeping by the same ``extra`` blocks
            table_width = _next_pow2(math.ceil((max(map(len, prompts)) + max_new_tokens) / self.tokens_per_block))
            # The first step runs every prompt (less its cached prefix), the others a token a sequence.
            self._call_sizes = (max(16, _next_pow2(stats.prompt_tokens)), _next_pow2(len(prompts)))
            failure = None
            while True:  # one agreement a step across ranks, the last when every sequence is done
                if failure is None:
                    try:
                        finished = all(request.done for request in requests)
                        if not finished:
                            order, cached = scheduler.next_batch(requests)
                            batch = [requests[i] for i in order]
                            inputs = self._step_tensors(batch, table_width)
                    except Exception as error:
                        failure = error
                self._agree_to_go_on(failure)
                if failure is not None:
                    raise failure
                if finished:
                    break
                tokens = self._run_step(*inputs)
                try:
                    stats.cached_tokens += cached
                    for i, request, token in zip(order, batch, tokens):
                        outputs[i].append(token)
                        scheduler.append(request, token, done=len(outputs[i]) == max_new_tokens or token in stops)
                    stats.steps += 1
                    stats.generated_tokens = sum(map(len, outputs))
                    stats.seconds = time.perf_counter() - start
                    if callback is not None:
                        callback(stats)
                except Exception as error:
                    failure = error
        finally:
            for request in requests:
                scheduler.release(request)
        return outputs


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of a warning raised here that points at the first frame outside mla_ops and torch
    (``torch.no_grad`` wraps ``generate``; ``mla_ops.generate`` calls it)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("mla_ops", "torch"):
        frame, level = frame.f_back, level + 1
    return level


def _check_model(model) -> None:
    if not (isinstance(model, torch.nn.Module) and hasattr(model, "model") and hasattr(model, "lm_head")
            and hasattr(model, "config")):
        raise TypeError(f"model must be an MLAForCausalLM (a model and its lm_head), got {type(model).__name__}")


# One Generator per model, so the prefix cache lives across calls. Key: the model object (weakly)
# and the settings; a call with other settings replaces it, changed weights clear its index.
_generators: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, options: PlanOptions | None = None,
             block_size: int = 16, num_blocks: int | None = None, workspace_size: int = 65536,
             absorb_max_query_len: int | None = None, max_absorbed_tokens: int | None = None,
             compile: bool = False, eos_token_id=None) -> list[list[int]]:
    """Greedy generation: one list of ``max_new_tokens`` new token ids per prompt (module doc).

    model: an ``MLAForCausalLM``; prompts: lists of token ids (``Generator.generate`` lists what is
    accepted); the settings are ``Generator``'s. The paged cache and its prefix index are kept per
    model between calls (``Generator`` gives explicit control and statistics); a refused call keeps
    the one there was.
    """
    _check_model(model)
    settings = _settings(
        options, num_blocks, compile, True, block_size=block_size, workspace_size=workspace_size,
        absorb_max_query_len=absorb_max_query_len, max_absorbed_tokens=max_absorbed_tokens)
    generator = _generators.get(model)
    if generator is None or generator.settings != settings:
        generator = Generator(model, options=settings.options, num_blocks=num_blocks, compile=compile)
    outputs = generator.generate(prompts, max_new_tokens, eos_token_id=eos_token_id)
    _generators[model] = generator  # only once the call was accepted
    return outputs
