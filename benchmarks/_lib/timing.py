"""The benchmarks' timers, each with the semantics its callers rely on.

* ``median_ms``: per call; CUDA events on a CUDA device (the GPU time of the work the call queues),
  else wall time; median after warm-up calls.
* ``graph_replay_ms``: ``median_ms`` of the replay of one CUDA-graph capture of the step.
* ``per_step_ms``: steady state, steps back to back with one synchronisation at the end (a
  host-bound step shows its host time, a GPU-bound one its GPU time).
* ``best_of_interleaved_s``: several variants timed in turn, round after round, best wall time of
  each (load changes on a shared machine hit every variant alike).
* ``thread_time_samples``: interleaved samples of the thread's CPU time (time spent descheduled
  does not count), the variants' order rotated every round.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch


def median_ms(fn: Callable, device: torch.device | None = None, reps: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of ``reps`` calls after ``warmup`` calls (CUDA events on a CUDA device)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device is not None and device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def graph_replay_ms(step: Callable, device: torch.device, reps: int) -> float | None:
    """Milliseconds per replay of ``step`` captured in a CUDA graph (``median_ms``); None off CUDA.

    One warm-up call runs on a side stream before the capture (Triton compiles there)."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = median_ms(graph.replay, device, reps)
    del graph
    return ms


def per_step_ms(fn: Callable, device: torch.device, reps: int) -> float:
    """Steady-state milliseconds per step: ``reps`` steps back to back, one sync at the end."""
    for _ in range(2 if device.type == "cuda" else 1):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) * 1e3 / reps


def best_of_interleaved_s(fns: dict[str, Callable], repeats: int) -> dict[str, float]:
    """Per name, the fastest of ``repeats`` wall times (seconds), the variants run in turn each round
    after one warm-up call each."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def thread_time_samples(fns: dict[str, Callable], rounds: int, sample_ns: int = 200_000,
                        max_calls: int = 50) -> tuple[dict[str, list[float]], dict[str, object]]:
    """``rounds`` samples per name of the thread's CPU time per call (ns), and each function's result.

    A warm-up call per function returns its result and sizes its samples: a sample times enough
    back-to-back calls to last about ``sample_ns`` (at most ``max_calls``), divided by their number.
    The functions run round-robin, the order rotated every round.
    """
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    results, calls = {}, {}
    for n in names:
        t0 = time.thread_time_ns()
        results[n] = fns[n]()
        calls[n] = max(1, min(max_calls, sample_ns // max(time.thread_time_ns() - t0, 1)))
    for i in range(rounds):
        for n in names[i % len(names):] + names[: i % len(names)]:
            fn, k = fns[n], calls[n]
            t0 = time.thread_time_ns()
            for _ in range(k):
                fn()
            samples[n].append((time.thread_time_ns() - t0) / k)
    return samples, results
