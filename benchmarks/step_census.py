"""Per-layer op census of a model step: what each decoder layer dispatches, and how much of it
depends only on the step (its lengths, positions, slot mapping and options), i.e. work that every
layer repeats and that could be done once per step.

A ``TorchDispatchMode`` records every op an ``MLAModel.forward`` dispatches (a ``torch.ops.mla_ops``
op counts as one: its own work is not recorded), split by decoder layer with forward hooks. An op
depends on the layer when one of its inputs derives from the layer's data (its weights, its cache,
the hidden states it receives); the others, views and uninitialized allocations aside, depend only
on the step. Counted, not timed: host and device plans, B = 4 and 32, float32 and float8 caches, the
torch backend and (under ``TRITON_INTERPRET=1``) the Triton one, where a kernel launch counts as one
op and the torch glue around it as what it is (on a GPU, every op is a launch). The step's checks
(the plan's fit, the slots' range) and its tensors run in ``mla_ops.begin_step``, before the first
layer: a layer counts only its own work.

A sparse model (``--dsa``: the tiny preset with DeepSeek Sparse Attention, ``index_topk`` 16) adds the
suffix attention's query tokens per layer against the step's and its dense-routed ones: the sparse
attention attends a sparse request's own new keys itself, so the suffix runs over the dense-routed
tokens only (issue 39).

    python -m benchmarks.step_census --json benchmarks/results/step_census.json
    TRITON_INTERPRET=1 python -m benchmarks.step_census --backend triton \
        --json benchmarks/results/step_census_triton.json
"""

from __future__ import annotations

import argparse
import contextlib
import weakref
from collections import Counter

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import mla_ops
from mla_ops.models import regions
from benchmarks._lib.batches import model_step
from benchmarks._lib.report import write_json_atomic
from mla_ops._env import interpreting

PRESET = "tiny"
# Uninitialized allocations (a layer's scratch): no work and, on a GPU, no launch; like views, never
# counted as step-only.
ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
               torch.ops.aten.new_empty.default}


class LayerCensus(TorchDispatchMode):
    """Ops dispatched inside each decoder layer: ``ops[i]`` and ``step_only[i]`` (Counters by op name)."""

    def __init__(self, model: mla_ops.MLAModel):
        super().__init__()
        self.layer: int | None = None
        self.ops: list[Counter] = [Counter() for _ in model.layers]
        self.step_only: list[Counter] = [Counter() for _ in model.layers]
        self.layer_data: dict[int, weakref.ref] = {}  # by identity (a tensor's == is elementwise)
        self.suffix_tokens: list[int] = [0 for _ in model.layers]  # live query tokens of the suffix attention
        for p in model.parameters():
            self._mark(p)
        # A layer's work is its call and the write of its rows after it: regions.run_layer, wrapped here.
        index = {id(layer): i for i, layer in enumerate(model.layers)}
        run_layer = self.run_layer = regions.run_layer

        def counted_run_layer(layer, x, caches, *rest):
            self.layer = index[id(layer)]
            for t in pytree.tree_leaves((x, caches)):  # the hidden states and the layer's caches
                if isinstance(t, torch.Tensor):
                    self._mark(t)
            try:
                return run_layer(layer, x, caches, *rest)
            finally:
                self.layer = None

        regions.run_layer = counted_run_layer

    def _mark(self, t: torch.Tensor) -> None:
        self.layer_data[id(t)] = weakref.ref(t)

    def _is_layer_data(self, t: torch.Tensor) -> bool:
        ref = self.layer_data.get(id(t))
        return ref is not None and ref() is t

    def remove(self) -> None:
        regions.run_layer = self.run_layer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.layer is None or func is torch.ops.aten.promote_types.default:  # a dtype, computed on the host
            return out
        if func is torch.ops.mla_ops.suffix_attention.default:  # its query_start_loc (CPU): tokens it attends
            with torch.utils._python_dispatch._disable_current_modes():
                self.suffix_tokens[self.layer] += int(args[4][-1])
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        depends_on_layer = any(self._is_layer_data(t) for t in inputs)
        if depends_on_layer:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._mark(t)
            for t, argument in zip(args, func._schema.arguments):  # written in place: now layer data too
                if isinstance(t, torch.Tensor) and argument.alias_info is not None and argument.alias_info.is_write:
                    self._mark(t)
        name = func.overloadpacket.__name__ if func.namespace == "aten" else f"{func.namespace}.{func._opname}"
        self._count(name, depends_on_layer or func.is_view or func in ALLOCATIONS)
        return out

    def _count(self, name: str, per_layer: bool) -> None:
        self.ops[self.layer][name] += 1
        if not per_layer:
            self.step_only[self.layer][name] += 1

    @contextlib.contextmanager
    def triton_launches(self):
        """Count each Triton launch (interpreter) as one op, ``triton.<kernel>``, and not the torch
        ops the interpreter itself runs to execute it. A launch writes its tensor arguments, so
        one that reads layer data makes them all layer data."""
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run
        census = self

        def counted_run(kernel, *args, **kwargs):
            if census.layer is None:
                return run(kernel, *args, **kwargs)
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            depends_on_layer = any(census._is_layer_data(t) for t in tensors)
            if depends_on_layer:
                for t in tensors:
                    census._mark(t)
            census._count(f"triton.{kernel.__name__}", depends_on_layer)
            with torch.utils._python_dispatch._disable_current_modes():
                return run(kernel, *args, **kwargs)

        InterpretedFunction.run = counted_run
        try:
            yield
        finally:
            InterpretedFunction.run = run


# DeepSeek Sparse Attention on the tiny preset: requests with more than 16 keys take the sparse path.
DSA = dict(indexer=dict(index_topk=16, index_n_heads=4, index_head_dim=16))


def census(batch: int, device_plan: bool, fp8: bool, layers: int = 3, seed: int = 0, backend: str = "torch",
           dsa: bool = False, masked_mha_ratio: float | None = None) -> dict:
    """``masked_mha_ratio``: the plan's (None: the measured default, which routes some sparse requests to
    top-k-masked MHA on this eager CPU run; 0: every one to the sparse path)."""
    config = mla_ops.MLAConfig(**{**mla_ops.models.config.mla_configs[PRESET], "num_hidden_layers": layers,
                                  **(DSA if dsa else {})})
    torch.manual_seed(seed)
    model = mla_ops.MLAModel(config).eval()
    g = torch.Generator().manual_seed(seed)
    context_lens = torch.randint(0, 40, (batch,), generator=g).tolist()
    query_lens = torch.randint(1, 6, (batch,), generator=g).tolist()
    step = model_step(config, context_lens, query_lens, block_size=4, device="cpu", seed=seed)
    scale = 0.05 if fp8 else None
    caches = model.allocate_kv_caches(step["num_blocks"], 4, dtype=torch.float8_e4m3fn if fp8 else None,
                                      k_scale=scale, k_scale_index=scale if dsa else None)
    table = step["block_table"]
    plan = mla_ops.plan_prefill(step["query_start_loc"], step["context_lens"], table, 4, workspace_size=64,
                                max_chunks=4 if device_plan else None, index_topk=config.index_topk,
                                max_index_chunks=64 if device_plan and dsa else None,
                                masked_mha_ratio=masked_mha_ratio)
    recorder = LayerCensus(model)
    launches = recorder.triton_launches() if backend == "triton" else contextlib.nullcontext()
    try:
        with torch.no_grad(), launches, recorder:
            model(step["input_ids"], step["positions"], caches, step["slot_mapping"], plan, backend=backend)
    finally:
        recorder.remove()
    per_layer = [sum(c.values()) for c in recorder.ops]
    step_only = [sum(c.values()) for c in recorder.step_only]
    dense = [q for q, c in zip(query_lens, context_lens) if not dsa or c + q <= config.index_topk]
    return dict(backend=backend, batch=batch, plan="device" if device_plan else "host", cache="float8_e4m3fn" if fp8 else "float32",
                dsa=dsa, masked_mha_ratio=masked_mha_ratio, tokens=sum(query_lens), dense_routed_tokens=sum(dense),
                suffix_tokens_per_layer=recorder.suffix_tokens,
                layers=layers, ops_per_layer=per_layer, step_only_per_layer=step_only,
                step_only_ops=dict(sorted(recorder.step_only[-1].items())),
                ops=dict(sorted(recorder.ops[-1].items())))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_census", description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--dsa", action="store_true", help="the tiny preset with DeepSeek Sparse Attention")
    parser.add_argument("--backend", choices=("torch", "triton"), default="torch",
                        help="triton: Triton's interpreter, which needs TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    if args.backend == "triton" and not interpreting():
        parser.error("--backend triton runs Triton's interpreter on CPU: set TRITON_INTERPRET=1")
    rows = []
    for device_plan in (False, True):
        for fp8 in (False, True):
            for batch in args.batches:
                row = census(batch, device_plan, fp8, backend=args.backend, dsa=args.dsa)
                rows.append(row)
                print(f"{row['plan']:6} {row['cache']:13} B={batch:3}: {row['ops_per_layer'][-1]:4} ops per layer, "
                      f"{row['step_only_per_layer'][-1]:3} of them step-only; suffix over "
                      f"{row['suffix_tokens_per_layer'][-1]} of {row['tokens']} tokens", flush=True)
    if args.json:
        write_json_atomic(args.json, dict(benchmark="step_census", preset=PRESET, backend=args.backend,
                                          dsa=DSA if args.dsa else None, results=rows))
    return rows


if __name__ == "__main__":
    main()
