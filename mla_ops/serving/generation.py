"""Greedy generation on the paged latent cache: ``mla_ops.generate`` and ``python -m mla_ops generate``.

Every step is one batched prefill with one plan (``mla_ops.plan_prefill``) shared by all layers:
new prompts (minus what the prefix cache already holds) and, as one-token prefills, the next token
of every running sequence; the planner routes those to the absorbed path (query length 1 with a
context). The cache is a ``BlockManager`` (``mla_ops.serving.paged_cache``): full blocks are shared by
content hash between the prompts of a call and across calls (a prompt whose next block another
prompt of the same step is computing waits one step and then reuses it), and freed when unused.

``compile=True`` runs each step through ``PrefillGraphs`` (``mla_ops.serving.graphs``): CUDA graphs
on a GPU, ``torch.compile`` per bucket elsewhere, each step padded to its bucket by the one padding
contract of ``mla_ops.serving.buckets``, with a device plan made inside the graph; a step beyond
the buckets runs eagerly. The runner is kept across calls while the cache tensor stays the same
(pass ``num_blocks`` so that it never grows).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .. import _checks as checks
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
        if not (hasattr(model, "model") and hasattr(model, "lm_head")):
            raise TypeError(f"model must be an MLAForCausalLM (a model and its lm_head), got {type(model).__name__}")
        if num_blocks is not None:
            checks.check_positive_int(num_blocks, "num_blocks")
        self.model = model
        self.options = PlanOptions(block_size, workspace_size)  # the host plans of eager steps
        self.block_size, self.workspace_size = self.options.block_size, self.options.workspace_size
        self.compile = compile
        self.fixed_num_blocks = num_blocks
        self.manager = BlockManager(num_blocks or 1, block_size, prefix_caching)
        self.kv_caches: torch.Tensor | None = None
        self.stats = GenerationStats()
        self._fingerprint = None
        self._runner: PrefillGraphs | None = None  # compile=True: the step runner and the cache it was built for
        self._runner_caches: torch.Tensor | None = None
        self._call_sizes = (1, 1)  # compile=True: the token and request buckets a call needs
        self.settings = (block_size, num_blocks, workspace_size, compile, prefix_caching)

    # ---- the cache -------------------------------------------------------------------------------

    def _weights_fingerprint(self):
        """Cached rows are only valid for the weights that wrote them (moves and in-place writes show)."""
        return tuple((t.data_ptr(), t._version, t.dtype) for t in (*self.model.parameters(), *self.model.buffers()))

    def _check_weights(self) -> None:
        fingerprint = self._weights_fingerprint()
        if fingerprint != self._fingerprint:
            self.manager.clear_cache()
            self._fingerprint = fingerprint
        weight = self.model.lm_head.weight
        if self.kv_caches is None or self.kv_caches.dtype != weight.dtype or self.kv_caches.device != weight.device:
            self.manager.clear_cache()
            self.kv_caches = self.model.allocate_kv_caches(self.manager.num_blocks, self.block_size)

    def _ensure_capacity(self, need: int) -> None:
        if need <= self.manager.num_available:
            return
        if self.fixed_num_blocks is not None:
            raise ValueError(
                f"num_blocks={self.fixed_num_blocks} is too small: this call needs {need} more blocks of "
                f"{self.block_size} tokens, {self.manager.num_available} are available"
            )
        extra = max(need - self.manager.num_available, self.manager.num_blocks // 2)
        self.manager.grow(extra)
        grown = self.model.allocate_kv_caches(self.manager.num_blocks, self.block_size)
        grown[:, : self.kv_caches.shape[1]] = self.kv_caches  # block ids (and cached rows) stay valid
        self.kv_caches = grown

    def _reserve(self, seqs: list[_RunningRequest], max_new_tokens: int) -> None:
        """Pin every prompt's cached prefix (no allocation of this call can evict it), then make
        sure the rest of the call fits."""
        bs = self.block_size
        seen: set[bytes] = set()
        need = 0
        for seq in seqs:
            seq.max_hits = (seq.prompt_len - 1) // bs
            seq.blocks = self.manager.match(seq.hashes[: seq.max_hits])
            for block in seq.blocks:
                self.manager.acquire(block)
            shared = len(seq.blocks)  # plus the blocks an earlier prompt of this call computes first
            while self.manager.prefix_caching and shared < seq.max_hits and seq.hashes[shared] in seen:
                shared += 1
            seen.update(seq.hashes)
            need += math.ceil((seq.prompt_len + max_new_tokens) / bs) - shared
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
        seq.num_registered, seq.num_computed = hits, hits * self.block_size
        seq.admitted = True
        self.stats.cached_tokens += seq.num_computed
        return True

    def _register_full_blocks(self, seq: _RunningRequest) -> None:
        bs = self.block_size
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

    def _step_inputs(self, batch: list[_RunningRequest]):
        """Host tensors of one step: every scheduled sequence's tokens past its cached rows."""
        bs = self.block_size
        ids, positions, slots, qsl, ctx = [], [], [], [0], []
        for seq in batch:
            while len(seq.blocks) * bs < len(seq.tokens):
                seq.blocks.append(self.manager.allocate())
            start, end = seq.num_computed, len(seq.tokens)
            ids += seq.tokens[start:end]
            positions += range(start, end)
            slots += [seq.blocks[p // bs] * bs + p % bs for p in range(start, end)]
            qsl.append(qsl[-1] + end - start)
            ctx.append(start)
        return ids, positions, slots, qsl, ctx

    def _run_step(self, batch: list[_RunningRequest], table_width: int) -> list[int]:
        ids, positions, slots, qsl, ctx = self._step_inputs(batch)
        device = self.kv_caches.device
        table = torch.zeros(len(batch), table_width, dtype=torch.int32)
        for r, seq in enumerate(batch):
            table[r, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        table = table.to(device)
        inputs = [torch.tensor(x, device=device) for x in (ids, positions, slots)]
        qsl_t, ctx_t = torch.tensor(qsl, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32)
        if self.compile:
            input_ids, positions_t, slot_mapping = inputs
            hidden = self._graphs(table_width)(input_ids, positions_t, self.kv_caches, slot_mapping, table, qsl_t,
                                               ctx_t)
        else:
            plan = plan_with_options(qsl_t, ctx_t, table, self.options)  # host plan, all layers
            hidden = self.model.model(inputs[0], inputs[1], self.kv_caches, inputs[2], table, plan)
        last = torch.tensor(qsl[1:], device=device) - 1
        return self.model.lm_head(hidden.index_select(0, last)).argmax(-1).tolist()

    def _graphs(self, max_blocks_per_request: int) -> PrefillGraphs:
        """The step runner of ``compile=True``: ``PrefillGraphs`` over the model (mode ``"cuda_graph"``
        on CUDA, ``"compile"`` elsewhere), sized for this call and kept while its cache and sizes hold."""
        runner, sizes = self._runner, self._call_sizes
        fits = runner is not None and self._runner_caches is self.kv_caches and \
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

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, eos_token_id=None,
                 callback: Callable[[GenerationStats], None] | None = None) -> list[list[int]]:
        """Greedy: up to ``max_new_tokens`` new token ids per prompt (fewer after ``eos_token_id``,
        which is kept). ``callback(stats)`` runs after every step."""
        prompts = _check_prompts(prompts, self.model.config.vocab_size)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        stops = set() if eos_token_id is None else set(eos_token_id if isinstance(eos_token_id, (list, tuple, set))
                                                       else [eos_token_id])
        self.stats = stats = GenerationStats(prompt_tokens=sum(map(len, prompts)))
        outputs: list[list[int]] = [[] for _ in prompts]
        if max_new_tokens == 0:
            return outputs
        bs = self.block_size
        seqs = [_RunningRequest(list(p), len(p), block_hashes(p, bs)) for p in prompts]
        start = time.perf_counter()
        try:
            self._check_weights()
            self._reserve(seqs, max_new_tokens)
            table_width = _next_pow2(math.ceil((max(map(len, prompts)) + max_new_tokens) / bs))
            # The first step runs every prompt (less its cached prefix), the others a token a sequence.
            self._call_sizes = (max(16, _next_pow2(stats.prompt_tokens)), _next_pow2(len(prompts)))
            while not all(seq.done for seq in seqs):
                pending: set[bytes] = set()
                order = [i for i, seq in enumerate(seqs) if not seq.done and (seq.admitted or self._admit(seq, pending))]
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


def _check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise TypeError("prompts must be a non-empty list of token id lists")
    out = []
    for i, prompt in enumerate(prompts):
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if not ids or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids in [0, {vocab_size}), got {ids[:8]}")
        out.append(ids)
    return out


# One Generator per model, so the prefix cache lives across calls. Key: the model object (weakly)
# and the settings; a call with other settings replaces it, changed weights clear its index.
_generators: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, block_size: int = 16,
             num_blocks: int | None = None, workspace_size: int = 65536, compile: bool = False,
             eos_token_id=None) -> list[list[int]]:
    """Greedy generation: one list of ``max_new_tokens`` new token ids per prompt (module doc).

    model: an ``MLAForCausalLM``; prompts: lists of token ids. The paged cache and its prefix index
    are kept per model between calls (``Generator`` gives explicit control and statistics).
    """
    settings = (block_size, num_blocks, workspace_size, compile, True)
    generator = _generators.get(model)
    if generator is None or generator.settings != settings:
        generator = Generator(model, block_size=block_size, num_blocks=num_blocks, workspace_size=workspace_size,
                              compile=compile)
        _generators[model] = generator
    return generator.generate(prompts, max_new_tokens, eos_token_id=eos_token_id)


# ---- python -m mla_ops generate -------------------------------------------------------------


def _progress(total: int) -> Callable[[GenerationStats], None]:
    def show(stats: GenerationStats) -> None:
        out = sys.stderr
        done = stats.generated_tokens
        bar = "#" * (30 * done // max(total, 1))
        rate = done / stats.seconds if stats.seconds else 0.0
        out.write(f"\r[{bar:<30}] {done}/{total} tokens  {rate:.1f} tok/s")
        out.flush()
    return show


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mla_ops generate", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory: config.json + safetensors")
    parser.add_argument("--prompt", action="append", default=[], help="text (needs tokenizer.json + tokenizers)")
    parser.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16, float32 (default: the checkpoint's)")
    parser.add_argument("--device", default=None, help="e.g. cuda (default: cpu)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--compile", action="store_true", help="torch.compile each step (device plans)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at config.json's eos_token_id")
    args = parser.parse_args(argv)

    from ..models.checkpoint import torch_dtype
    from ..models.deepseek import MLAForCausalLM

    tokenizer = None
    tokenizer_path = os.path.join(args.model, "tokenizer.json")
    if args.prompt:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            parser.error("--prompt needs the `tokenizers` package; pass --prompt-ids instead")
        if not os.path.exists(tokenizer_path):
            parser.error(f"--prompt needs {tokenizer_path}; pass --prompt-ids instead")
        tokenizer = Tokenizer.from_file(tokenizer_path)
    prompts = [tokenizer.encode(text).ids for text in args.prompt] if tokenizer else []
    prompts += [[int(t) for t in ids.replace(" ", "").split(",") if t] for ids in args.prompt_ids]
    if not prompts:
        parser.error("give at least one --prompt or --prompt-ids")

    started = time.perf_counter()
    model = MLAForCausalLM.from_pretrained(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    print(f"loaded {args.model} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    eos = None
    if not args.ignore_eos:
        import json

        with open(os.path.join(args.model, "config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    generator = Generator(model, block_size=args.block_size, compile=args.compile)
    outputs = generator.generate(prompts, args.max_new_tokens, eos_token_id=eos,
                                 callback=_progress(len(prompts) * args.max_new_tokens))
    stats = generator.stats
    print(file=sys.stderr)
    for prompt, new in zip(prompts, outputs):
        print(tokenizer.decode(prompt + new) if tokenizer else ",".join(map(str, new)))
    print(f"{stats.generated_tokens} tokens in {stats.seconds:.2f} s ({stats.generated_tokens / stats.seconds:.1f} "
          f"tok/s, {stats.steps} steps); prompt tokens {stats.prompt_tokens}, cached {stats.cached_tokens} "
          f"({stats.hit_rate:.0%})", file=sys.stderr)
