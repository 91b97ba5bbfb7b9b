"""Context parallel (DESIGN §10) on CPU: the layout, the cost model, the latent attention op, and
real multi-process runs over gloo on 127.0.0.1 against the dense float64 reference.

Multi-process runs: ``tests/context_parallel_worker.py`` ranks joined through a TCPStore this
process serves on a free port (port 0), every rank's output in a log file; a run is stopped as
soon as one rank fails or when its deadline passes (and gloo's own timeout is 90 s), so a hang
cannot outlive the test. One launch per world size runs all its cases (process start-up is most
of the cost on 2 cores).
"""

import dataclasses
import json
import math
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
from mla_ops import _mla, parallel
from mla_ops.ops.absorbed import latent_attention_reference

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "context_parallel_worker.py")
FP8 = torch.float8_e4m3fn
NAN = float("nan")

CASES_2 = ["all_gather", "absorbed", "mixed", "interleave_4", "interleave_4_all_gather", "cost_model",
           "whole_requests", "fp8_cache", "device_form", "device_form_truncated", "no_context", "disagreement",
           "compiled_aot_eager"]
CASES_4 = ["mixed", "interleave_4", "fp8_cache", "device_form", "disagreement"]


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


def launch(world: int, cases: list[str], timeout_s: float) -> Run:
    """Run the worker on ``world`` ranks; stop every rank once one fails or the deadline passes."""
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", tmp)
        files = [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, WORKER, str(r), str(world), str(store.port), *cases],
                                  stdout=files[r], stderr=subprocess.STDOUT, env=env) for r in range(world)]
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
    assert run.returncodes == [1, -9] and not run.timed_out, (run.returncodes, run.timed_out)  # rank 1: killed


@pytest.mark.skipif(os.environ.get("MLA_OPS_CP_INDUCTOR") != "1",
                    reason="Inductor's C++ build of the step takes minutes on 2 cores: set MLA_OPS_CP_INDUCTOR=1")
def test_compiled_with_inductor():
    run = launch(2, ["compiled_inductor"], timeout_s=900)
    for rank in range(2):
        result = run.results.get(("compiled_inductor", rank))
        assert result is not None and "error" not in result, run.report("compiled_inductor", rank)


def test_context_parallel_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(ValueError, match="initialized torch.distributed process group"):
        mla_ops.ContextParallel().world_size


# ---- layout -----------------------------------------------------------------------------------------


def paged(contexts, block_size, width, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-c // block_size) for c in contexts]
    order = torch.randperm(sum(blocks) + 2, generator=g).to(torch.int32)
    table = torch.zeros(len(contexts), max(blocks) + 2, dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks):
        table[r, :n] = order[used : used + n]
        used += n
    cache = torch.randn(len(order), block_size, width, generator=g).to(dtype)
    return cache, table, torch.tensor(contexts, dtype=torch.int32)


def row(cache, table, r, p):
    return cache[table[r, p // cache.shape[1]].long(), p % cache.shape[1]]


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (3, 2), (4, 4), (2, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, FP8])
def test_shard_context_follows_the_vllm_layout(world, interleave, dtype):
    contexts = [0, 1, 17, 64, 5, 33]
    cache, table, ctx = paged(contexts, 4, 6, seed=world * 10 + interleave, dtype=dtype)
    bits = lambda x: x.view(torch.uint8) if x.dtype == FP8 else x  # noqa: E731  (compare fp8 bit for bit)
    held = {r: [] for r in range(len(contexts))}
    for rank in range(world):
        local_cache, local_table = mla_ops.shard_context(cache, table, ctx, rank=rank, world_size=world,
                                                         interleave=interleave)
        assert local_cache.dtype == dtype and local_table.dtype == torch.int32
        lens = parallel.local_context_lens(ctx, rank, world, interleave)
        assert torch.equal(lens, torch.tensor(parallel.local_context_lens(np.array(contexts), rank, world,
                                                                                  interleave), dtype=torch.int32))
        for r, c in enumerate(contexts):
            owned = [p for p in range(c) if (p // interleave) % world == rank]
            assert int(lens[r]) == len(owned)
            for p in owned:
                j = (p // (interleave * world)) * interleave + p % interleave
                assert torch.equal(bits(row(local_cache, local_table, r, j)), bits(row(cache, table, r, p)))
            held[r] += owned
    assert all(sorted(held[r]) == list(range(c)) for r, c in enumerate(contexts))  # each row exactly once


def test_shard_context_rejects_bad_arguments():
    cache, table, ctx = paged([5, 9], 4, 6, seed=0)
    with pytest.raises(ValueError, match="rank must be an int in"):
        mla_ops.shard_context(cache, table, ctx, rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        mla_ops.shard_context(cache, table, ctx, rank=0, world_size=0)
    with pytest.raises(ValueError, match="block_table row 1 has 1 blocks"):
        mla_ops.shard_context(cache, table[:, :1], ctx, rank=0, world_size=1)
    with pytest.raises(TypeError, match="context_lens must be int32"):
        mla_ops.shard_context(cache, table, ctx.long(), rank=0, world_size=1)


# ---- cost model -------------------------------------------------------------------------------------


def test_cost_model_bytes_and_flops_follow_the_documented_formulas():
    model = parallel.CostModel()  # DeepSeek-V3: 128 heads, L=512, P=128, R=64, V=128, bf16, fp32 partials
    k = model.path_costs(np.array([1000]), np.array([10]), 8)  # 16 heads per rank
    assert k["all_gather_bytes"][0] == 1000 * 7 / 8 * 576 * 2
    assert k["absorbed_bytes"][0] == 10 * 16 * 7 * (576 * 2 + 513 * 4)
    assert k["all_gather_flops"][0] == 16 * 1000 * (2 * 512 * 256 + 10 * 2 * 320)
    assert k["absorbed_flops"][0] == 16 * 10 * (2 * 128 * 512 * 2 + 1000 * 2 * 1088)
    one = model.path_costs(np.array([1000]), np.array([10]), 1)
    assert one["all_gather_bytes"][0] == 0 and one["absorbed_bytes"][0] == 0  # one rank moves nothing


def test_cost_model_routes_by_queries_and_context_on_host_and_device():
    model = parallel.CostModel()
    ctx = np.array([100_000, 100_000, 50, 4096, 0])
    queries = np.array([1, 4096, 1, 64, 8])
    host = model.prefers_absorbed(ctx, queries, 8)
    device = model.prefers_absorbed(torch.tensor(ctx, dtype=torch.int32), torch.tensor(queries, dtype=torch.int32), 8)
    assert host.tolist() == device.tolist()
    assert host[0] and not host[1]  # long context: few queries gather their queries, many gather the rows
    # The two terms: a slow link decides by bytes alone, a free one by FLOPs alone.
    k = model.path_costs(ctx, queries, 8)
    slow_link = dataclasses.replace(model, flops_per_byte=1e12).prefers_absorbed(ctx, queries, 8)
    assert slow_link.tolist() == (k["absorbed_bytes"] < k["all_gather_bytes"]).tolist()
    free_link = dataclasses.replace(model, flops_per_byte=0.0).prefers_absorbed(ctx, queries, 8)
    assert free_link.tolist() == (k["absorbed_flops"] < k["all_gather_flops"]).tolist()
    assert slow_link.tolist() != free_link.tolist()  # the batch is one where the two terms disagree


# ---- the latent attention op ------------------------------------------------------------------------


def absorbed_batch(fp8_scale=None, seed=0):
    heads, latent, rope, nope, value = 3, 16, 8, 8, 8
    cache, table, ctx = paged([5, 0, 40, 3], 4, latent + rope, seed=seed, dtype=torch.float64)
    if fp8_scale is not None:
        cache = (cache / fp8_scale).to(FP8)
    g = torch.Generator().manual_seed(seed + 1)
    qsl = torch.tensor([0, 2, 5, 10, 10], dtype=torch.int32)
    q = torch.randn(10, heads, nope + rope, generator=g, dtype=torch.float64)
    weight = torch.randn(heads * (nope + value), latent, generator=g, dtype=torch.float64) / math.sqrt(latent)
    k_scale = None if fp8_scale is None else torch.tensor([fp8_scale])
    return q, cache, table, qsl, ctx, weight, 0.3, k_scale, (heads, latent, nope, value)


@pytest.mark.parametrize("fp8_scale", [None, 0.5])
def test_latent_attention_is_the_absorbed_op_without_fold_and_unfold(fp8_scale):
    q, cache, table, qsl, ctx, weight, scale, k_scale, (heads, latent, nope, value) = absorbed_batch(fp8_scale)
    out = torch.full((10, heads, value), NAN, dtype=torch.float64)
    lse = torch.full((heads, 10), NAN, dtype=torch.float64)
    torch.ops.mla_ops.absorbed_context_attention(q, cache, table, qsl, ctx, weight, scale, k_scale, out, lse)

    w_uk, w_uv = _mla.split_kv_b_proj(weight, heads, nope)
    q_abs = torch.cat([_mla.fold_queries(q, w_uk, q.dtype).transpose(0, 1), q[..., nope:]], dim=-1)
    o_lat = torch.full((10, heads, latent), NAN, dtype=torch.float64)
    lat_lse = torch.full((heads, 10), NAN, dtype=torch.float64)
    torch.ops.mla_ops.latent_context_attention(q_abs, cache, table, qsl, ctx, scale, k_scale, o_lat, lat_lse)
    written = torch.repeat_interleave(ctx > 0, (qsl[1:] - qsl[:-1]).long())
    assert torch.isnan(o_lat[~written]).all() and torch.isnan(lat_lse[:, ~written]).all(), "rows without context"
    unfolded = _mla.unfold_outputs(o_lat.transpose(0, 1), w_uv).transpose(0, 1)
    torch.testing.assert_close(unfolded[written], out[written], rtol=0, atol=1e-12)
    torch.testing.assert_close(lat_lse[:, written], lse[:, written], rtol=0, atol=1e-12)


def test_latent_attention_merges_key_blocks(monkeypatch):
    q, cache, table, qsl, ctx, _, scale, _, (heads, latent, _, _) = absorbed_batch()
    q_abs = torch.randn(10, heads, cache.shape[2], dtype=torch.float64)
    whole = [torch.zeros(10, heads, latent, dtype=torch.float64), torch.zeros(heads, 10, dtype=torch.float64)]
    latent_attention_reference(q_abs, cache, table, qsl, ctx, scale, None, *whole)
    monkeypatch.setattr(mla_ops.ops.absorbed, "KEY_BLOCK", 7)  # 40 rows -> 6 merged blocks
    blocks = [torch.zeros_like(whole[0]), torch.zeros_like(whole[1])]
    latent_attention_reference(q_abs, cache, table, qsl, ctx, scale, None, *blocks)
    torch.testing.assert_close(blocks, whole, rtol=0, atol=1e-12)


def test_latent_attention_opcheck():
    q, cache, table, qsl, ctx, _, scale, _, (heads, latent, _, _) = absorbed_batch()
    q_abs = torch.randn(10, heads, cache.shape[2])
    out, lse = torch.zeros(10, heads, latent), torch.zeros(heads, 10)
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.mla_ops.latent_context_attention,
                          (q_abs, cache.float(), table, qsl, ctx, scale, None, out, lse), test_utils=utils)
    q, cache8, table, qsl, ctx, _, scale, k_scale, _ = absorbed_batch(fp8_scale=0.5)
    torch.library.opcheck(torch.ops.mla_ops.latent_context_attention,  # CPU float8 lacks SchemaCheckMode's math
                          (q_abs, cache8, table, qsl, ctx, scale, k_scale, out, lse), test_utils=utils[1:])


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
    cache, table, ctx = paged(contexts, 4, latent + rope, seed=seed, dtype=dtype)
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


def test_plan_is_a_pytree_with_static_config(world_of_one):
    b = prefill_batch()
    cp = mla_ops.ContextParallel(check=True)
    plan = mla_ops.plan_prefill(b["qsl"], b["ctx"], b["table"], 4, workspace_size=8, max_chunks=4,
                                absorb_max_query_len=2, max_absorbed_tokens=4, context_parallel=cp)
    leaves, spec = pytree.tree_flatten(plan)
    assert all(isinstance(x, torch.Tensor) or x is None for x in leaves)  # the config is no leaf
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


def test_planning_errors_name_the_argument(world_of_one):
    b = prefill_batch()
    plan = lambda **kw: mla_ops.plan_prefill(b["qsl"], b["ctx"], b["table"], 4, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="workspace_size must hold at least one stripe"):
        plan(workspace_size=3, context_parallel=mla_ops.ContextParallel(interleave=4))
    with pytest.raises(ValueError, match="split_alignment must be 1 or a multiple of"):
        plan(workspace_size=16, split_alignment=6, context_parallel=mla_ops.ContextParallel(interleave=4))
    with pytest.raises(TypeError, match="context_parallel must be a mla_ops.ContextParallel"):
        plan(context_parallel="world")
    with pytest.raises(ValueError, match="cannot be combined with policy='whole_requests'"):
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
@pytest.mark.parametrize("dtype,fp8", [(torch.bfloat16, False), (torch.float16, False), (torch.float32, False),
                                       (torch.bfloat16, True)])
@pytest.mark.parametrize("heads", [16, 128])
def test_cuda_latent_attention_kernel(dtype, fp8, heads):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    latent, rope = 512, 64  # DeepSeek's
    cache, table, ctx = paged([700, 0, 33, 1], 64, latent + rope, seed=heads)
    qsl = torch.tensor([0, 3, 5, 22, 23], dtype=torch.int32)
    q = torch.randn(23, heads, latent + rope) / 8
    k_scale = None
    if fp8:
        cache, k_scale = (cache / 0.5).to(FP8), torch.tensor([0.5])
    args = [x.cuda() if isinstance(x, torch.Tensor) else x
            for x in (q.to(dtype), cache if fp8 else cache.to(dtype), table, qsl, ctx, 0.05, k_scale)]
    got = torch.full((23, heads, latent), NAN, device="cuda")
    got_lse = torch.full((heads, 23), NAN, device="cuda")
    want, want_lse = torch.full_like(got, NAN), torch.full_like(got_lse, NAN)
    torch.ops.mla_ops.latent_context_attention(*args, got, got_lse)  # the Triton kernel on CUDA
    latent_attention_reference(*args, want, want_lse)
    written = torch.repeat_interleave(ctx > 0, (qsl[1:] - qsl[:-1]).long()).cuda()
    assert torch.isnan(got[~written]).all(), "rows without context touched"
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    torch.testing.assert_close(got[written], want[written], rtol=tol, atol=tol)
    torch.testing.assert_close(got_lse[:, written], want_lse[:, written], rtol=tol, atol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("max_chunks", [None, 8])
def test_cuda_one_rank_equals_single_device(world_of_one, max_chunks):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    b = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in prefill_batch(dtype=torch.float32).items()}
    expect = mla_ops.mla_prefill(b["q"], b["kv_c"], b["k_pe"], b["cache"], b["table"], b["qsl"], b["ctx"],
                                 b["weight"], b["scale"], workspace_size=8, absorb_max_query_len=0)
    cp = mla_ops.ContextParallel(interleave=2, check=True)
    plan = mla_ops.plan_prefill(b["qsl"], b["ctx"], b["table"], 4, workspace_size=8, max_chunks=max_chunks,
                                absorb_max_query_len=2, max_absorbed_tokens=16, context_parallel=cp)
    out = mla_ops.run_prefill(b["q"], b["kv_c"], b["k_pe"], b["cache"], b["weight"], b["scale"], plan)
    torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-4)
