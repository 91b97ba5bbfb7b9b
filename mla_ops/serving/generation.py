"""Greedy generation on the paged latent cache: ``mla_ops.generate`` and ``python -m mla_ops generate``.

Every step is one batched prefill with one plan (``mla_ops.plan_prefill``) shared by all layers:
new prompts (minus what the prefix cache already holds) and, as one-token prefills, the next token
of every running sequence; the planner routes those to the absorbed path (query length 1 with a
context). The cache is a ``BlockManager`` (``mla_ops.serving.paged_cache``): full blocks are shared by
content hash between the prompts of a call and across calls (a prompt whose next block another
prompt of the same step is computing waits one step and then reuses it), and freed when unused.

``compile=True`` runs each step through ``PrefillGraphs`` (``mla_ops.serving.graphs``), each step
padded to its bucket by the one padding contract of ``mla_ops.serving.buckets``, with a device plan;
a step beyond the buckets runs eagerly. On a GPU the buckets are CUDA graphs, captured for one
cache tensor (pass ``num_blocks`` so that it never grows and is never recaptured); elsewhere the
model's layers are compiled regionally, once (``MLAModel.compile_layers``), and serve every bucket,
call and cache size: the cache may grow without a recompile.

A model across ranks (``MLAForCausalLM(..., context_parallel=cp)``, DESIGN §10) runs the same calls
on every rank: each rank's cache holds its context shard. The bookkeeping is the same on every rank,
from the global prompt lengths alone: a block id names ``block_size * D`` global tokens (local block
j of every rank holds global positions ``[j*block_size*D, (j+1)*block_size*D)``, ``block_size`` a
multiple of the interleave), so the ranks allocate, hash and reuse the same block ids and share one
block table; a new token's row is written by its owner only (``parallel.layout.slot_mapping``).
Every call all-gathers a fingerprint of its arguments first: ranks that disagree (or one that
refuses the call) raise a ValueError naming ``context_parallel`` on every rank, instead of hanging.

Arguments are checked before anything is written: a refused call (a bad prompt, token id,
``max_new_tokens`` or ``eos_token_id``, or a fixed ``num_blocks`` too small for the call) raises
a TypeError or ValueError that names the argument, allocates no cache, takes no block and leaves
the prefix index as it was, so the ``Generator`` stays usable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from .. import _checks as checks
from ..parallel import collectives
from ..parallel.layout import slot_mapping, tokens_per_block
from ..planning.options import PlanOptions
from ..prefill import plan_with_options
from .graphs import PrefillGraphs
from .paged_cache import BlockManager, block_hashes, chain_hash


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


@dataclass
class _RunningRequest:
    tokens: list[int]
    prompt_len: int
    hashes: list[bytes]  # names of the prompt's full blocks
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose rows are in the cache
    num_registered: int = 0  # leading full blocks registered in the prefix cache
    max_hits: int = 0  # cached blocks it may reuse: the last prompt token is always computed
    admitted: bool = False
    done: bool = False


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class Generator:
    """A model, its paged latent cache and the prefix-cache index, kept across ``generate`` calls.

    model: an ``MLAForCausalLM``. num_blocks: cache blocks (None: as many as each call needs, the
    cache growing when a call needs more). compile=True: steps run through ``PrefillGraphs``
    (module doc). prefix_caching=False recomputes every prompt in full.
    """

    def __init__(self, model, *, block_size: int = 16, num_blocks: int | None = None,
                 workspace_size: int = 65536, compile: bool = False, prefix_caching: bool = True):
        _check_model(model)
        if num_blocks is not None:
            num_blocks = checks.check_positive_int(num_blocks, "num_blocks")
        self.options = PlanOptions(block_size, workspace_size)  # the host plans of eager steps; checks both
        _check_bool(compile, "compile")
        _check_bool(prefix_caching, "prefix_caching")
        self.model = model
        self.block_size, self.workspace_size = self.options.block_size, self.options.workspace_size
        self.context_parallel = cp = getattr(model, "context_parallel", None)
        self._layout = (cp.rank, cp.world_size, cp.interleave) if cp is not None else (0, 1, 1)
        self.tokens_per_block = tokens_per_block(self.block_size, *self._layout[1:])  # global tokens per block id
        self.compile = compile
        self.fixed_num_blocks = num_blocks
        self.manager = BlockManager(num_blocks or 1, self.block_size, prefix_caching)
        self.kv_caches: torch.Tensor | None = None
        self.stats = GenerationStats()
        self._fingerprint = None
        self._runner: PrefillGraphs | None = None  # compile=True: the step runner and the cache it was built for
        self._runner_caches: torch.Tensor | None = None
        self._call_sizes = (1, 1)  # compile=True: the token and request buckets a call needs
        self.settings = (self.block_size, num_blocks, self.workspace_size, compile, prefix_caching)

    # ---- the cache -------------------------------------------------------------------------------

    def _weights_fingerprint(self):
        """Cached rows are only valid for the weights that wrote them (moves and in-place writes show)."""
        return tuple((t.data_ptr(), t._version, t.dtype) for t in (*self.model.parameters(), *self.model.buffers()))

    def _cache_is_stale(self, fingerprint) -> tuple[bool, bool]:
        """(the prefix index is stale, the cache tensor must be reallocated): read only."""
        weight = self.model.lm_head.weight
        realloc = self.kv_caches is None or self.kv_caches.dtype != weight.dtype or \
            self.kv_caches.device != weight.device
        return realloc or fingerprint != self._fingerprint, realloc

    def _refresh_cache(self, fingerprint) -> None:
        """Forget the index if the weights changed; (re)allocate the cache for the model's dtype and device."""
        stale, realloc = self._cache_is_stale(fingerprint)
        if stale:
            self.manager.clear_cache()
            self._fingerprint = fingerprint
        if realloc:
            self.kv_caches = self.model.allocate_kv_caches(self.manager.num_blocks, self.block_size)

    def _ensure_capacity(self, need: int) -> None:
        if need <= self.manager.num_available:
            return
        if self.fixed_num_blocks is not None:
            raise ValueError(
                f"num_blocks={self.fixed_num_blocks} is too small: this call needs {need} more blocks of "
                f"{self.tokens_per_block} tokens, {self.manager.num_available} are available"
            )
        extra = max(need - self.manager.num_available, self.manager.num_blocks // 2)
        self.manager.grow(extra)
        grown = self.model.allocate_kv_caches(self.manager.num_blocks, self.block_size)
        grown[:, : self.kv_caches.shape[1]] = self.kv_caches  # block ids (and cached rows) stay valid
        self.kv_caches = grown

    def _blocks_needed(self, seqs: list[_RunningRequest], max_new_tokens: int, stale: bool):
        """Read only: each prompt's cached prefix blocks (none if the index is ``stale``), the new
        blocks the call needs beyond them, and the blocks available once those prefixes are pinned."""
        bs = self.tokens_per_block
        seen: set[bytes] = set()
        need, matches = 0, []
        for seq in seqs:
            seq.max_hits = (seq.prompt_len - 1) // bs
            blocks = [] if stale else self.manager.match(seq.hashes[: seq.max_hits])
            matches.append(blocks)
            shared = len(blocks)  # plus the blocks an earlier prompt of this call computes first
            while self.manager.prefix_caching and shared < seq.max_hits and seq.hashes[shared] in seen:
                shared += 1
            seen.update(seq.hashes)
            need += math.ceil((seq.prompt_len + max_new_tokens) / bs) - shared
        pinned = {block for blocks in matches for block in blocks if self.manager.ref_count(block) == 0}
        return matches, need, self.manager.num_available - len(pinned)

    def _check_capacity(self, need: int, available: int) -> None:
        if self.fixed_num_blocks is not None and need > available:
            raise ValueError(
                f"num_blocks={self.fixed_num_blocks} is too small: this call needs {need} more blocks of "
                f"{self.tokens_per_block} tokens, {available} are available"
            )

    def _reserve(self, seqs: list[_RunningRequest], matches: list[list[int]], need: int) -> None:
        """Pin every prompt's cached prefix (no allocation of this call can evict it), then make
        sure the rest of the call fits."""
        for seq, blocks in zip(seqs, matches):
            seq.blocks = list(blocks)
            for block in blocks:
                self.manager.acquire(block)
        self._ensure_capacity(need)

    def _admit(self, seq: _RunningRequest, pending: set[bytes]) -> bool:
        """Take what the cache holds now; wait a step if another prompt is computing the next block."""
        more = self.manager.match(seq.hashes[: seq.max_hits])[len(seq.blocks) :]
        for block in more:
            self.manager.acquire(block)
        seq.blocks += more
        hits = len(seq.blocks)
        if self.manager.prefix_caching and hits < seq.max_hits and seq.hashes[hits] in pending:
            return False
        pending.update(seq.hashes[hits:])
        seq.num_registered, seq.num_computed = hits, hits * self.tokens_per_block
        seq.admitted = True
        self.stats.cached_tokens += seq.num_computed
        return True

    def _register_full_blocks(self, seq: _RunningRequest) -> None:
        bs = self.tokens_per_block
        parent = seq.hashes[seq.num_registered - 1] if seq.num_registered else None
        for j in range(seq.num_registered, seq.num_computed // bs):
            parent = chain_hash(parent, seq.tokens[j * bs : (j + 1) * bs])
            if j >= len(seq.hashes):
                seq.hashes.append(parent)
            self.manager.register(seq.blocks[j], parent)
        seq.num_registered = max(seq.num_registered, seq.num_computed // bs)

    def _release(self, seq: _RunningRequest) -> None:
        for block in reversed(seq.blocks):  # the tail is evicted first, the shared prefix last
            self.manager.release(block)
        seq.blocks = []

    # ---- one step ------------------------------------------------------------------------------

    def _step_inputs(self, batch: list[_RunningRequest], table_width: int):
        """Host arrays of one step: every scheduled sequence's tokens past its cached rows, the block
        table, and the slots (this rank's; -1 for the tokens other ranks own)."""
        ids, positions, qsl, ctx = [], [], [0], []
        table = np.zeros((len(batch), table_width), np.int32)
        for r, seq in enumerate(batch):
            while len(seq.blocks) * self.tokens_per_block < len(seq.tokens):
                seq.blocks.append(self.manager.allocate())
            table[r, : len(seq.blocks)] = seq.blocks
            start, end = seq.num_computed, len(seq.tokens)
            ids += seq.tokens[start:end]
            positions += range(start, end)
            qsl.append(qsl[-1] + end - start)
            ctx.append(start)
        rows = table[np.repeat(np.arange(len(batch)), np.diff(qsl))]  # each token's block-table row
        return ids, positions, slot_mapping(positions, rows, self.block_size, *self._layout), table, qsl, ctx

    def _run_step(self, batch: list[_RunningRequest], table_width: int) -> list[int]:
        ids, positions, slots, table, qsl, ctx = self._step_inputs(batch, table_width)
        device = self.kv_caches.device
        table = torch.from_numpy(table).to(device)
        inputs = [torch.as_tensor(x, device=device) for x in (ids, positions, slots)]
        qsl_t, ctx_t = torch.tensor(qsl, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32)
        if self.compile:
            input_ids, positions_t, slot_mapping = inputs
            hidden = self._graphs(table_width)(input_ids, positions_t, self.kv_caches, slot_mapping, table, qsl_t,
                                               ctx_t)
        else:
            plan = plan_with_options(qsl_t, ctx_t, table, self.options, self.context_parallel)  # host plan, all layers
            hidden = self.model.model(inputs[0], inputs[1], self.kv_caches, inputs[2], table, plan)
        last = torch.tensor(qsl[1:], device=device) - 1
        return self.model.lm_head(hidden.index_select(0, last)).argmax(-1).tolist()

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
            mode = "cuda_graph" if self.kv_caches.device.type == "cuda" else "compile"
            self._runner = PrefillGraphs(
                self.model.model, max_tokens=sizes[0], max_requests=sizes[1],
                max_blocks_per_request=max_blocks_per_request, block_size=self.options.block_size,
                workspace_size=self.options.workspace_size, mode=mode)
            self._runner_caches = self.kv_caches
        return self._runner

    # ---- a call --------------------------------------------------------------------------------

    def _check_call(self, prompts, max_new_tokens, eos_token_id, callback):
        vocab_size = self.model.config.vocab_size
        prompts = _check_prompts(prompts, vocab_size)
        max_new_tokens = checks.check_nonnegative_int(max_new_tokens, "max_new_tokens")
        stops = _check_eos(eos_token_id, vocab_size)
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
        return prompts, max_new_tokens, stops

    def _check_ranks_agree(self, call) -> None:
        """Across ranks (context parallel): every rank must make the same call, or all raise; ``call``
        None: this rank refused it (and raises its own error). One small all-gather."""
        if self.context_parallel is None:
            return
        digest = hashlib.sha256(repr((call, self.settings)).encode()).digest()
        fingerprint = 0 if call is None else int.from_bytes(digest[:8], "little", signed=True) | 1
        every = collectives.gather_fingerprints(fingerprint, self.context_parallel.process_group)
        if call is None or len(set(every)) == 1:
            return
        refused = [r for r, f in enumerate(every) if f == 0]
        differ = [r for r, f in enumerate(every) if f not in (0, every[0])]
        why = f"rank(s) {refused} refused the call" if refused else \
            f"rank(s) {differ} passed other prompts, max_new_tokens, eos_token_id or settings than rank 0"
        raise ValueError(f"context_parallel: every rank must make the same generate call (this is rank "
                         f"{self._layout[0]}); {why}")

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
        except (TypeError, ValueError):
            self._check_ranks_agree(None)  # the other ranks must not wait for this one
            raise
        self._check_ranks_agree((prompts, max_new_tokens, sorted(stops)))
        outputs: list[list[int]] = [[] for _ in prompts]
        if max_new_tokens == 0:
            self.stats = GenerationStats(prompt_tokens=sum(map(len, prompts)))
            return outputs
        bs = self.tokens_per_block
        seqs = [_RunningRequest(list(p), len(p), block_hashes(p, bs)) for p in prompts]
        fingerprint = self._weights_fingerprint()
        matches, need, available = self._blocks_needed(seqs, max_new_tokens, self._cache_is_stale(fingerprint)[0])
        self._check_capacity(need, available)  # the last refusal: nothing is written before it
        self.stats = stats = GenerationStats(prompt_tokens=sum(map(len, prompts)))
        start = time.perf_counter()
        try:
            self._refresh_cache(fingerprint)
            self._reserve(seqs, matches, need)
            table_width = _next_pow2(math.ceil((max(map(len, prompts)) + max_new_tokens) / bs))
            # The first step runs every prompt (less its cached prefix), the others a token a sequence.
            self._call_sizes = (max(16, _next_pow2(stats.prompt_tokens)), _next_pow2(len(prompts)))
            while not all(seq.done for seq in seqs):
                pending: set[bytes] = set()
                order = [i for i, seq in enumerate(seqs)
                         if not seq.done and (seq.admitted or self._admit(seq, pending))]
                batch = [seqs[i] for i in order]
                for i, seq, token in zip(order, batch, self._run_step(batch, table_width)):
                    seq.num_computed = len(seq.tokens)
                    seq.tokens.append(token)
                    outputs[i].append(token)
                    self._register_full_blocks(seq)
                    if len(outputs[i]) == max_new_tokens or token in stops:
                        seq.done = True
                        self._release(seq)
                stats.steps += 1
                stats.generated_tokens = sum(map(len, outputs))
                stats.seconds = time.perf_counter() - start
                if callback is not None:
                    callback(stats)
        finally:
            for seq in seqs:
                self._release(seq)
        return outputs


# ---- argument checks (read only: they run before anything is written) -------------------------


def _check_model(model) -> None:
    if not (isinstance(model, torch.nn.Module) and hasattr(model, "model") and hasattr(model, "lm_head")
            and hasattr(model, "config")):
        raise TypeError(f"model must be an MLAForCausalLM (a model and its lm_head), got {type(model).__name__}")


def _check_bool(value, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _is_int(value) -> bool:
    """A Python or numpy int, not a bool (numpy's bool is no np.integer)."""
    return type(value) is int or (isinstance(value, (int, np.integer)) and not isinstance(value, bool))


def _integer_array(x) -> bool:
    """An integer (not bool) torch tensor or numpy array."""
    if isinstance(x, torch.Tensor):
        return not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)
    return x.dtype.kind in "iu"


def _check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """prompts as fresh lists of Python ints; a TypeError or ValueError naming ``prompts[i]`` (and
    ``[j]``, the id) otherwise."""
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts must be a list of token-id lists (e.g. [[1, 2, 3]]), got {type(prompts).__name__}"
            + (" (use .tolist(), or a list of 1-D tensors)" if isinstance(prompts, (torch.Tensor, np.ndarray)) else "")
        )
    if not prompts:
        raise TypeError("prompts must be a non-empty list of token-id lists, got an empty list")
    out = []
    for i, prompt in enumerate(prompts):
        if _is_int(prompt) or isinstance(prompt, bool) or \
                (isinstance(prompt, (torch.Tensor, np.ndarray)) and prompt.ndim == 0):
            raise TypeError(
                f"prompts must be a list of token-id lists, not a flat list of ids: prompts[{i}] is {prompt!r} "
                "(one prompt is written [[1, 2, 3]])"
            )
        if isinstance(prompt, (torch.Tensor, np.ndarray)):
            if prompt.ndim != 1 or not _integer_array(prompt):
                raise TypeError(
                    f"prompts[{i}] must be a 1-D integer tensor or array of token ids, got {prompt.ndim}-D "
                    f"{prompt.dtype}"
                )
            ids = prompt.tolist()
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise TypeError(
                f"prompts[{i}] must be a list of int token ids (or a 1-D integer tensor), got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token id")
        for j, t in enumerate(ids):
            if type(t) is not int:
                if not _is_int(t):
                    raise TypeError(f"prompts[{i}][{j}] must be an int token id, got {type(t).__name__} {t!r}")
                ids[j] = t = int(t)
            if not 0 <= t < vocab_size:
                raise ValueError(
                    f"prompts[{i}][{j}] is {t}: token ids must be in [0, {vocab_size}) (the model's vocab_size)"
                )
        out.append(ids)
    return out


def _check_eos(eos_token_id, vocab_size: int) -> set[int]:
    """The stop ids: None -> none; an int, a list/tuple/set of ints, or a 0-d/1-D integer tensor or
    array. Anything else is refused, never ignored: a str "7" or a float 7.0 would never match."""
    if eos_token_id is None:
        return set()
    what = "eos_token_id must be None, an int, or a list/tuple/set of ints"
    if isinstance(eos_token_id, (torch.Tensor, np.ndarray)):
        if eos_token_id.ndim > 1 or not _integer_array(eos_token_id):
            raise TypeError(f"{what} (or a 0-d/1-D integer tensor), got a {eos_token_id.ndim}-D "
                            f"{eos_token_id.dtype} {type(eos_token_id).__name__}")
        items = eos_token_id.reshape(-1).tolist()
    elif isinstance(eos_token_id, (list, tuple, set, frozenset)):
        items = list(eos_token_id)
    else:
        items = [eos_token_id]
    for t in items:
        if not _is_int(t):
            raise TypeError(f"{what}, got {type(t).__name__} {t!r}" + (
                f" in {eos_token_id!r}" if isinstance(eos_token_id, (list, tuple, set, frozenset)) else ""))
        if not 0 <= t < vocab_size:
            raise ValueError(
                f"eos_token_id {int(t)} is outside [0, {vocab_size}) (the model's vocab_size): it would never be "
                "generated; pass None for no stop token"
            )
    return {int(t) for t in items}


# One Generator per model, so the prefix cache lives across calls. Key: the model object (weakly)
# and the settings; a call with other settings replaces it, changed weights clear its index.
_generators: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, block_size: int = 16,
             num_blocks: int | None = None, workspace_size: int = 65536, compile: bool = False,
             eos_token_id=None) -> list[list[int]]:
    """Greedy generation: one list of ``max_new_tokens`` new token ids per prompt (module doc).

    model: an ``MLAForCausalLM``; prompts: lists of token ids (``Generator.generate`` lists what is
    accepted). The paged cache and its prefix index are kept per model between calls (``Generator``
    gives explicit control and statistics); a refused call keeps the one there was.
    """
    _check_model(model)
    options = PlanOptions(block_size, workspace_size)  # checks both (16.0 must not pass for 16)
    if num_blocks is not None:
        num_blocks = checks.check_positive_int(num_blocks, "num_blocks")
    _check_bool(compile, "compile")
    settings = (options.block_size, num_blocks, options.workspace_size, compile, True)
    generator = _generators.get(model)
    if generator is not None and generator.settings == settings:
        return generator.generate(prompts, max_new_tokens, eos_token_id=eos_token_id)
    generator = Generator(model, block_size=block_size, num_blocks=num_blocks, workspace_size=workspace_size,
                          compile=compile)
    outputs = generator.generate(prompts, max_new_tokens, eos_token_id=eos_token_id)
    _generators[model] = generator  # only once the call was accepted
    return outputs


# ---- python -m mla_ops generate -------------------------------------------------------------
#
# argparse's conventions: a bad argument value (including a token id past the checkpoint's
# vocabulary) is a usage error, exit status 2 with argparse's usage line and one error line; an
# error while loading or generating exits 1 with one line (``--debug`` re-raises it, traceback and
# all).

PROG = "python -m mla_ops generate"
_CLI_DTYPES = ("float32", "bfloat16", "float16", "float64")


def _token_ids(text: str) -> list[int]:
    """``--prompt-ids``: "1,2,3", "1, 2, 3" or "1 2 3" (never "123")."""
    stripped = text.strip()
    if not stripped:
        raise argparse.ArgumentTypeError("empty: give token ids separated by commas or spaces, e.g. 1,2,3")
    ids = []
    for piece in re.split(r"\s*,\s*|\s+", stripped):
        if re.fullmatch(r"[0-9]+", piece):
            ids.append(int(piece))
        elif re.fullmatch(r"-[0-9]+", piece):
            raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {piece} in {text!r}")
        elif not piece:
            raise argparse.ArgumentTypeError(f"an empty token id between commas in {text!r}")
        else:
            raise argparse.ArgumentTypeError(
                f"{piece!r} is not a token id in {text!r} (give ints separated by commas or spaces, e.g. 1,2,3)")
    return ids


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {value}")
        return value
    return parse


def _checkpoint_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory (give a checkpoint directory: config.json + "
                                         "safetensors)")
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text!r} has no config.json: not a checkpoint directory")
    return text


def _dtype(text: str) -> torch.dtype:
    dtype = getattr(torch, text.removeprefix("torch."), None)
    if dtype not in checks.FLOAT_DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}: choose from {', '.join(_CLI_DTYPES)}")
    return dtype


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r} (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "meta":
        raise argparse.ArgumentTypeError("meta tensors hold no values: choose a device that computes (cpu, cuda)")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: there are {count} CUDA devices (0..{count - 1})")
    elif device.type != "cpu":
        try:
            torch.empty(0, device=device)
        except Exception as e:  # noqa: BLE001  (each backend fails its own way)
            raise argparse.ArgumentTypeError(f"{text!r} is not available here: {_one_line(e)}") from None
    return device


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if isinstance(error, (ValueError, TypeError, OSError)) else f"{type(error).__name__}: {text}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, type=_checkpoint_dir, metavar="DIR",
                        help="checkpoint directory: config.json + safetensors")
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                        help="a prompt as text (needs DIR/tokenizer.json and the tokenizers package); repeatable")
    parser.add_argument("--prompt-ids", action="append", default=[], type=_token_ids, metavar="IDS",
                        help='a prompt as token ids separated by commas and/or spaces: "1,2,3", "1, 2, 3" or '
                             '"1 2 3" (three tokens); repeatable')
    parser.add_argument("--max-new-tokens", type=_int_at_least(0), default=32, metavar="N",
                        help="new tokens per prompt, >= 0 (default 32)")
    parser.add_argument("--dtype", type=_dtype, default=None,
                        help=f"{', '.join(_CLI_DTYPES)} (default: the checkpoint's)")
    parser.add_argument("--device", type=_device, default=None, help="e.g. cpu, cuda, cuda:1 (default: cpu)")
    parser.add_argument("--block-size", type=_int_at_least(1), default=16, metavar="N",
                        help="rows per cache block, >= 1 (default 16)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each step (device plans)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at config.json's eos_token_id")
    parser.add_argument("--debug", action="store_true", help="on an error, raise it with its full traceback")
    return parser


class _Progress:
    """The progress line on stderr, after every step."""

    def __init__(self, total: int):
        self.total, self.shown = total, False

    def __call__(self, stats: GenerationStats) -> None:
        done = stats.generated_tokens
        bar = "#" * (30 * done // max(self.total, 1))
        rate = done / stats.seconds if stats.seconds else 0.0
        sys.stderr.write(f"\r[{bar:<30}] {done}/{self.total} tokens  {rate:.1f} tok/s")
        sys.stderr.flush()
        self.shown = True

    def end(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            self.shown = False


def _read_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _check_ids_in_vocab(parser, prompt_ids: list[list[int]], vocab_size, model_dir: str) -> None:
    if not _is_int(vocab_size) or vocab_size < 1:
        return  # loading the checkpoint reports a bad vocab_size
    for ids in prompt_ids:
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            parser.error(f"argument --prompt-ids: token id {bad[0]} is past the vocabulary of {model_dir} "
                         f"(vocab_size {vocab_size}: ids 0..{vocab_size - 1})")


def _config_eos(raw: dict, vocab_size: int) -> list[int] | None:
    """config.json's eos_token_id: ids outside the vocabulary (tiny test models keep the
    tokenizer's) are dropped with a note, since the model can never produce them."""
    eos = raw.get("eos_token_id")
    if eos is None:
        return None
    try:
        ids = sorted(_check_eos(eos, sys.maxsize))
    except TypeError as e:
        raise ValueError(f"config.json's {e}") from None
    except ValueError:
        raise ValueError(f"config.json's eos_token_id {eos!r} holds a negative id") from None
    inside = [t for t in ids if t < vocab_size]
    outside = [t for t in ids if t >= vocab_size]
    if outside:
        print(f"note: config.json's eos_token_id {', '.join(map(str, outside))} is past the vocabulary "
              f"(vocab_size {vocab_size}) and never generated; "
              f"{'stopping at ' + ', '.join(map(str, inside)) if inside else 'no stop token'}", file=sys.stderr)
    return inside


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    progress = _Progress(0)
    try:
        _run(parser, args, progress)
    except KeyboardInterrupt:
        progress.end()
        print(f"{PROG}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as e:
        progress.end()
        if args.debug:
            raise
        print(f"{PROG}: error: {_one_line(e)} (--debug shows the traceback)", file=sys.stderr)
        raise SystemExit(1) from None


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, progress: _Progress) -> None:
    tokenizer = None
    if args.prompt:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            parser.error("--prompt needs the `tokenizers` package; pass --prompt-ids instead")
        tokenizer_path = os.path.join(args.model, "tokenizer.json")
        if not os.path.exists(tokenizer_path):
            parser.error(f"--prompt needs {tokenizer_path}; pass --prompt-ids instead")
    if not args.prompt and not args.prompt_ids:
        parser.error("give at least one --prompt or --prompt-ids")
    raw = _read_config(args.model)
    _check_ids_in_vocab(parser, args.prompt_ids, raw.get("vocab_size"), args.model)  # before loading the weights
    if args.prompt:
        tokenizer = Tokenizer.from_file(tokenizer_path)
    prompts = [tokenizer.encode(text).ids for text in args.prompt] if tokenizer else []
    for text, ids in zip(args.prompt, prompts):
        if not ids:
            parser.error(f"argument --prompt: {text!r} encodes to no tokens")
    prompts += args.prompt_ids

    from ..models.deepseek import MLAForCausalLM

    started = time.perf_counter()
    model = MLAForCausalLM.from_pretrained(args.model, dtype=args.dtype, device=args.device)
    print(f"loaded {args.model} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    vocab_size = model.config.vocab_size
    _check_ids_in_vocab(parser, args.prompt_ids, vocab_size, args.model)
    eos = None if args.ignore_eos else _config_eos(raw, vocab_size)
    generator = Generator(model, block_size=args.block_size, compile=args.compile)
    progress.total = len(prompts) * args.max_new_tokens
    outputs = generator.generate(prompts, args.max_new_tokens, eos_token_id=eos, callback=progress)
    progress.end()
    stats = generator.stats
    for prompt, new in zip(prompts, outputs):
        print(tokenizer.decode(prompt + new) if tokenizer else ",".join(map(str, new)))
    rate = f"{stats.generated_tokens / stats.seconds:.1f} tok/s, " if stats.seconds > 0 else ""
    print(f"{stats.generated_tokens} tokens in {stats.seconds:.2f} s ({rate}{stats.steps} steps); prompt tokens "
          f"{stats.prompt_tokens}, cached {stats.cached_tokens} ({stats.hit_rate:.0%})", file=sys.stderr)
