"""``PrefillGraphs``: whole prefill steps replayed from CUDA graphs, one per bucket (DESIGN §8).

A captured step replays a fixed launch sequence, so what varies per step lives in static buffers,
refilled before each replay, and the step is padded to a bucket in three dimensions:

=================  ==================================  ===========================================
dimension          buckets (defaults)                  padding
=================  ==================================  ===========================================
tokens T           ``token_buckets``: 16, 32, 64, ...  the spare tokens (id 0, position 0, slot -1:
                   below ``max_tokens``, then          they write nothing) form one extra padding
                   ``max_tokens``                      request with no context, after the slots
request slots B    ``request_buckets``: 1, 2, 4, ...   zero-length sentinel requests (no tokens,
                   below ``max_requests``, then it     no context) fill the slots past B
chunk capacity K   ``chunk_buckets``: 1, 2, 4, 8, 16   the smallest K >= ceil(chunked context /
                                                       workspace_size); chunks past the device
                                                       count do no work
=================  ==================================  ===========================================

The step's device-form plan (``plan_prefill(..., max_chunks=K)``) is made inside the captured or
compiled function, from the static length buffers, so a replay re-plans on the device. "Chunked
context" is the context the plan routes to the chunked MHA path (absorbed requests take none).
The lengths are read on the host once per step (free when they are CPU tensors, as a scheduler
has them) to pick the bucket. A step beyond the largest bucket in any dimension (or whose contexts
need more block-table columns than ``max_blocks_per_request``) runs the model eagerly with a
host plan: still exact.

Modes: ``"cuda_graph"`` captures the eager step of each bucket with ``torch.cuda.graph``, all
graphs in one memory pool (they never run at once); ``"compile"`` runs the padded step with the
model's layers compiled regionally when the model offers it (``MLAModel.compile_layers``: one graph
per dense region shared by every layer, bucket, plan and cache size, so a new bucket compiles
nothing), else compiles each bucket's whole step with ``torch.compile(fullgraph=True,
dynamic=False)``: static shapes, one graph per bucket (under ``dynamic=True`` sizes 0 and 1 would
specialise and recompile); ``"eager"`` runs the padded, device-planned step as is. The last two run
on any device and test the bucketing on CPU.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import numpy as np
import torch

from .. import _checks as checks
from .._env import own_code
from ..models.config import MLAConfig
from ..models.kv_caches import KVCaches
from ..ops.backends import BACKENDS
from ..parallel.layout import local_context_lens
from ..planning.options import PlanOptions, options_from
from ..planning.plan import check_inputs
from ..prefill import plan_with_options
from .buckets import Bucket, Buckets, padded_lengths

MODES = ("cuda_graph", "compile", "eager")


def routed_options(config: MLAConfig, options: PlanOptions) -> PlanOptions:
    """``options`` for a model's steps on one device: ``absorb_max_query_len=None`` resolved at the model's dims
    (``config.default_absorb_max_query_len``; across ranks None stays the context-parallel cost model's), and
    ``index_topk`` the model's own (a sparse model's K_I, None for a dense one)."""
    if options.index_topk != config.index_topk:
        if options.index_topk is not None:
            has = "has no indexer (dense MLA)" if config.index_topk is None else \
                f"selects index_topk={config.index_topk} keys (config.json's)"
            raise ValueError(f"options.index_topk is {options.index_topk}, but the model {has}: leave it None")
        options = dataclasses.replace(options, index_topk=config.index_topk)
    if options.absorb_max_query_len is not None:
        return options
    return dataclasses.replace(options, absorb_max_query_len=config.default_absorb_max_query_len)


class PrefillGraphs:
    """Run prefill steps of ``model`` from per-bucket CUDA graphs (or compiled functions).

    model: any module with ``forward(input_ids, positions, kv_caches, slot_mapping, plan, *, backend)``
    returning a tensor whose first dim is the step's tokens (``MLAModel``: hidden states [T, H]; its
    ``kv_caches`` a ``KVCaches``, whose formats and scales travel with it). Sizes: ``max_tokens`` /
    ``max_requests`` (the largest token / request bucket unless the bucket lists say otherwise),
    ``max_blocks_per_request`` (block-table columns). The plan's options: ``options`` (a ``PlanOptions``: the packed policy, no
    ``max_chunks``, which each bucket sets), or the loose ``block_size``, ``workspace_size``,
    ``absorb_max_query_len`` and ``max_absorbed_tokens`` (the routing), which build one.
    ``request_buckets``, ``backend`` (passed to the model) and ``compile_backend`` (``torch.compile``'s,
    mode ``"compile"``) are extensions.

    ``stats``: ``graphs`` (buckets captured / compiled / set up), ``replays`` (steps run through
    a bucket), ``eager`` (steps beyond the buckets, run eagerly), ``static_bytes`` (the static
    input buffers) and ``graph_bytes`` (``"T..-B..-K.."`` -> bytes of device memory the capture
    of that bucket added to the shared pool; mode ``"cuda_graph"`` only).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_tokens: int,
        max_requests: int,
        max_blocks_per_request: int,
        block_size: int = 16,
        workspace_size: int = 65536,
        chunk_buckets=(1, 2, 4, 8, 16),
        token_buckets=None,
        mode: str = "cuda_graph",
        request_buckets=None,
        absorb_max_query_len: int | None = None,
        max_absorbed_tokens: int | None = None,
        backend: str = "auto",
        compile_backend="inductor",
        options: PlanOptions | None = None,
    ):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        checks.check_choice(mode, "mode", MODES)
        self.max_blocks_per_request = checks.check_positive_int(max_blocks_per_request, "max_blocks_per_request")
        self.buckets = Buckets.build(max_tokens, max_requests, chunk_buckets, token_buckets, request_buckets)
        options = options_from(options, block_size=block_size, workspace_size=workspace_size,
                               absorb_max_query_len=absorb_max_query_len, max_absorbed_tokens=max_absorbed_tokens)
        if options.max_chunks is not None or options.policy != "packed" or options.split_alignment != 1:
            raise ValueError(
                "options must plan the packed policy (split_alignment=1) without max_chunks: each bucket plans "
                f"the device form with its own K (chunk_buckets), got {options!r}")
        self.context_parallel = getattr(model, "context_parallel", None)  # a model across ranks plans across them
        config = getattr(model, "config", None)
        if isinstance(config, MLAConfig) and self.context_parallel is None:
            options = routed_options(config, options)  # the routing default at the model's own dims
        # The device plan's options; each bucket plans with its own K (``max_chunks``).
        self.options = dataclasses.replace(options, max_chunks=self.buckets.chunks[-1])
        tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
        if tensor is None:
            raise ValueError("model has no parameters or buffers to tell its device")
        self.device = tensor.device
        if mode == "cuda_graph" and self.device.type != "cuda":
            raise ValueError(
                f"mode='cuda_graph' needs the model on a CUDA device, got {self.device}; use mode='compile' "
                "or 'eager' elsewhere"
            )
        checks.check_choice(backend, "backend", BACKENDS)
        if mode == "compile" and not callable(compile_backend) and \
                compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
            raise ValueError(f"compile_backend must be a torch.compile backend (a callable or one of "
                             f"torch._dynamo.list_backends()), got {compile_backend!r}")
        self.model, self.mode, self.backend, self.compile_backend = model, mode, backend, compile_backend
        # Regional compilation: the model's layers compiled once, the step around them run as is.
        self.regional = mode == "compile" and callable(getattr(model, "compile_layers", None))
        self._scales: dict[float, torch.Tensor] = {}  # a float k_scale as a device tensor, made once

        # Static inputs, sized once for the largest bucket. Request rows: the slots, then the
        # padding request. ``_lengths`` holds a bucket's query_start_loc [S+2] then context_lens
        # [S+1], contiguous, so one copy refills both.
        tokens, rows = self.buckets.tokens[-1], self.buckets.requests[-1] + 1
        zeros = lambda *s, dtype=torch.int32: torch.zeros(*s, dtype=dtype, device=self.device)  # noqa: E731
        self._input_ids, self._positions = zeros(tokens, dtype=torch.long), zeros(tokens, dtype=torch.long)
        self._slot_mapping = torch.full((tokens,), -1, dtype=torch.long, device=self.device)
        self._block_table = zeros(rows, self.max_blocks_per_request)
        self._lengths = zeros(2 * rows + 1)
        static = (self._input_ids, self._positions, self._slot_mapping, self._block_table, self._lengths)
        self._runs: dict[Bucket, Callable[[torch.Tensor], torch.Tensor]] = {}
        self._caches: torch.Tensor | None = None  # the cache geometry (and memory) the buckets were built for
        self._pool = torch.cuda.graph_pool_handle() if mode == "cuda_graph" else None
        self.stats = dict(graphs=0, replays=0, eager=0, static_bytes=sum(t.nbytes for t in static), graph_bytes={})

    # ---- public --------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.options.block_size

    @property
    def workspace_size(self) -> int:
        return self.options.workspace_size

    @property
    def token_buckets(self) -> tuple[int, ...]:
        return self.buckets.tokens

    @property
    def request_buckets(self) -> tuple[int, ...]:
        return self.buckets.requests

    @property
    def chunk_buckets(self) -> tuple[int, ...]:
        return self.buckets.chunks

    @property
    def variants(self) -> tuple[Bucket, ...]:
        """Every bucket, largest first (the order ``warmup`` builds them in)."""
        return self.buckets.all()

    @property
    def built(self) -> tuple[Bucket, ...]:
        """The buckets captured / compiled so far, in build order."""
        return tuple(self._runs)

    @torch.no_grad()
    def warmup(self, kv_caches: torch.Tensor | None = None) -> None:
        """Build every bucket now (largest first, so the shared pool is sized by the first).

        The graphs read ``kv_caches`` (mode ``"cuda_graph"``: that very memory; ``"compile"``: its
        shape), so pass it unless a step already ran. Builds run an empty step: it writes nothing.
        """
        if kv_caches is None:
            kv_caches = self._caches
        if kv_caches is None:
            raise ValueError("warmup needs kv_caches (the graphs read them) until a step has run")
        kv_caches = self._with_device_scales(kv_caches)
        self._check_caches(kv_caches)
        for variant in self.variants:
            if variant not in self._runs:
                self._build(variant, kv_caches)

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches,  # the model's caches (MLAModel: a KVCaches)
        slot_mapping: torch.Tensor,  # [T], negative = write nothing
        block_table: torch.Tensor,  # [B, max_blocks] int32
        query_start_loc: torch.Tensor,  # [B+1] int32, best on the CPU (read on the host)
        context_lens: torch.Tensor,  # [B] int32, best on the CPU (read on the host)
    ) -> torch.Tensor:
        """The model's output for the step, ``[T, ...]``.

        Mode ``"cuda_graph"``: a view of the graph's static output, overwritten by the next call
        (clone it to keep it).
        """
        kv_caches = self._with_device_scales(kv_caches)
        qsl, ctx = self._host_lengths(input_ids, positions, kv_caches, slot_mapping, block_table, query_start_loc,
                                      context_lens)
        variant = self._variant_for(qsl, ctx)
        if variant is None:
            self.stats["eager"] += 1
            return self._run_eagerly(input_ids, positions, kv_caches, slot_mapping, block_table, query_start_loc,
                                     context_lens)
        self._check_caches(kv_caches)
        run = self._runs.get(variant) or self._build(variant, kv_caches)
        self._load(variant, input_ids, positions, slot_mapping, block_table, qsl, ctx)
        out = run(kv_caches)
        self.stats["replays"] += 1
        return out[: int(qsl[-1])]

    # ---- bucketing -----------------------------------------------------------------------

    def _variant_for(self, qsl: np.ndarray, ctx: np.ndarray) -> Bucket | None:
        """The smallest bucket that holds the step; None beyond the largest."""
        if ctx.size and int(-(-self._table_lens(ctx).max() // self.block_size)) > self.max_blocks_per_request:
            return None
        cp = self.context_parallel
        if cp is None:
            return self.buckets.choose(qsl, ctx, self.options)
        # Across ranks the plan chunks whole stripes and may route by its cost model: count every context
        # as chunked, in stripes (an upper bound on the chunks; chunks past the plan's count do no work).
        return self.buckets.choose(qsl, ctx, dataclasses.replace(self.options, absorb_max_query_len=0),
                                   stripe=cp.interleave * cp.world_size)

    def _table_lens(self, ctx: np.ndarray) -> np.ndarray:
        """The context rows the block table holds: this rank's share across ranks (DESIGN §10)."""
        cp = self.context_parallel
        return ctx if cp is None else local_context_lens(ctx, cp.rank, cp.world_size, cp.interleave)

    def _views(self, variant: Bucket) -> tuple[torch.Tensor, ...]:
        """The static buffers as one bucket's inputs (fixed addresses: what a graph reads)."""
        tokens, rows = variant.tokens, variant.requests + 1
        qsl, ctx = self._lengths[: 2 * rows + 1].split([rows + 1, rows])
        return (self._input_ids[:tokens], self._positions[:tokens], self._slot_mapping[:tokens],
                self._block_table[:rows], qsl, ctx)

    def _load(self, variant, input_ids, positions, slot_mapping, block_table, qsl, ctx) -> None:
        """Copy a step into the static buffers, padded to ``variant`` (module doc)."""
        tokens, requests = int(qsl[-1]), ctx.size
        self._input_ids[:tokens].copy_(input_ids)
        self._positions[:tokens].copy_(positions)
        self._slot_mapping[:tokens].copy_(slot_mapping)
        if tokens < variant.tokens:  # the padding request's tokens: id 0 at position 0, writing nothing
            self._input_ids[tokens : variant.tokens].zero_()
            self._positions[tokens : variant.tokens].zero_()
            self._slot_mapping[tokens : variant.tokens].fill_(-1)
        width = min(block_table.shape[1], self.max_blocks_per_request)  # the contexts fit (checked)
        self._block_table[:requests, :width].copy_(block_table[:requests, :width])
        self._load_lengths(variant, qsl, ctx)

    def _load_lengths(self, variant: Bucket, qsl: np.ndarray, ctx: np.ndarray) -> None:
        lengths = padded_lengths(variant, qsl, ctx)
        host = torch.from_numpy(lengths)
        if self.device.type == "cuda":  # pinned: an async copy, the block kept until it is done
            host = host.pin_memory()
        self._lengths[: lengths.size].copy_(host, non_blocking=True)

    def _load_empty(self, variant: Bucket) -> None:
        """A step of padding only (reads and writes no cache row): what a build runs."""
        self._input_ids[: variant.tokens].zero_()
        self._positions[: variant.tokens].zero_()
        self._slot_mapping[: variant.tokens].fill_(-1)
        self._load_lengths(variant, np.zeros(1, np.int32), np.zeros(0, np.int32))

    # ---- building and running -------------------------------------------------------------

    def _step_function(self, chunks: int, name: str) -> Callable:
        runner, options = self, dataclasses.replace(self.options, max_chunks=chunks)

        def prefill_step(input_ids, positions, kv_caches, slot_mapping, block_table, query_start_loc, context_lens):
            # Planned here, on the device: a replay re-plans from the refilled length buffers.
            plan = plan_with_options(query_start_loc, context_lens, block_table, options, runner.context_parallel)
            return runner.model(input_ids, positions, kv_caches, slot_mapping, plan, backend=runner.backend)

        return own_code(prefill_step, name)

    def _build(self, variant: Bucket, kv_caches: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        ids, positions, slots, table, qsl, ctx = self._views(variant)
        step = self._step_function(variant.chunks, f"prefill_step_{variant}".replace("-", "_"))
        self._load_empty(variant)
        if self.mode == "eager" or self.regional:
            if self.regional:
                self.model.compile_layers(backend=self.compile_backend)
                step(ids, positions, kv_caches, slots, table, qsl, ctx)  # compiles the regions once (writes nothing)

            def run(caches):
                return step(ids, positions, caches, slots, table, qsl, ctx)
        elif self.mode == "compile":
            compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=self.compile_backend)
            compiled(ids, positions, kv_caches, slots, table, qsl, ctx)  # compiles now

            def run(caches):
                return compiled(ids, positions, caches, slots, table, qsl, ctx)
        else:
            run = self._capture(variant, lambda: step(ids, positions, kv_caches, slots, table, qsl, ctx))
        self._runs[variant] = run
        self.stats["graphs"] += 1
        return run

    def _capture(self, variant: Bucket, step: Callable[[], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # Triton JIT and library handles, outside the capture
            step()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # as torch.cuda.graph does on entry: the difference is then the pool's growth
        before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = step()
        self.stats["graph_bytes"][str(variant)] = torch.cuda.memory_reserved(self.device) - before

        def run(caches):
            graph.replay()
            return out

        return run

    def _run_eagerly(self, input_ids, positions, kv_caches, slot_mapping, block_table, query_start_loc,
                     context_lens) -> torch.Tensor:
        block_table = block_table.to(self.device)
        plan = plan_with_options(query_start_loc, context_lens, block_table,
                                 dataclasses.replace(self.options, max_chunks=None, max_absorbed_tokens=None),
                                 self.context_parallel)
        return self.model(input_ids.to(self.device), positions.to(self.device), kv_caches,
                          slot_mapping.to(self.device), plan, backend=self.backend)

    # ---- checks ----------------------------------------------------------------------------

    def _with_device_scales(self, kv_caches):
        """A ``KVCaches`` whose float scales are device tensors, each made once: no host-to-device copy inside a
        capture, and a replay reads the scale it was captured with."""
        if not isinstance(kv_caches, KVCaches):
            return kv_caches

        def on_device(scale, name):
            if isinstance(scale, (list, tuple)):
                return [on_device(s, name) for s in scale]
            if scale is None or isinstance(scale, torch.Tensor):
                return scale
            checks.check_scale(scale, name, self.device)
            key = float(scale)
            if key not in self._scales:
                self._scales[key] = torch.tensor([key], dtype=torch.float32, device=self.device)
            return self._scales[key]

        return dataclasses.replace(kv_caches, k_scale=on_device(kv_caches.k_scale, "k_scale"),
                                   k_scale_index=on_device(kv_caches.k_scale_index, "k_scale_index"))

    def _check_caches(self, kv_caches) -> None:
        """Buckets are built for one cache: its memory and scales (captured) or its geometry (compiled). A
        ``KVCaches`` (or a plain list of one tensor per layer, or a stacked tensor): each of its tensors."""
        tensors = _tensors(kv_caches)
        if any(not isinstance(t, torch.Tensor) or t.device != self.device for t in tensors):
            raise ValueError(f"kv_caches must be on {self.device} (the model's device), got "
                             f"{[getattr(t, 'device', type(t).__name__) for t in tensors]}")
        bound = self._caches
        if bound is None or self.mode == "eager" or self.regional:  # nothing built for one cache
            self._caches = kv_caches
            return
        geometry = lambda c: [(t.shape, t.stride(), t.dtype, t.device) for t in _tensors(c)] + _storage(c)  # noqa: E731
        memory = lambda c: [t.data_ptr() for t in _tensors(c)] + _scale_memory(c)  # noqa: E731
        if type(kv_caches) is not type(bound) or geometry(kv_caches) != geometry(bound) or \
                (self.mode == "cuda_graph" and memory(kv_caches) != memory(bound)):
            what = "the tensors and scales" if self.mode == "cuda_graph" else \
                "the shape, strides, dtype and formats of the tensors"
            shapes = lambda c: ", ".join(f"{tuple(t.shape)} {t.dtype} on {t.device}" for t in _tensors(c))  # noqa: E731
            raise ValueError(
                f"kv_caches must be {what} the buckets were built with ({shapes(bound)}), got "
                f"{shapes(kv_caches)}: use one runner per cache"
            )

    def _host_lengths(self, input_ids, positions, kv_caches, slot_mapping, block_table, query_start_loc,
                      context_lens):
        """The step's lengths as host arrays, checked (argument names in every error), with what can be
        read for free against the cache and the vocabulary: a compiled or captured step checks nothing
        of the values it reads, so a bad id would index out of bounds there."""
        check_inputs(query_start_loc, context_lens, block_table)
        requests = context_lens.shape[0]
        if query_start_loc.device.type == "cpu" and context_lens.device.type == "cpu":
            qsl, ctx = query_start_loc.numpy(), context_lens.numpy()
        else:  # one device-to-host read of both
            both = torch.cat([query_start_loc.to(context_lens.device), context_lens]).cpu().numpy()
            qsl, ctx = both[: requests + 1], both[requests + 1 :]
        table = block_table.numpy() if block_table.device.type == "cpu" else \
            np.zeros((requests, block_table.shape[1]), np.int32)
        max_block_id = checks.check_lengths(qsl, self._table_lens(ctx), table, self.block_size)
        tokens = int(qsl[-1])
        for name, x in (("input_ids", input_ids), ("positions", positions), ("slot_mapping", slot_mapping)):
            checks.check_tensor(x, name, 1, "[T]")
            if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
                raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
            if x.shape[0] != tokens:
                raise ValueError(f"{name} must have T = query_start_loc[-1] = {tokens} entries, got {x.shape[0]}")
        tensors = _tensors(kv_caches)
        first = tensors[0] if tensors else None
        if isinstance(first, torch.Tensor) and first.dim() >= 3:
            num_blocks = first.shape[-3]
            if block_table.device.type == "cpu" and max_block_id >= num_blocks:
                raise ValueError(f"block_table uses block {max_block_id}, past the {num_blocks} blocks of kv_caches")
            if checks.values_readable(slot_mapping) and tokens and int(slot_mapping.max()) >= num_blocks * self.block_size:
                raise ValueError(f"slot_mapping holds slot {int(slot_mapping.max())}, past the {num_blocks} x "
                                 f"{self.block_size} slots of kv_caches")
        embedding = getattr(self.model, "embed_tokens", None)
        if isinstance(embedding, torch.nn.Embedding):
            checks.check_ids_below(input_ids, "input_ids", embedding.num_embeddings, "the vocabulary")
        return qsl, ctx


def _tensors(kv_caches) -> tuple[torch.Tensor, ...]:
    """The cache tensors of a ``KVCaches``, a list of them, or one stacked tensor."""
    if isinstance(kv_caches, KVCaches):
        return kv_caches.tensors
    if isinstance(kv_caches, torch.Tensor):
        return (kv_caches,)
    if isinstance(kv_caches, (list, tuple)):
        return tuple(kv_caches)
    raise TypeError(f"kv_caches must be a mla_ops.KVCaches, a list of one tensor per layer or a stacked tensor, got "
                    f"{type(kv_caches).__name__}")


def _storage(kv_caches) -> list:
    """A record's formats: what a compiled bucket's code was made for."""
    return [kv_caches.kv_cache_format, kv_caches.index_cache_format] if isinstance(kv_caches, KVCaches) else []


def _scale_memory(kv_caches) -> list:
    """A record's scale tensors, as a captured graph reads them (their memory)."""
    if not isinstance(kv_caches, KVCaches):
        return []
    scales = []
    for scale in (kv_caches.k_scale, kv_caches.k_scale_index):
        scales += scale if isinstance(scale, (list, tuple)) else [scale]
    return [s.data_ptr() if isinstance(s, torch.Tensor) else s for s in scales]
