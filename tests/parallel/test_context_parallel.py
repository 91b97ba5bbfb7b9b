"""Context parallel (DESIGN §10) on CPU: planning and running in a group of one rank in this process,
and real multi-process runs over gloo on 127.0.0.1 against the dense float64 reference. (The
layout: test_layout.py; the cost model: test_cost_model.py; the latent attention op:
tests/ops/test_absorbed.py.)

Multi-process runs: ``python -m tests.support.cp_worker`` ranks joined through a TCPStore this
process serves on a free port (port 0), every rank's output in a log file; a run is stopped as
soon as one rank fails or when its deadline passes (and gloo's own timeout is 90 s), so a hang
cannot outlive the test. One launch per world size runs all its cases (process start-up is most
of the cost on 2 cores).
"""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

import mla_ops
from tests.support import REPO_ROOT
from tests.support.batches import paged_cache
from tests.support.gpu import needs_cuda

WORKER = "tests.support.cp_worker"  # run as a module from the repository root

CASES_2 = ["all_gather", "absorbed", "mixed", "interleave_4", "interleave_4_all_gather", "cost_model",
           "whole_requests", "fp8_cache", "fp8_all_gather", "fp8_device_form", "device_form",
           "device_form_truncated", "no_context", "disagreement", "compiled_aot_eager", "compiled_aot_eager_fp8"]
CASES_4 = ["mixed", "interleave_4", "fp8_cache", "fp8_all_gather", "fp8_device_form", "device_form", "disagreement"]


# ---- multi-process runs (first: no process group exists in this process yet) ----------------------


@dataclasses.dataclass
class Run:
    results: dict  # (case, rank) -> the worker's RESULT
    logs: list[str]
    returncodes: list
    timed_out: bool
    seconds: float

    def report(self, case: str, rank: int) -> str:
        got = self.results.get((case, rank))
        if got and "error" in got:
            return f"rank {rank} failed {case}:\n{got['error']}"
        return (f"no result for {case} on rank {rank} (return codes {self.returncodes}, timed out: "
                f"{self.timed_out}); log of rank {rank}:\n{self.logs[rank][-4000:]}")


def launch(world: int, cases: list[str], timeout_s: float, worker: str = WORKER, env: dict | None = None) -> Run:
    """Run ``worker`` on ``world`` ranks; stop every rank once one fails or the deadline passes.
    ``env``: extra environment variables of the ranks."""
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", tmp)
        files = [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, "-m", worker, str(r), str(world), str(store.port), *cases],
                                  stdout=files[r], stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
                 for r in range(world)]
        timed_out = False
        while any(p.poll() is None for p in procs):
            failed = any(p.returncode not in (None, 0) for p in procs)
            timed_out = time.monotonic() - start > timeout_s
            if failed or timed_out:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.2)
        for p in procs:
            p.wait()
        logs = []
        for f in files:
            f.seek(0)
            logs.append(f.read())
            f.close()
    results = {}
    for log in logs:
        for line in log.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
                results[(result["case"], result["rank"])] = result
    return Run(results, logs, [p.returncode for p in procs], timed_out, time.monotonic() - start)


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def get(world: int) -> Run:
        if world not in cache:
            cache[world] = launch(world, CASES_2 if world == 2 else CASES_4, timeout_s=240)
        return cache[world]

    return get


@pytest.mark.parametrize("world,case", [(2, c) for c in CASES_2] + [(4, c) for c in CASES_4])
def test_multi_process_against_dense_reference(runs, world, case):
    """Each case on every rank: the rank's heads equal the dense float64 reference (worker docstring)."""
    run = runs(world)
    for rank in range(world):
        result = run.results.get((case, rank))
        assert result is not None and "error" not in result, run.report(case, rank)


def test_a_failing_rank_stops_the_run():
    """The launcher itself: when a rank fails, the others are stopped, here one that hangs."""
    run = launch(2, ["rank_0_fails"], timeout_s=120)
    assert "rank 0 fails on purpose" in run.results[("rank_0_fails", 0)]["error"]
    assert run.returncodes == [1, -9] and not run.timed_out, run.report("rank_0_fails", 1)  # rank 1: killed


@pytest.mark.skipif(os.environ.get("MLA_OPS_CP_INDUCTOR") != "1",
                    reason="Inductor's C++ build of the step takes minutes on 2 cores: set MLA_OPS_CP_INDUCTOR=1")
def test_compiled_with_inductor():
    cases = ["compiled_inductor", "compiled_inductor_fp8"]
    run = launch(2, cases, timeout_s=900)
    for case in cases:
        for rank in range(2):
            result = run.results.get((case, rank))
            assert result is not None and "error" not in result, run.report(case, rank)


def test_context_parallel_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(ValueError, match="initialized torch.distributed process group"):
        mla_ops.ContextParallel().world_size


# ---- one rank: equal to the single-device path; planning errors -----------------------------------


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo group of one rank in this process (a HashStore: no network), removed afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    cuda = torch.cuda.is_available() and dist.is_nccl_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def prefill_batch(seed=0, dtype=torch.float64):
    heads, latent, rope, nope, value = 2, 16, 8, 8, 8
    contexts, queries = [9, 0, 30, 2], [2, 3, 1, 6]
    cache, table, ctx = paged_cache(contexts, 4, latent + rope, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = sum(queries)
    qsl = torch.tensor([0, *np.cumsum(queries)], dtype=torch.int32)
    randn = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return dict(q=randn(tokens, heads, nope + rope), kv_c=randn(tokens, latent), k_pe=randn(tokens, rope),
                cache=cache, table=table, qsl=qsl, ctx=ctx, weight=randn(heads * (nope + value), latent) / 4,
                scale=0.25)


@pytest.mark.parametrize("absorb_max_query_len", [0, 2, None, 100])
@pytest.mark.parametrize("max_chunks", [None, 8])
def test_one_rank_equals_single_device(world_of_one, absorb_max_query_len, max_chunks):
    b = prefill_batch()
    expect = mla_ops.mla_prefill(b["q"], b["kv_c"], b["k_pe"], b["cache"], b["table"], b["qsl"], b["ctx"],
                                 b["weight"], b["scale"], workspace_size=8, absorb_max_query_len=0)
    cp = mla_ops.ContextParallel(interleave=2)
    plan = mla_ops.plan_prefill(b["qsl"], b["ctx"], b["table"], 4, workspace_size=8, max_chunks=max_chunks,
                                absorb_max_query_len=absorb_max_query_len, max_absorbed_tokens=16,
                                context_parallel=cp)
    out = mla_ops.run_prefill(b["q"], b["kv_c"], b["k_pe"], b["cache"], b["weight"], b["scale"], plan)
    torch.testing.assert_close(out, expect, rtol=0, atol=1e-12)


def test_a_packed_cache_format_is_refused_by_name(world_of_one):
    b = prefill_batch()
    plan = mla_ops.plan_prefill(b["qsl"], b["ctx"], b["table"], 4, workspace_size=8,
                                context_parallel=mla_ops.ContextParallel())
    packed = torch.zeros(b["cache"].shape[0], 4, 656, dtype=torch.uint8)
    with pytest.raises(ValueError, match="context_parallel does not read fp8_ds_mla caches"):
        mla_ops.begin_step(plan, packed, kv_cache_format="fp8_ds_mla")


@pytest.mark.parametrize("max_chunks", [None, 8])
def test_fp8_rows_travel_as_fp8(world_of_one, max_chunks):
    """An fp8 cache's rows are all-gathered as its bytes (uint8, 1 byte an element: ``local_part``)
    and dequantized after the gather: the output equals one device's fp8 output, and bit for bit the
    output from the cache dequantized beforehand (whose rows travel in float32)."""
    from mla_ops.parallel import collectives

    b = prefill_batch(dtype=torch.float32)
    k_scale = torch.tensor([0.5])
    cache = (b["cache"] / k_scale).to(torch.float8_e4m3fn)
    plain_cache = cache.float() * k_scale  # what gather_context writes on one device
    plan = mla_ops.plan_prefill(b["qsl"], b["ctx"], b["table"], 4, workspace_size=8, max_chunks=max_chunks,
                                absorb_max_query_len=0, context_parallel=mla_ops.ContextParallel())
    sent, original = [], collectives.all_gather

    def record(x, group):
        sent.append(x)
        return original(x, group)

    collectives.all_gather = record
    try:
        out = mla_ops.run_prefill(b["q"], b["kv_c"], b["k_pe"], cache, b["weight"], b["scale"], plan,
                                  k_scale=k_scale)
        sent_fp8, sent[:] = list(sent), []
        out_plain = mla_ops.run_prefill(b["q"], b["kv_c"], b["k_pe"], plain_cache, b["weight"], b["scale"], plan)
    finally:
        collectives.all_gather = original
    cpp, width = plan.context_parallel, b["cache"].shape[-1]
    rows = list(cpp.chunk_part_rows) if max_chunks is None else [cpp.part_rows] * cpp.num_chunks
    assert [tuple(x.shape) for x in sent_fp8] == [(r, width) for r in rows]
    assert all(x.dtype == torch.uint8 and x.element_size() == 1 for x in sent_fp8)
    assert all(x.dtype == torch.float32 for x in sent) and len(sent) == len(sent_fp8)
    assert sum(x.nbytes for x in sent_fp8) * 4 == sum(x.nbytes for x in sent)  # a quarter of float32's bytes
    assert torch.equal(out, out_plain)
    single = mla_ops.mla_prefill(b["q"], b["kv_c"], b["k_pe"], cache, b["table"], b["qsl"], b["ctx"], b["weight"],
                                 b["scale"], workspace_size=8, absorb_max_query_len=0, k_scale=k_scale)
    torch.testing.assert_close(out, single, rtol=0, atol=1e-5)


def test_plan_is_a_pytree_with_static_config(world_of_one):
    b = prefill_batch()
    cp = mla_ops.ContextParallel(check=True)
    plan = mla_ops.plan_prefill(b["qsl"], b["ctx"], b["table"], 4, workspace_size=8, max_chunks=4,
                                absorb_max_query_len=2, max_absorbed_tokens=4, context_parallel=cp)
    leaves, spec = pytree.tree_flatten(plan)
    assert all(isinstance(x, (torch.Tensor, int, str)) or x is None for x in leaves)  # the config is no leaf
    again = pytree.tree_unflatten(leaves, spec)
    assert again.context_parallel.config is cp and again.context_parallel.num_absorbed_tokens == 4
    assert torch.equal(again.context_parallel.reorder, plan.context_parallel.reorder)


def test_host_plan_sizes_each_chunks_parts_to_its_largest_share(world_of_one):
    b = prefill_batch()  # 41 context rows, 8-row chunks: the last chunk holds one row
    plan = mla_ops.plan_prefill(b["qsl"], b["ctx"], b["table"], 4, workspace_size=8, absorb_max_query_len=0,
                                context_parallel=mla_ops.ContextParallel())
    cpp = plan.context_parallel
    assert cpp.chunk_part_rows == (8, 8, 8, 8, 8, 1) and cpp.part_rows == 8
    device = mla_ops.plan_prefill(b["qsl"], b["ctx"], b["table"], 4, workspace_size=8, max_chunks=7,
                                  absorb_max_query_len=0, context_parallel=mla_ops.ContextParallel())
    assert device.context_parallel.chunk_part_rows is None and device.context_parallel.part_rows == 8  # static


@pytest.mark.parametrize("max_chunks", [None, 7])
@pytest.mark.parametrize("absorb", [0, 2])
def test_absorbed_context_lens_is_a_b_int32_tensor_with_or_without_absorbed_requests(world_of_one, max_chunks,
                                                                                      absorb):
    b = prefill_batch()
    plan = mla_ops.plan_prefill(b["qsl"], b["ctx"], b["table"], 4, workspace_size=8, absorb_max_query_len=absorb,
                                max_chunks=max_chunks, context_parallel=mla_ops.ContextParallel())
    lens = plan.absorbed_context_lens
    assert isinstance(lens, torch.Tensor) and lens.dtype == torch.int32 and lens.shape == b["ctx"].shape
    if max_chunks is None:  # the device form routes within its static token slots
        assert lens.tolist() == ([9, 0, 30, 0] if absorb else [0, 0, 0, 0])  # queries [2, 3, 1, 6]


def test_planning_errors_name_the_argument(world_of_one):
    b = prefill_batch()
    plan = lambda **kw: mla_ops.plan_prefill(b["qsl"], b["ctx"], b["table"], 4, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="workspace_size must hold at least one stripe"):
        plan(workspace_size=3, context_parallel=mla_ops.ContextParallel(interleave=4))
    with pytest.raises(ValueError, match="split_alignment must be 1 or a multiple of"):
        plan(workspace_size=16, split_alignment=6, context_parallel=mla_ops.ContextParallel(interleave=4))
    with pytest.raises(TypeError, match="context_parallel must be a mla_ops.ContextParallel"):
        plan(context_parallel="world")
    with pytest.raises(ValueError, match="max_chunks \\(the device form\\) plans only policy='packed', got policy='whole_requests'"):
        plan(max_chunks=2, policy="whole_requests", context_parallel=mla_ops.ContextParallel())
    with pytest.raises(ValueError, match="absorb_max_query_len must be an int >= 0"):
        plan(absorb_max_query_len=-1, context_parallel=mla_ops.ContextParallel())
    with pytest.raises(ValueError, match="block_table row 2 has 1 blocks"):
        mla_ops.plan_prefill(b["qsl"], b["ctx"], b["table"][:, :1], 4, context_parallel=mla_ops.ContextParallel())
    with pytest.raises(ValueError, match="interleave must be a positive int"):
        mla_ops.ContextParallel(interleave=0)
    with pytest.raises(ValueError, match="max_absorbed_tokens must be an int >= 0"):
        plan(max_absorbed_tokens=-1, context_parallel=mla_ops.ContextParallel())
    with pytest.raises(TypeError, match="check must be True, False or None"):
        mla_ops.ContextParallel(check="yes")


# ---- GPU (marked cuda; one GPU: a group of one rank over NCCL) ------------------------------------


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("max_chunks", [None, 8])
def test_cuda_one_rank_equals_single_device(world_of_one, max_chunks):
    b = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in prefill_batch(dtype=torch.float32).items()}
    expect = mla_ops.mla_prefill(b["q"], b["kv_c"], b["k_pe"], b["cache"], b["table"], b["qsl"], b["ctx"],
                                 b["weight"], b["scale"], workspace_size=8, absorb_max_query_len=0)
    cp = mla_ops.ContextParallel(interleave=2, check=True)
    plan = mla_ops.plan_prefill(b["qsl"], b["ctx"], b["table"], 4, workspace_size=8, max_chunks=max_chunks,
                                absorb_max_query_len=2, max_absorbed_tokens=16, context_parallel=cp)
    out = mla_ops.run_prefill(b["q"], b["kv_c"], b["k_pe"], b["cache"], b["weight"], b["scale"], plan)
    torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-4)
