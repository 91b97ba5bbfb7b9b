"""DESIGN §11's attention variants end to end: sinks (``sinks=`` [N] float32 on ``run_prefill``, ``mla_prefill``
and ``PrefillStep.attend`` / ``run``) and sliding windows (``PlanOptions.sliding_window``, a ``plan_prefill`` and
``mla_prefill`` keyword), on every path: chunked and absorbed, host and device plans, dense and sparse (DSA).

The oracles are float64 and written from the design (tests/support/batches.py ``dense_reference``,
tests/support/sparse.py ``masked_reference``): the window masks each query's keys before position
``c_r + j - w + 1``, and the sink is one more score per head in every softmax, a key whose value is 0.
"""

import math

import pytest
import torch

import mla_ops
import mla_ops.ops.gather as gather_module
from mla_ops.serving.buckets import Buckets
from tests.prefill.test_compile import HOST_SYNC_OPS, RecordOps
from tests.support.batches import TOL, assert_close_to_reference, dense_reference, make_batch, random_lens
from tests.support.sparse import masked_reference, random_topk

CTX, QLENS = [0, 23, 5, 0, 40, 16, 1, 9], [2, 3, 1, 4, 20, 2, 5, 1]
BLOCK = 4
# Plan forms: the chunk loop (host, device), the absorbed path for some or all requests (host, device).
FORMS = {
    "host": dict(workspace_size=5, absorb_max_query_len=0),
    "host, absorbed": dict(workspace_size=5, absorb_max_query_len=3),
    "host, all absorbed": dict(absorb_max_query_len=100),
    "device": dict(workspace_size=7, absorb_max_query_len=0, max_chunks=14),
    "device, absorbed": dict(workspace_size=7, absorb_max_query_len=3, max_chunks=14, max_absorbed_tokens=8),
}
WINDOWS = [1, 2, 6, 17, 1000]  # 1: each query sees itself only; 1000: wider than every sequence


def sinks_for(num_heads, seed=0):
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2


def run(batch, *, backend="torch", sinks=None, return_lse=True, **plan_kwargs):
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table,
                                block_size=batch.kv_cache.shape[1], **plan_kwargs)
    return mla_ops.run_prefill(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight,
                               batch.softmax_scale, plan, k_scale=batch.k_scale, backend=backend,
                               return_lse=return_lse, sinks=sinks)


def oracle(batch, window=None, sinks=None):
    return dense_reference(*batch.args(), k_scale=batch.k_scale, return_lse=True, sliding_window=window, sinks=sinks)


# ---- the oracle's own checks ------------------------------------------------------------------


def test_oracle_without_variants_is_the_dense_reference():
    batch = make_batch(CTX, QLENS, seed=1, block_size=BLOCK)
    out, lse = dense_reference(*batch.args(), return_lse=True)
    wide, wide_lse = oracle(batch, window=10**6, sinks=torch.full((2,), -math.inf))
    assert torch.equal(out, wide) and torch.equal(lse, wide_lse)


def test_oracle_window_one_is_each_tokens_own_value_and_sink_is_sigmoid():
    batch = make_batch([7, 0], [3, 2], seed=2, block_size=BLOCK)
    out, lse = oracle(batch, window=1)
    n, p = 2, 8  # heads, P
    kv = (batch.kv_c.double() @ batch.kv_b_proj_weight.double().T).view(-1, n, 2 * p)
    torch.testing.assert_close(out, kv[..., p:], rtol=0, atol=1e-12)  # one key: its own value
    sinks = torch.tensor([0.3, -1.2])
    with_sink, with_sink_lse = oracle(batch, window=1, sinks=sinks)
    torch.testing.assert_close(with_sink, out * torch.sigmoid(lse - sinks.double()[:, None]).t()[..., None])
    torch.testing.assert_close(with_sink_lse, torch.logaddexp(lse, sinks.double()[:, None]))


# ---- exact (float64) on every plan form and backend -------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("form", list(FORMS))
def test_window_and_sinks_equal_the_oracle(form, window, backend):
    batch = make_batch(CTX, QLENS, seed=3, block_size=BLOCK, noncontig="slice", nan_fill=True)
    sinks = sinks_for(2)
    out, lse = run(batch, backend=backend, sinks=sinks, sliding_window=window, **FORMS[form])
    want, want_lse = oracle(batch, window, sinks)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-10)
    alone = run(batch, backend=backend, sliding_window=window, return_lse=False, **FORMS[form])  # no sinks
    torch.testing.assert_close(alone, oracle(batch, window)[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("form", list(FORMS))
def test_sinks_alone_on_every_path(form):
    batch = make_batch(CTX, QLENS, seed=4, block_size=BLOCK)
    sinks = sinks_for(2, seed=1)
    out, lse = run(batch, backend="auto", sinks=sinks, **FORMS[form])
    want, want_lse = oracle(batch, sinks=sinks)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-10)  # the LSE includes the sink


@pytest.mark.parametrize("policy,split_alignment", [("packed", 1), ("packed", 4), ("whole_requests", 1),
                                                    ("whole_requests", 4)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_window_with_every_host_policy(policy, split_alignment, block_size):
    g = torch.Generator().manual_seed(5)
    ctx, ql = random_lens(g, 9, 70, 9, zero_at=(0, 4))
    batch = make_batch(ctx, ql, seed=5, block_size=block_size, noncontig="step")
    for window in (3, 12, 30):
        out = batch.run(workspace_size=8, policy=policy, split_alignment=split_alignment, sliding_window=window,
                        backend="auto")
        torch.testing.assert_close(out, oracle(batch, window)[0], rtol=0, atol=1e-10)


LSE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_low_precision(dtype):
    batch = make_batch(CTX, QLENS, seed=6, block_size=BLOCK, dtype=dtype)
    sinks = sinks_for(2, seed=2)
    for form in ("host, absorbed", "device"):
        out, lse = run(batch, backend="auto", sinks=sinks, sliding_window=6, **FORMS[form])
        want, want_lse = oracle(batch, 6, sinks)
        assert_close_to_reference(out, want, dtype, form)
        assert lse.dtype == torch.float32 and (lse.double() - want_lse).abs().max() < LSE_TOL[dtype]


def test_fp8_cache():
    batch = make_batch(CTX, QLENS, seed=7, block_size=BLOCK, dtype=torch.float32, fp8_scale=0.5)
    for form in ("host", "device, absorbed"):
        out, _ = run(batch, backend="auto", sinks=sinks_for(2), sliding_window=9, **FORMS[form])
        assert_close_to_reference(out, oracle(batch, 9, sinks_for(2))[0], torch.float32, form)


# ---- the window's rows: work grows with the window, not the context ---------------------------


class GatheredRows:
    """Counts the context rows ``gather_context`` copies into the workspace."""

    def __init__(self, monkeypatch):
        self.rows = 0
        real = gather_module.gather_reference

        def counting(kv_cache, block_table, cu_seq_lens, starts, k_scale, workspace):
            self.rows += int(cu_seq_lens[-1])
            return real(kv_cache, block_table, cu_seq_lens, starts, k_scale, workspace)

        monkeypatch.setattr(gather_module, "gather_reference", counting)


@pytest.mark.parametrize("max_chunks", [None, 4])
def test_rows_gathered_grow_with_the_window_not_the_context(monkeypatch, max_chunks):
    gathered = GatheredRows(monkeypatch)
    window = 64
    counts = {}
    for context in (200, 2000):
        batch = make_batch([context, 0, 30], [4, 3, 2], seed=8, block_size=16)
        options = dict(workspace_size=48, absorb_max_query_len=0, max_chunks=max_chunks, sliding_window=window)
        before = gathered.rows
        out, _ = run(batch, backend="auto", **options)
        counts[context] = gathered.rows - before
        torch.testing.assert_close(out, oracle(batch, window)[0], rtol=0, atol=1e-10)
        plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=16,
                                    **options)
        planned = (plan.schedule.num_context_tokens if max_chunks is None
                   else int(plan.device_schedule.seq_lens.sum()))
        assert planned == (window - 1) + 30  # each request's last w - 1 rows (or its whole shorter context)
    assert counts[200] == counts[2000] == (window - 1) + 30
    unwindowed = gathered.rows
    run(make_batch([2000, 0, 30], [4, 3, 2], seed=8, block_size=16), backend="auto", workspace_size=48,
        absorb_max_query_len=0, max_chunks=None if max_chunks is None else 44)
    assert gathered.rows - unwindowed == 2030


def test_window_plan_fields():
    batch = make_batch([40, 3, 0, 100], [2, 1, 4, 30], seed=9, block_size=BLOCK)
    host = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK,
                                workspace_size=8, absorb_max_query_len=2, sliding_window=10)
    assert host.sliding_window == 10 and "sliding_window=10" in repr(host)
    # Absorbed requests keep their whole context length (the kernel reads its window); chunked ones start at
    # their window's first position.
    assert host.absorbed_context_lens.tolist() == [40, 3, 0, 0]
    starts = [int(s) for c in host.schedule.chunks for s, n in zip(c.starts, c.seq_lens) if n > 0]
    assert starts[0] == 91 and host.schedule.num_context_tokens == 9
    device = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK,
                                  workspace_size=8, absorb_max_query_len=2, sliding_window=10, max_chunks=3,
                                  max_absorbed_tokens=8)
    assert device.absorbed_context_lens.tolist() == [40, 3, 0, 0]
    assert device.device_schedule.starts[:, 3].tolist()[:2] == [91, 99] and device.device_schedule.seq_lens.sum() == 9
    assert not device.truncated.any()  # 100 context rows through 3 chunks of 8: fine, the window needs 9


def test_buckets_count_the_windows_rows():
    options = mla_ops.PlanOptions(workspace_size=16, absorb_max_query_len=0, max_chunks=8, sliding_window=9)
    buckets = Buckets(tokens=(16,), requests=(4,), chunks=(1, 2, 8))
    qsl, ctx = torch.tensor([0, 3, 5]).numpy(), torch.tensor([500, 700]).numpy()
    assert buckets.choose(qsl, ctx, options).chunks == 1  # 2 x 8 rows, not 1200


# ---- DSA: a sparse request's selection is masked by the window too ------------------------------

SPARSE_CTX, SPARSE_Q, TOPK = [0, 13, 5, 0, 9, 30, 2], [3, 4, 2, 9, 1, 5, 2], 8


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("max_chunks", [None, 24])
@pytest.mark.parametrize("window", [3, 10])
@pytest.mark.parametrize("masked_mha_ratio", [0.0, float("inf")], ids=["sparse", "masked MHA"])
def test_sparse_requests_in_a_window(window, max_chunks, backend, masked_mha_ratio):
    batch = make_batch(SPARSE_CTX, SPARSE_Q, seed=10, block_size=BLOCK, nan_fill=True)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK, 8,
                                absorb_max_query_len=2, max_chunks=max_chunks, index_topk=TOPK, index_scores_budget=32,
                                sliding_window=window, masked_mha_ratio=masked_mha_ratio)
    topk = random_topk(SPARSE_CTX, SPARSE_Q, TOPK, seed=11, sparse=plan.sparse.tolist(), empty=0.0)
    sinks = sinks_for(2, seed=3)
    out, lse = mla_ops.run_prefill(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight,
                                   batch.softmax_scale, plan, backend=backend, topk_indices=topk, return_lse=True,
                                   sinks=sinks)
    sparse_out, sparse_lse, rows = masked_reference(batch, topk, plan.sparse, sliding_window=window, sinks=sinks)
    dense_out, dense_lse = oracle(batch, window, sinks)
    assert rows.any() and not rows.all()
    torch.testing.assert_close(out, torch.where(rows[:, None, None], sparse_out, dense_out), rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, torch.where(rows, sparse_lse, dense_lse), rtol=0, atol=1e-10)


# ---- the step API -----------------------------------------------------------------------------


def test_step_attend_and_run_take_sinks():
    batch = make_batch([6, 11], [3, 2], seed=12, block_size=BLOCK)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK,
                                workspace_size=4, absorb_max_query_len=0, sliding_window=5)
    slots = torch.tensor([int(batch.block_table[r, p // BLOCK]) * BLOCK + p % BLOCK
                          for r, (c, q) in enumerate(zip([6, 11], [3, 2])) for p in range(c, c + q)])
    # keep the new tokens' slots apart from context rows: a cache with spare blocks is written by run
    cache = batch.kv_cache.clone()
    step = mla_ops.begin_step(plan, cache, slots)
    sinks = sinks_for(2, seed=4)
    want, want_lse = oracle(batch, 5, sinks)
    out, lse = step.attend(batch.q, batch.kv_c, batch.k_pe, cache, batch.kv_b_proj_weight, batch.softmax_scale,
                           return_lse=True, sinks=sinks)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-10)
    given = torch.empty_like(out)
    ran = step.run(batch.q, batch.kv_c, batch.k_pe, cache, batch.kv_b_proj_weight, batch.softmax_scale, out=given,
                   sinks=sinks)
    assert ran is given
    torch.testing.assert_close(ran, want, rtol=0, atol=1e-10)
    assert torch.equal(cache.flatten(0, 1)[slots, :16], batch.kv_c)  # the rows were written
    torch.testing.assert_close(
        batch.run(sliding_window=5, sinks=sinks, workspace_size=4), want, rtol=0, atol=1e-10)  # mla_prefill


# ---- errors, before anything runs or is written -----------------------------------------------


def test_bad_sinks_and_windows_are_named():
    batch = make_batch([6, 3], [2, 2], seed=13, block_size=BLOCK)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK)
    slots = torch.tensor([20, 21, 22, 23])
    cache = batch.kv_cache.clone()
    step = mla_ops.begin_step(plan, cache, slots)
    args = (batch.q, batch.kv_c, batch.k_pe, cache, batch.kv_b_proj_weight, batch.softmax_scale)
    for bad, error, words in ((torch.zeros(3), ValueError, "sinks must be \\[N\\] = \\[2\\]"),
                              (torch.zeros(2, dtype=torch.float64), TypeError, "sinks must be float32"),
                              (torch.zeros(1, 2), ValueError, "sinks must be 1-D"),
                              ([0.0, 1.0], TypeError, "sinks must be a torch.Tensor"),
                              (torch.zeros(2, device="meta"), ValueError, "sinks must be on cpu")):
        with pytest.raises(error, match=words):
            step.run(*args, sinks=bad)
    assert torch.equal(cache, batch.kv_cache)  # nothing written
    for window, error in ((0, ValueError), (-3, ValueError), (2**31, ValueError), (2.0, TypeError),
                          (True, TypeError)):
        with pytest.raises(error, match="sliding_window"):
            mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK,
                                 sliding_window=window)
        with pytest.raises(error, match="sliding_window"):
            mla_ops.PlanOptions(sliding_window=window)
    windowed = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK,
                                    sliding_window=4)
    with pytest.raises(ValueError, match="'flashmla' has no sliding window"):
        mla_ops.run_prefill(*args[:5], batch.softmax_scale, windowed, backend="flashmla")
    with pytest.raises(ValueError, match="sliding_window"):  # with plan=, a planning option is the plan's
        batch.run(plan=windowed, sliding_window=4)


def test_context_parallel_refuses_a_window():
    from mla_ops.parallel.config import ContextParallel

    batch = make_batch([6, 3], [2, 2], seed=14, block_size=BLOCK)
    cp = ContextParallel.__new__(ContextParallel)  # never reached: the window is refused first
    with pytest.raises(ValueError, match="context_parallel does not serve a sliding_window"):
        mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK,
                             sliding_window=4, context_parallel=cp)


# ---- the device path: no host sync, one graph ----------------------------------------------------

def test_device_path_with_window_and_sinks_makes_no_host_sync():
    batch = make_batch(CTX, QLENS, seed=15, block_size=BLOCK, dtype=torch.float32)
    with RecordOps() as recorded:
        run(batch, backend="auto", sinks=sinks_for(2), sliding_window=6, **FORMS["device, absorbed"])
    assert not HOST_SYNC_OPS & set(recorded.names), sorted(set(recorded.names))


def test_compiled_step_with_window_and_sinks():
    torch._dynamo.reset()
    sinks = sinks_for(2, seed=5)

    def step(q, kv_c, k_pe, kv_cache, block_table, query_start_loc, context_lens, weight):
        return mla_ops.mla_prefill(q, kv_c, k_pe, kv_cache, block_table, query_start_loc, context_lens, weight,
                                   0.25, workspace_size=8, max_chunks=6, absorb_max_query_len=3, sliding_window=7,
                                   sinks=sinks)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for i, (ctx, ql) in enumerate([([5, 0, 13, 30], [3, 2, 4, 1]), ([20, 9], [6, 2]), ([0, 41, 2], [2, 5, 3])]):
        batch = make_batch(ctx, ql, seed=16 + i, block_size=BLOCK, dtype=torch.float32, garbage_blocks=30 - sum(
            -(-c // BLOCK) for c in ctx), pad_cols=12 - max(-(-c // BLOCK) for c in ctx))
        args = (batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.block_table, batch.query_start_loc,
                batch.context_lens, batch.kv_b_proj_weight)
        with torch.compiler.set_stance("fail_on_recompile" if i > 1 else "default"):
            out = compiled(*args)
        want = dense_reference(*batch.args()[:8], 0.25, sliding_window=7, sinks=sinks)
        assert_close_to_reference(out, want, torch.float32, f"batch {i}")
    assert TOL[torch.float32]


# ---- two row widths in one step (issue 47 item 3, the ops' part) ------------------------------


def test_one_step_serves_two_row_widths():
    """One plan and one step (its blocks, slots and kernels) serve layers whose caches have different widths
    L + R and heads (dots3_note's two geometries): each layer's call reads its dims from its own tensors, and
    writes its own rows."""
    ctx, ql = [9, 0, 14], [3, 2, 4]
    wide = make_batch(ctx, ql, seed=20, block_size=BLOCK, N=4, L=32, P=8, R=8, V=16)
    narrow = make_batch(ctx, ql, seed=20, block_size=BLOCK, N=2, L=16, P=8, R=4, V=8)
    assert torch.equal(wide.block_table, narrow.block_table)  # same seed: same blocks
    plan = mla_ops.plan_prefill(wide.query_start_loc, wide.context_lens, wide.block_table, BLOCK, workspace_size=8,
                                absorb_max_query_len=2)
    used = {int(wide.block_table[r, i]) for r, c in enumerate(ctx) for i in range(-(-c // BLOCK))}
    spare = [b for b in range(wide.kv_cache.shape[0]) if b not in used]  # the new tokens' slots: spare blocks
    slots = torch.tensor([b * BLOCK + i for b in spare for i in range(BLOCK)][:9])
    caches = {name: b.kv_cache.clone() for name, b in (("wide", wide), ("narrow", narrow))}
    step = mla_ops.begin_step(plan, caches["wide"], slots)
    for name, b in (("wide", wide), ("narrow", narrow)):
        out = step.run(b.q, b.kv_c, b.k_pe, caches[name], b.kv_b_proj_weight, b.softmax_scale, sinks=sinks_for(
            b.q.shape[1]))
        torch.testing.assert_close(out, oracle(b, sinks=sinks_for(b.q.shape[1]))[0], rtol=0, atol=1e-10)
        rows = caches[name].flatten(0, 1)[slots]
        assert torch.equal(rows, torch.cat([b.kv_c, b.k_pe], 1))  # written at the layer's own width
