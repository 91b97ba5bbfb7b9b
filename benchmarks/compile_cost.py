"""Cold compile cost on CPU: a whole compiled step against regional compilation, by layers and buckets.

Every measurement runs in a fresh process with an empty Inductor cache (a cold start), on the
``tiny`` preset with float32 weights, and reports the seconds to the first output, the graphs Dynamo
made and its restarts ("Restarting analysis", e.g. when float attributes are tensorified), the CPU seconds
to the first output (``cpu_seconds``: this process's and the C++ compiler's, with one compile thread; on a
machine shared with other work a steadier measure than the wall clock), and where the compile's seconds went
(``phases``: torch's own timers, ``phase_seconds``); the by-layers rows also the steady step time after it
(``step_ms`` and its CPU time ``step_cpu_ms``, one thread, the mean of 20 steps). ``--repeats N`` runs each
measurement N times (each its own process) and keeps the run of least CPU time, with every run's wall and
CPU seconds and the machine's load around it in ``runs`` (``--interleave``: in rounds over the layer counts,
so a load that comes and goes falls on every count alike):

* ``whole`` (by layers): ``torch.compile(step, fullgraph=True, dynamic=True)`` of a step that plans
  on the device (``max_chunks=4``) and runs the model: one graph, each layer a nested compile region
  traced once per layer kind and stamped out for every other layer (``mla_ops.models.regions``), the
  caches a list of one tensor per layer, marked static;
* ``whole-between`` (``--between``, torch >= 2.14): the same, each layer's rows written between the regions as
  on torch 2.13; ``whole-nowrite`` (``--floor``): the same with no cache write at all (its output is not the
  model's), the floor of what a region call per layer costs on this torch; ``whole-stacked`` (``--stacked``): the
  same step of a stacked model (``MLAModel.stack_layers()``, ``allocate_kv_caches(..., stacked=True)``), each run
  of like layers one ``scan`` (``mla_ops.models.regions.run_stacked``);
* ``regional`` (by layers): ``MLAModel.compile_layers()`` and the same step run as is: the layers'
  dense regions compiled once and shared by every layer;
* ``warmup``: ``PrefillGraphs(mode="compile").warmup()`` of 20 buckets (``max_tokens=32``,
  ``max_requests=2``: 2 token x 2 request x 5 chunk buckets) against one bucket (T=32, B=2, K=16),
  regional (what ``mode="compile"`` does for an ``MLAModel``) and, with ``--whole-buckets``, whole
  steps per bucket (a model without ``compile_layers``; minutes).

    python -m benchmarks.compile_cost --json benchmarks/results/compile_cost.json \
        --plot benchmarks/results/compile_cost.png
    python -m benchmarks.compile_cost --layers --whole-layers 1 8 61 --no-warmups --repeats 3 --interleave \
        --json benchmarks/results/compile_cost_torch2.14.json   # whole steps by depth alone, one torch
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

import torch
from torch._dynamo.utils import counters

import mla_ops
from mla_ops.models import regions
from mla_ops.models.layer import ModelStep
from benchmarks._lib import plot as plotting
from benchmarks._lib.batches import model_step
from benchmarks._lib.report import write_json_atomic

LAYERS = (1, 2, 4, 8, 61)
WHOLE_LAYERS = LAYERS
WHOLE_KINDS = ("whole",)
# The whole step with each layer's rows written between the regions, as on torch 2.13, where torch >= 2.14 would
# write them inside (``regions.WRITES_IN_REGIONS``): what the writes inside change (``--between``).
BETWEEN = "whole-between"
# The whole step with no cache write at all (its caches stay zero: not the model's output): what torch's region
# calls alone cost per layer, the floor under both ways of writing (``--floor``).
FLOOR = "whole-nowrite"
# The whole step of a stacked model (``stack_layers()``, the latent caches one stacked tensor): each run of like
# layers one scan, whatever the depth (``--stacked``).
STACKED = "whole-stacked"
EXTRA_KINDS = (BETWEEN, FLOOR, STACKED)
STEPS = 20  # steps timed after the first output (and 3 warm ones): the steady step time


def _config(layers: int):
    return dataclasses.replace(mla_ops.MLAConfig.from_name("tiny"), num_hidden_layers=layers)


class _Restarts(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record):
        self.count += record.getMessage().startswith("Restarting analysis")


class _Whole(torch.nn.Module):
    """The model without ``compile_layers``: ``PrefillGraphs`` then compiles whole steps."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def measure(kind: str, size: int) -> dict:
    """One cold measurement in this process (run by ``main`` in a subprocess of its own)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    mla_ops.enable()  # as the README's recipe does
    restarts = _Restarts()
    dynamo_log = logging.getLogger("torch._dynamo.convert_frame")
    level = dynamo_log.level
    dynamo_log.setLevel(logging.INFO)
    dynamo_log.addHandler(restarts)
    try:
        return _measure(kind, size, restarts)
    finally:
        dynamo_log.removeHandler(restarts)
        dynamo_log.setLevel(level)


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (the C++ compiler): what a compile costs, apart
    from the waits of a machine shared with other work."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def phase_seconds() -> dict:
    """This process's compile seconds by phase, from torch's timers (``torch._dynamo.utils.calculate_time_spent``):
    ``dynamo`` (bytecode tracing, guards: the frame's compile less its backend), ``aot_autograd`` (the backend less
    Inductor: functionalization, the joint graph's passes), ``inductor`` (lowering, scheduling: Inductor less its
    code generation) and ``codegen`` (Python and C++ source, the C++ compile, loading the modules)."""
    spent = torch._dynamo.utils.calculate_time_spent()
    frame, backend, inductor, codegen = (spent.get(key, 0.0) for key in (
        "entire_frame_compile", "backend_compile", "inductor_compile", "code_gen"))
    phases = dict(dynamo=frame - backend, aot_autograd=backend - inductor, inductor=inductor - codegen,
                  codegen=codegen)
    return {name: round(seconds, 2) for name, seconds in phases.items()}


def _measure(kind: str, size: int, restarts: _Restarts) -> dict:
    block_size, workspace = 4, 64
    graphs = counters["stats"]["unique_graphs"]
    config = _config(1 if kind.startswith("warmup") else size)
    model = mla_ops.MLAModel(config).eval()
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    with torch.no_grad():
        if kind == BETWEEN:
            regions.WRITES_IN_REGIONS = False  # this process only
        if kind == FLOOR:
            ModelStep.write = lambda self, caches, made: None  # this process only
        if kind in WHOLE_KINDS + EXTRA_KINDS + ("regional",):
            x = model_step(config, [9, 30, 0], [3, 5, 4], block_size, "cpu")
            if kind == STACKED:
                model.stack_layers()
            caches = model.allocate_kv_caches(x["num_blocks"], block_size, stacked=kind == STACKED)
            for cache in caches.tensors:
                torch._dynamo.mark_static(cache)  # a runner's fixed buffers, as the README's recipe

            def step(ids, positions, caches, slots, table, qsl, ctx):
                plan = mla_ops.plan_prefill(qsl, ctx, table, 4, 64, max_chunks=4)
                return model(ids, positions, caches, slots, plan)

            if kind in WHOLE_KINDS + EXTRA_KINDS:
                step = torch.compile(step, fullgraph=True, dynamic=True)
            else:
                model.compile_layers()
            args = (x["input_ids"], x["positions"], caches, x["slot_mapping"], x["block_table"], x["query_start_loc"],
                    x["context_lens"])
            step(*args)
            seconds, cpu_seconds = time.perf_counter() - start, _cpu_seconds() - cpu_start
            for _ in range(3):  # warm
                step(*args)
            begin, cpu_begin = time.perf_counter(), time.process_time()
            for _ in range(STEPS):
                step(*args)
            step_ms = (time.perf_counter() - begin) / STEPS * 1e3
            step_cpu_ms = (time.process_time() - cpu_begin) / STEPS * 1e3
        else:  # "warmup-regional-20", "warmup-whole-1", ...
            _, scope, count = kind.split("-")
            buckets = dict(chunk_buckets=(1, 2, 4, 8, 16)) if count == "20" else \
                dict(token_buckets=(32,), request_buckets=(2,), chunk_buckets=(16,))
            runner = mla_ops.PrefillGraphs(model if scope == "regional" else _Whole(model), max_tokens=32,
                                           max_requests=2, max_blocks_per_request=64, block_size=block_size,
                                           workspace_size=workspace, mode="compile", **buckets)
            runner.warmup(model.allocate_kv_caches(64, block_size))
            assert len(runner.built) == int(count)
            seconds, cpu_seconds, step_ms = time.perf_counter() - start, _cpu_seconds() - cpu_start, None
    row = dict(kind=kind, size=size, seconds=round(seconds, 2), cpu_seconds=round(cpu_seconds, 2), graphs=counters["stats"]["unique_graphs"] - graphs,
               restarts=restarts.count, phases=phase_seconds())
    if step_ms is not None:
        row["step_ms"], row["step_cpu_ms"] = round(step_ms, 2), round(step_cpu_ms, 2)
    return row


def run_cold(kind: str, size: int) -> dict:
    """``measure`` in a fresh interpreter with an empty Inductor cache; ``load``: the machine's 1-minute load
    average before and after it (other work on a shared machine stretches the wall clock, less the CPU time)."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as cache:
        # One compile thread: the C++ builds run as this process's children, whose CPU time cpu_seconds counts.
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_COMPILE_THREADS="1")
        done = subprocess.run([sys.executable, "-m", "benchmarks.compile_cost", "--measure", kind, str(size)],
                              env=env, capture_output=True, text=True, check=True)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["load"] = [round(load, 1), round(os.getloadavg()[0], 1)]
    return row


def fastest(done: list[dict]) -> dict:
    """Of one measurement's cold runs, the one whose first output took the least CPU time (the least disturbed by
    other work), every run's wall and CPU seconds and load in ``runs``."""
    row = min(done, key=lambda r: r["cpu_seconds"])
    if len(done) > 1:
        row["runs"] = [[r["seconds"], r["cpu_seconds"], r["load"]] for r in done]
    return row


def run_fastest(kind: str, size: int, repeats: int = 1) -> dict:
    """``run_cold`` ``repeats`` times, the fastest kept (``fastest``)."""
    return fastest([run_cold(kind, size) for _ in range(repeats)])


def run_interleaved(kind: str, sizes, repeats: int) -> list[dict]:
    """``run_cold`` of every size, ``repeats`` rounds over the sizes (1, 8, 61, 1, 8, 61, ...: a load that comes
    and goes falls on every size alike), the fastest of each size kept (``fastest``)."""
    done = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            done[n].append(run_cold(kind, n))
            print(done[n][-1], flush=True)
    return [fastest(done[n]) for n in sizes]


def run(layers=LAYERS, whole_layers=WHOLE_LAYERS, whole_buckets: bool = False, warmups: bool = True,
        repeats: int = 1, between: bool = False, interleave: bool = False, floor: bool = False,
        stacked: bool = False) -> dict:
    rows = []
    whole_kinds = WHOLE_KINDS + ((BETWEEN,) if between and regions.WRITES_IN_REGIONS else ()) + \
        ((FLOOR,) if floor else ()) + ((STACKED,) if stacked else ())
    by_layers = tuple((kind, sizes) for kind, sizes in (("regional", layers),) + tuple(
        (kind, whole_layers) for kind in whole_kinds) if sizes)
    for kind, sizes in by_layers:
        if interleave:
            rows += run_interleaved(kind, sizes, repeats)
            continue
        for n in sizes:
            rows.append(run_fastest(kind, n, repeats))
            print(rows[-1], flush=True)
    warmup_kinds = ["warmup-regional-1", "warmup-regional-20"] if warmups else []
    if whole_buckets:
        warmup_kinds += ["warmup-whole-1", "warmup-whole-20"]
    for kind in warmup_kinds:
        rows.append(run_fastest(kind, 0, repeats))
        print(rows[-1], flush=True)
    return dict(benchmark="compile_cost", preset="tiny", torch=torch.__version__,
                writes_in_regions=regions.WRITES_IN_REGIONS, repeats=repeats, rows=rows, ratios=ratios_of(rows))


def ratios_of(rows: list[dict]) -> dict:
    """The rows' ratios: by depth (8 / 1, 61 / 8 layers: wall and CPU seconds), each phase's milliseconds per layer
    from 8 to 61 layers, each whole kind's steady step against regional's, and 20 buckets against 1."""
    sizes_of: dict[str, list[int]] = {}
    for r in rows:
        if not r["kind"].startswith("warmup"):
            sizes_of.setdefault(r["kind"], []).append(r["size"])
    by_layers = tuple(sizes_of.items())
    seconds = {(r["kind"], r["size"]): r["seconds"] for r in rows}
    ratios = {}
    for suffix, field in (("", "seconds"), ("_cpu", "cpu_seconds")):
        by = {(r["kind"], r["size"]): r[field] for r in rows}
        for kind, sizes in by_layers:
            if 1 in sizes and 8 in sizes:
                ratios[f"{kind}_8_over_1_layers{suffix}"] = round(by[kind, 8] / by[kind, 1], 2)
            if 8 in sizes and 61 in sizes:
                ratios[f"{kind}_61_over_8_layers{suffix}"] = round(by[kind, 61] / by[kind, 8], 2)
    phases = {(r["kind"], r["size"]): r["phases"] for r in rows}
    for kind, sizes in by_layers:
        if 8 in sizes and 61 in sizes:  # what each phase spends on each layer past the 8th (wall seconds)
            ratios[f"{kind}_ms_per_layer_8_to_61"] = {
                phase: round((phases[kind, 61][phase] - phases[kind, 8][phase]) / 53 * 1e3)
                for phase in phases[kind, 8]}
    for suffix, field in (("", "step_ms"), ("_cpu", "step_cpu_ms")):
        step_ms = {(r["kind"], r["size"]): r[field] for r in rows if field in r}
        for kind, n in sorted(step_ms):
            if kind != "regional" and ("regional", n) in step_ms:
                ratios[f"{kind}_over_regional_step_{n}_layers{suffix}"] = round(
                    step_ms[kind, n] / step_ms["regional", n], 2)
    for scope in ("regional", "whole"):
        if (f"warmup-{scope}-20", 0) in seconds:
            ratios[f"{scope}_20_buckets_over_1"] = round(
                seconds[f"warmup-{scope}-20", 0] / seconds[f"warmup-{scope}-1", 0], 2)
    return ratios


def plot(result: dict, path: str) -> None:
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind in WHOLE_KINDS + EXTRA_KINDS + ("regional",):
        rows = [r for r in result["rows"] if r["kind"] == kind]
        if not rows:
            continue
        ax.plot([r["size"] for r in rows], [r["seconds"] for r in rows], "o-", label=kind)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decoder layers (tiny preset)")
    ax.set_ylabel("cold seconds to the first output")
    ax.set_title("torch.compile cost: whole step vs regional (CPU)")
    ax.legend()
    plotting.save(fig, path)


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--layers", type=int, nargs="*", default=list(LAYERS), help="regional (none: no rows)")
    parser.add_argument("--whole-layers", type=int, nargs="*", default=list(WHOLE_LAYERS))
    parser.add_argument("--whole-buckets", action="store_true", help="also whole steps per bucket (minutes)")
    parser.add_argument("--no-warmups", action="store_true", help="by layers only: no PrefillGraphs warm-up rows")
    parser.add_argument("--repeats", type=int, default=1, help="cold runs per measurement, the least CPU time kept")
    parser.add_argument("--between", action="store_true",
                        help="also whole steps whose rows are written between the regions (torch >= 2.14)")
    parser.add_argument("--floor", action="store_true",
                        help="also whole steps that write no cache (wrong output): the region calls' own cost")
    parser.add_argument("--stacked", action="store_true",
                        help="also whole steps of a stacked model (stack_layers(), stacked caches): one scan per run")
    parser.add_argument("--interleave", action="store_true",
                        help="repeats in rounds over the layer counts (1, 8, 61, 1, 8, 61, ...), not in a row")
    parser.add_argument("--measure", nargs=2, metavar=("KIND", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure[0], int(args.measure[1]))))
        return None
    result = run(args.layers, args.whole_layers, args.whole_buckets, not args.no_warmups, args.repeats, args.between,
                 args.interleave, args.floor, args.stacked)
    print(result["ratios"])
    if args.json:
        write_json_atomic(args.json, result)
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
