"""GPU checks: Triton kernels against the torch references, and CUDA-graph capture of a prefill step.

All marked ``cuda`` and skipped without a GPU; ``benchmarks/gpu_check.sh`` runs them on an H200.
"""

import dataclasses
import functools
import math

import pytest
import torch

import mla_ops
from mla_ops.ops.backends import REFERENCE

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

DEVICE = "cuda"
TOL = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def random_chunk(dtype, heads=16, latent=512, nope=128, rope=64, value=128, q_lens=(1, 17, 130, 0, 64),
                 k_lens=(300, 0, 129, 40, 1), seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=g, device=DEVICE, dtype=torch.float32).to(dtype)  # noqa: E731
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    kv = randn(sum(k_lens), heads, nope + value)
    workspace = randn(sum(k_lens) + 5, latent + rope)
    return dict(q=randn(sum(q_lens), heads, nope + rope), k_nope=kv[..., :nope], k_pe=workspace[: sum(k_lens), latent:],
                v=kv[..., nope:], cu_q=cu_q, cu_k=cu_k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_context_attention_kernel(dtype):
    c = random_chunk(dtype)
    starts = torch.tensor([5, 0, 0, 0, 0], dtype=torch.int32, device=DEVICE)  # request 0 continues
    outs = []
    for fn in (torch.ops.mla_ops.context_attention, REFERENCE.context_attention):
        out = torch.full((c["q"].shape[0], 16, 128), 0.5, device=DEVICE, dtype=dtype)
        lse = torch.full((16, c["q"].shape[0]), 1.0, device=DEVICE)
        fn(c["q"], c["k_nope"], c["k_pe"], c["v"], c["cu_q"], c["cu_k"], starts, 0.07, out, lse)
        outs.append((out.float(), lse))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_suffix_attention_kernel(dtype):
    c = random_chunk(dtype, q_lens=(1, 17, 300, 64), k_lens=(1, 17, 300, 64))
    outs = []
    for fn in (torch.ops.mla_ops.suffix_attention, REFERENCE.suffix_attention):
        out = torch.empty(c["q"].shape[0], 16, 128, device=DEVICE, dtype=dtype)
        lse = torch.empty(16, c["q"].shape[0], device=DEVICE)
        fn(c["q"], c["k_nope"], c["k_pe"], c["v"], c["cu_q"], 0.07, out, lse)
        outs.append((out.float(), lse))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("fp8", [False, True])
def test_gather_and_up_project_kernels(fp8):
    g = torch.Generator(device=DEVICE).manual_seed(1)
    cache = torch.randn(300, 64, 576, generator=g, device=DEVICE).to(torch.bfloat16)
    k_scale = None
    if fp8:
        k_scale = torch.tensor([0.05], device=DEVICE)
        cache = (cache.float() / 0.05).to(torch.float8_e4m3fn)
    table = torch.randperm(300, generator=g, device=DEVICE)[:280].view(4, 70).to(torch.int32)
    cu = torch.tensor([0, 1000, 1000, 3000, 3100], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([64, 0, 130, 0], dtype=torch.int32, device=DEVICE)
    weight = torch.randn(16 * 256, 512, generator=g, device=DEVICE).to(torch.bfloat16) / 20
    results = []
    for gather, up in ((torch.ops.mla_ops.gather_context, torch.ops.mla_ops.up_project),
                       (REFERENCE.gather_context, REFERENCE.up_project)):
        workspace = torch.full((4096, 576), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        kv = torch.full((4096, 16 * 256), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        gather(cache, table, cu, starts, k_scale, workspace)
        up(workspace[:, :512], weight, cu, kv)
        results.append((workspace, kv))
    assert torch.equal(results[0][0][:3100], results[1][0][:3100])
    assert torch.isnan(results[0][0][3100:]).all() and torch.isnan(results[0][1][3100:]).all()
    torch.testing.assert_close(results[0][1][:3100].float(), results[1][1][:3100].float(), atol=3e-2, rtol=3e-2)


def test_merge_kernel():
    g = torch.Generator(device=DEVICE).manual_seed(2)
    a, b = (torch.randn(77, 16, 128, generator=g, device=DEVICE).bfloat16() for _ in range(2))
    la, lb = (torch.randn(16, 77, generator=g, device=DEVICE) * 4 for _ in range(2))
    la[3, :5], lb[3, 2:7] = float("inf"), float("-inf")  # empty partials, both conventions
    out, lse = torch.ops.mla_ops.merge_attn_states(a, la, b, lb)
    expect, expect_lse = REFERENCE.merge_attn_states(a, la, b, lb)
    torch.testing.assert_close(out.float(), expect.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, expect_lse)
    assert not out.isnan().any()


def moved(batch, device, dtype):
    """The batch on ``device``, q / weight / a 16-32 bit cache in ``dtype`` (an fp8 cache and k_scale stay)."""
    cache = batch.kv_cache if batch.kv_cache.dtype == torch.float8_e4m3fn else batch.kv_cache.to(dtype)
    return dataclasses.replace(
        batch, q=batch.q.to(device, dtype), kv_cache=cache.to(device), weight=batch.weight.to(device, dtype),
        block_table=batch.block_table.to(device), query_start_loc=batch.query_start_loc.to(device),
        context_lens=batch.context_lens.to(device), k_scale=None if batch.k_scale is None else batch.k_scale.to(device),
    )


def absorbed_batch(dtype, fp8=False, nan_free=False, seed=3):
    """DeepSeek dims (N=16, L=512, R=64, page 64), zero contexts and queries, T = 1 and 130 per request.

    Cache rows outside the contexts are NaN, so an unmasked load shows; ``nan_free`` zeroes them
    (FlashMLA computes whole pages and may multiply a masked NaN value by 0).
    """
    from test_absorbed import make_batch

    batch = make_batch([300, 0, 129, 40, 1, 700], [1, 17, 130, 0, 64, 5], block_size=64, num_heads=16, latent=512,
                       rope=64, nope=128, value=128, dtype=torch.float32, fp8_scale=0.05 if fp8 else None, seed=seed)
    if nan_free:
        batch.kv_cache = torch.nan_to_num(batch.kv_cache.float(), nan=0.0).to(batch.kv_cache.dtype)
    return moved(batch, DEVICE, dtype)


def check_absorbed(batch, fn, dtype):
    """``fn`` (the op's contract) on the GPU against the torch reference on CPU in float32, same inputs."""
    from test_absorbed import written_rows

    out, lse = (t.to(DEVICE) for t in batch.sentinels(128, dtype=dtype))
    fn(*batch.args(), out, lse)
    cpu = moved(batch, "cpu", torch.float32)
    want, want_lse = cpu.sentinels(128, dtype=torch.float32)
    REFERENCE.absorbed_context_attention(*cpu.args(), want, want_lse)
    written = written_rows(cpu)
    out, lse = out.cpu().float(), lse.cpu()
    assert torch.isnan(out[~written]).all() and torch.isnan(lse[:, ~written]).all(), "zero-context rows touched"
    torch.testing.assert_close(out[written], want[written], atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse[:, written], want_lse[:, written], atol=2e-2, rtol=2e-3)


@pytest.mark.parametrize("dtype,fp8", [(torch.bfloat16, False), (torch.float16, False), (torch.float32, False),
                                       (torch.bfloat16, True)])
def test_absorbed_kernel(dtype, fp8):
    check_absorbed(absorbed_batch(dtype, fp8), torch.ops.mla_ops.absorbed_context_attention, dtype)


@pytest.mark.parametrize("num_programs", [3, None])  # forced tiny grids, then the SM count
def test_absorbed_kernel_on_packed_routed_tokens(num_programs, monkeypatch):
    """A scratch of exactly the routed tokens (fold, attention and unfold stride over it); a batch
    that routes nothing leaves out and lse untouched."""
    from test_absorbed import written_rows

    from mla_ops.triton import _common

    monkeypatch.setattr(_common, "PROGRAMS_OVERRIDE", num_programs)
    batch = absorbed_batch(torch.bfloat16, False)
    rows = int(written_rows(batch).sum())
    op = torch.ops.mla_ops.absorbed_context_attention
    check_absorbed(batch, lambda *args: op(*args, rows), torch.bfloat16)
    batch.context_lens = torch.zeros_like(batch.context_lens)
    out, lse = (t.to(DEVICE) for t in batch.sentinels(128, dtype=torch.bfloat16))
    op(*batch.args(), out, lse, 4)
    assert out.isnan().all() and lse.isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashmla_adapter_against_reference(dtype):
    from mla_ops.ops import flashmla

    ok, reason = flashmla.available()
    if not ok:
        pytest.skip(reason)
    batch = absorbed_batch(dtype, nan_free=True)
    check_absorbed(batch, flashmla.absorbed_context_attention, dtype)  # s_q = T: every request padded
    metadata = flashmla.new_metadata()
    bounded = functools.partial(flashmla.absorbed_context_attention, max_query_len=130, metadata=metadata)
    check_absorbed(batch, bounded, dtype)
    check_absorbed(batch, bounded, dtype)  # the filled metadata reused for the same schedule
    assert metadata.tile_scheduler_metadata is not None


@pytest.mark.parametrize("max_chunks", [None, 6])
def test_mla_prefill_triton_against_dense_reference(max_chunks):
    from mla_batches import dense_reference, make_batch

    batch = make_batch([0, 700, 0, 90, 1500, 3], [20, 33, 5, 130, 1, 64], seed=5, block_size=64, N=16, L=512,
                       P=128, R=64, V=128, dtype=torch.bfloat16)
    args = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in batch.args()]
    out = mla_ops.mla_prefill(*args, workspace_size=512, backend="triton", max_chunks=max_chunks)
    ref = dense_reference(*batch.args())
    err = (out.cpu().double() - ref).abs().max().item()
    assert err <= 3e-2 * max(1.0, ref.abs().max().item()), f"max abs diff {err:.3e}"


# ---- a whole prefill step captured in one CUDA graph ----------------------------------------


class StaticStep:
    """Fixed-shape input buffers of one capacity bucket; batches are copied in, padded."""

    def __init__(self, config, max_tokens, max_requests, max_blocks):
        z = lambda *s, dtype=torch.int32: torch.zeros(*s, dtype=dtype, device=DEVICE)  # noqa: E731
        self.input_ids, self.positions = z(max_tokens, dtype=torch.long), z(max_tokens, dtype=torch.long)
        self.slot_mapping = z(max_tokens, dtype=torch.long)
        self.block_table, self.query_start_loc = z(max_requests, max_blocks), z(max_requests + 1)
        self.context_lens = z(max_requests)

    def args(self):
        return (self.input_ids, self.positions, None, self.slot_mapping, self.block_table, self.query_start_loc,
                self.context_lens)

    def load(self, ids, positions, slots, table, qsl, lens):
        """Real requests first, then padding requests with no context; the first takes the spare
        tokens (slot -1: the cache write skips them)."""
        tokens, requests = ids.shape[0], lens.shape[0]
        spare = self.input_ids.shape[0] - tokens
        assert requests < self.context_lens.shape[0] and table.shape[1] <= self.block_table.shape[1]
        self.input_ids.zero_()[:tokens].copy_(ids)
        self.positions.zero_()[:tokens].copy_(positions)
        self.slot_mapping.fill_(-1)[:tokens].copy_(slots)
        self.block_table.zero_()[:requests, : table.shape[1]].copy_(table)
        self.context_lens.zero_()[:requests].copy_(lens)
        self.query_start_loc.fill_(tokens + spare)[: requests + 1].copy_(qsl)
        return tokens


@torch.no_grad()
def test_cuda_graph_capture_replays_changing_batches():
    from mla_batches import BUCKET_4, model_step

    mla_ops.enable()
    torch.manual_seed(0)
    config = mla_ops.MLAConfig.from_name("tiny")
    model = mla_ops.MLAModel(config).to(DEVICE).eval()
    caches = model.allocate_kv_caches(64, 4)
    torch.nn.init.normal_(caches)
    base = caches.clone()
    static = StaticStep(config, max_tokens=40, max_requests=8, max_blocks=20)
    def planned_step(ids, pos, caches, slots, table, qsl, lens):  # the planner runs inside the graph
        plan = mla_ops.plan_prefill(qsl, lens, table, 4, 32, max_chunks=4, absorb_max_query_len=3)
        return model(ids, pos, caches, slots, table, plan)  # both context paths in the captured graph

    compiled = torch.compile(planned_step, fullgraph=True, dynamic=False)

    def step():
        ids, pos, _, slots, table, qsl, lens = static.args()
        return compiled(ids, pos, caches, slots, table, qsl, lens)

    static.load(*[t.to(DEVICE) for t in model_step(config, *BUCKET_4[0], seed=0)])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    batches = [BUCKET_4[i] for i in (0, 1, 2, 4, 5, 6, 9)]  # request counts 2..7, zero contexts, empty
    for i, (context_lens, query_lens) in enumerate(batches):
        inputs = [t.to(DEVICE) for t in model_step(config, context_lens, query_lens, seed=i)]
        caches.copy_(base)
        tokens = static.load(*inputs)
        graph.replay()
        expect_caches = base.clone()
        ids, pos, slots, table, qsl, lens = inputs
        plan = mla_ops.plan_prefill(qsl, lens, table, 4, 32, absorb_max_query_len=0)  # eager, host plan
        expect = model(ids, pos, expect_caches, slots, table, plan)
        torch.testing.assert_close(static_out[:tokens], expect, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(caches, expect_caches, rtol=2e-3, atol=2e-3)


@torch.no_grad()
def test_reduce_overhead_runs_without_cudagraph_skips():
    from mla_batches import BUCKET_4, model_step

    mla_ops.enable()
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = mla_ops.MLAConfig.from_name("tiny")
    model = mla_ops.MLAModel(config).to(DEVICE).eval()
    caches = model.allocate_kv_caches(64, 4)
    torch._dynamo.mark_static_address(caches)  # a fixed buffer: cudagraphs may mutate it in place
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        def planned_step(ids, pos, caches, slots, table, qsl, lens):
            plan = mla_ops.plan_prefill(qsl, lens, table, 4, 32, max_chunks=4)
            return model(ids, pos, caches, slots, table, plan)

        compiled = torch.compile(planned_step, mode="reduce-overhead", fullgraph=True)
        for i, batch in enumerate(BUCKET_4[:4]):
            ids, pos, slots, table, qsl, lens = [t.to(DEVICE) for t in model_step(config, *batch, seed=i)]
            for _ in range(3):  # warm-up, record, replay
                expect_caches = caches.clone()
                out = compiled(ids, pos, caches, slots, table, qsl, lens).clone()
            expect = model(ids, pos, expect_caches, slots, table, mla_ops.plan_prefill(qsl, lens, table, 4, 32))
            torch.testing.assert_close(out, expect, rtol=2e-3, atol=2e-3)
    assert math.isfinite(out.float().sum().item())


# ---- PrefillGraphs: whole steps captured per bucket -----------------------------------------


def graphs_setup(spread=False, **kwargs):
    from test_layer import spread_weights

    torch.manual_seed(0)
    config = mla_ops.MLAConfig.from_name("tiny")
    model = mla_ops.MLAModel(config).eval()
    if spread:  # attention far from uniform: outputs follow the context rows closely
        spread_weights(model, seed=0)
    model = model.to(DEVICE)
    caches = model.allocate_kv_caches(64, 4)
    torch.nn.init.normal_(caches)
    options = dict(max_tokens=40, max_requests=8, max_blocks_per_request=20, block_size=4, workspace_size=32,
                   chunk_buckets=(1, 2, 4), token_buckets=(8, 16, 40), absorb_max_query_len=3, mode="cuda_graph")
    return config, model, caches, mla_ops.PrefillGraphs(model, **{**options, **kwargs})


def graphs_step(config, context_lens, query_lens, seed):
    """A step as a scheduler hands it over: token inputs on the GPU, lengths on the CPU."""
    from mla_batches import model_step

    ids, positions, slots, table, qsl, lens = model_step(config, context_lens, query_lens, seed=seed)
    return ids.to(DEVICE), positions.to(DEVICE), slots.to(DEVICE), table.to(DEVICE), qsl, lens


def eager_model_step(model, caches, ids, positions, slots, table, qsl, lens):
    plan = mla_ops.plan_prefill(qsl, lens, table, 4, 32, absorb_max_query_len=3)  # host plan
    return model(ids, positions, caches, slots, table, plan)


@torch.no_grad()
def test_cuda_graph_runner_replays_equal_the_eager_model():
    from mla_batches import BUCKET_4

    config, model, caches, runner = graphs_setup()
    # B = T = 1 with and without context; 130 context rows need 5 > 4 chunks of 32: runs eagerly.
    steps = BUCKET_4 + [([0], [1]), ([9], [1]), ([60, 70], [4, 4])]
    for i, (context_lens, query_lens) in enumerate(steps):
        ids, positions, slots, table, qsl, lens = graphs_step(config, context_lens, query_lens, seed=i)
        expect_caches = caches.clone()
        expect = eager_model_step(model, expect_caches, ids, positions, slots, table, qsl, lens)
        out = runner(ids, positions, caches, slots, table, qsl, lens)
        torch.testing.assert_close(out, expect, rtol=2e-3, atol=2e-3, msg=lambda m: f"step {i}: {m}")
        torch.testing.assert_close(caches, expect_caches, rtol=2e-3, atol=2e-3)
    stats = runner.stats
    assert stats["eager"] == 1 and stats["replays"] == len(steps) - 1
    assert stats["graphs"] == len(runner.built) == len(set(runner.built)) < len(steps)
    assert set(stats["graph_bytes"]) == {str(v) for v in runner.built}
    assert stats["graph_bytes"][str(runner.built[0])] > 0
    print("graph memory per bucket:", stats["graph_bytes"], "static:", stats["static_bytes"])


@torch.no_grad()
def test_cuda_graph_runner_replays_read_the_cache_as_it_is_now():
    config, model, caches, runner = graphs_setup(spread=True)
    step = graphs_step(config, [20, 9, 0, 13], [3, 5, 4, 2], seed=3)
    first = runner(step[0], step[1], caches, *step[2:]).clone()
    caches.normal_()  # new contents in the memory the graph reads
    expect = eager_model_step(model, caches.clone(), *step)
    again = runner(step[0], step[1], caches, *step[2:])
    assert runner.stats["graphs"] == 1 and runner.stats["replays"] == 2
    torch.testing.assert_close(again, expect, rtol=1e-2, atol=1e-2)
    change, error = (expect - first).abs().max(), (again - expect).abs().max()
    assert change > 10 * error, (change, error)  # the replay read the new context rows
    with pytest.raises(ValueError, match="kv_caches"):
        runner(step[0], step[1], caches.clone(), *step[2:])  # graphs are bound to the captured cache


@torch.no_grad()
def test_cuda_graph_runner_warmup_captures_every_bucket_in_one_pool():
    config, model, caches, runner = graphs_setup(token_buckets=(8, 40), request_buckets=(2, 8), chunk_buckets=(1, 4))
    before = caches.clone()
    runner.warmup(caches)
    assert runner.built == runner.variants and runner.stats["graphs"] == 8
    assert torch.equal(caches, before)  # the capture steps write nothing
    sizes = [runner.stats["graph_bytes"][str(v)] for v in runner.built]
    print("graph memory per bucket, largest bucket first:", dict(zip(map(str, runner.built), sizes)))
    assert sizes[0] > 0 and min(sizes) >= 0
    ids, positions, slots, table, qsl, lens = graphs_step(config, [5, 0, 13], [3, 2, 4], seed=0)
    expect = eager_model_step(model, caches.clone(), ids, positions, slots, table, qsl, lens)
    torch.testing.assert_close(runner(ids, positions, caches, slots, table, qsl, lens), expect, rtol=2e-3, atol=2e-3)
    assert runner.stats["graphs"] == 8 and runner.stats["replays"] == 1


@pytest.mark.parametrize("num_programs", [3, None])  # forced tiny grids (long stride loops), then the SM count
def test_persistent_kernels_over_every_chunk_of_a_device_schedule(num_programs, monkeypatch):
    """Gather, up-projection and context attention on each chunk, the empty ones past the count included."""
    from mla_ops.planning.device_schedule import device_plan_tensors
    from mla_ops.triton import _common

    monkeypatch.setattr(_common, "PROGRAMS_OVERRIDE", num_programs)
    g = torch.Generator(device=DEVICE).manual_seed(4)
    context_lens = torch.tensor([0, 700, 3000, 0, 90, 0], dtype=torch.int32)
    capacity, max_chunks, heads = 1024, 6, 8
    starts_k, _, cu_k, num_chunks = (t.to(DEVICE) for t in device_plan_tensors(context_lens, capacity, max_chunks))
    assert int(num_chunks) < max_chunks
    cache = torch.randn(400, 16, 576, generator=g, device=DEVICE).to(torch.bfloat16)
    table = torch.randperm(400, generator=g, device=DEVICE)[:6 * 60].view(6, 60).to(torch.int32)
    weight = torch.randn(heads * 256, 512, generator=g, device=DEVICE).to(torch.bfloat16) / 20
    q_lens = torch.tensor([3, 100, 1, 70, 5, 2])
    cu_q = torch.tensor([0, *q_lens.cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(q_lens.sum()), heads, 192, generator=g, device=DEVICE).to(torch.bfloat16)
    base_out = torch.randn(q.shape[0], heads, 128, generator=g, device=DEVICE).to(torch.bfloat16)
    base_lse = torch.randn(heads, q.shape[0], generator=g, device=DEVICE)
    for k in range(max_chunks):
        cu, starts, rows = cu_k[k], starts_k[k], int(cu_k[k, -1])
        results = []
        for ops in (torch.ops.mla_ops, REFERENCE):
            workspace = torch.full((capacity, 576), float("nan"), device=DEVICE, dtype=torch.bfloat16)
            kv = torch.full((capacity, heads, 256), float("nan"), device=DEVICE, dtype=torch.bfloat16)
            out, lse = base_out.clone(), base_lse.clone()
            ops.gather_context(cache, table, cu, starts, None, workspace)
            ops.up_project(workspace[:, :512], weight, cu, kv.view(capacity, -1))
            # Stale rows past the count are NaN: attention must read only the live ones.
            ops.context_attention(q, kv[..., :128], workspace[:, 512:], kv[..., 128:], cu_q, cu, starts, 0.07, out, lse)
            results.append((workspace, kv, out.float(), lse))
        (ws, kv, out, lse), (want_ws, want_kv, want_out, want_lse) = results
        assert torch.equal(ws[:rows], want_ws[:rows]) and ws[rows:].isnan().all(), f"chunk {k}"
        assert kv[rows:].isnan().all(), f"chunk {k}"
        torch.testing.assert_close(kv[:rows].float(), want_kv[:rows].float(), atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(out, want_out, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)
