"""The FlashMLA adapter (mla_ops/ops/flashmla.py): on CPU against a torch stand-in of ``flash_mla``
that follows its documented dense-decoding contract (tests/support/flashmla.py), and on a GPU with
the real wheel against the absorbed op's torch reference.

q [T, N, P+R]   kv_cache [num_blocks, 64, L+R] (L=512, R=64: the kernel's only shape)
-> out [T, N, V], lse [N, T]; rows of requests without context (or past the query bound) stay NaN.
"""

import functools
import math

import pytest
import torch

import mla_ops
from mla_ops.ops import absorbed, flashmla
from tests.support.batches import assert_partial, context_batch, written_rows
from tests.support.flashmla import StandInFlashMLA
from tests.support.gpu import absorbed_batch, check_absorbed, needs_cuda


@pytest.fixture
def stand_in(monkeypatch):
    module = StandInFlashMLA()
    monkeypatch.setattr(flashmla, "_import_flash_mla", lambda: (module, ""))
    return module


FLASHMLA_DIMS = dict(N=2, L=512, R=64, P=16, V=16)
ADAPTER_TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


def reference_partial(batch):
    """The op's reference in float32 on the same (16-bit) inputs."""
    b32 = batch.to("cpu", torch.float32)
    out, lse = b32.sentinels(FLASHMLA_DIMS["V"])
    absorbed.absorbed_reference(*b32.absorbed_args(), out, lse)
    return out.double(), lse.double()


def test_lse_to_tokens_first():
    b, n, s_q = 2, 3, 4
    lse = torch.arange(b * n * s_q, dtype=torch.float32).view(b, n, s_q)  # lse[r, h, j] = 12 r + 4 h + j
    lse[1, :, 1] = math.inf  # a row without keys
    lse[0, 2, 0] = -math.inf
    slots = torch.tensor([0, 1, 5, 4, 0])  # slot = r * s_q + j
    got = flashmla._lse_to_tokens_first(lse, slots)
    expect = torch.stack([lse[s // s_q, :, s % s_q] for s in slots.tolist()], dim=1)  # [N, T]
    expect = torch.where(expect == math.inf, -math.inf, expect)
    assert got.shape == (n, slots.numel()) and torch.equal(got, expect)
    assert (got[:, 2] == -math.inf).all() and got[2, 0] == -math.inf and not torch.isinf(got[:, 3]).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flashmla_adapter_pads_groups_and_unpacks(stand_in, dtype):
    context_lens, query_lens = [70, 0, 5, 130, 0, 64], [3, 2, 1, 4, 0, 2]
    batch = context_batch(context_lens, query_lens, block_size=64, dtype=dtype, seed=7, **FLASHMLA_DIMS)
    out, lse = batch.sentinels(FLASHMLA_DIMS["V"])
    flashmla.absorbed_context_attention(*batch.absorbed_args(), out, lse, max_query_len=4)
    call = stand_in.calls[-1]
    assert (call["b"], call["s_q"], call["h_q"]) == (len(context_lens), 4, FLASHMLA_DIMS["N"])
    assert_partial(out, lse, *reference_partial(batch), written_rows(batch), ADAPTER_TOL[dtype])


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_flashmla_adapter_makes_a_non_finite_score_nan(stand_in, value):
    """A non-finite q (FlashMLA's LSE then +inf, -inf or NaN on a row with keys): NaN out and lse for that
    (token, head), never the empty partial that +inf means on a row without keys."""
    batch = context_batch([9, 0, 70], [2, 1, 3], block_size=64, dtype=torch.float16, seed=3, **FLASHMLA_DIMS)
    batch.q[4, 1, 3] = value
    batch.q[0, 0, -1] = value  # the rope part
    out, lse = batch.sentinels(FLASHMLA_DIMS["V"])
    flashmla.absorbed_context_attention(*batch.absorbed_args(), out, lse)
    poisoned = torch.zeros(6, 2, dtype=torch.bool)
    poisoned[4, 1] = poisoned[0, 0] = True
    assert out[poisoned].isnan().all() and lse.t()[poisoned].isnan().all()
    written = written_rows(batch)
    assert not out[written][~poisoned[written]].isnan().any() and not lse.t()[written][~poisoned[written]].isnan().any()


def test_flashmla_adapter_default_query_bound_is_num_tokens(stand_in):
    batch = context_batch([9, 3], [1, 5], block_size=64, dtype=torch.float16, **FLASHMLA_DIMS)
    out, lse = batch.sentinels(FLASHMLA_DIMS["V"])
    flashmla.absorbed_context_attention(*batch.absorbed_args(), out, lse)
    assert stand_in.calls[-1]["s_q"] == 6
    assert_partial(out, lse, *reference_partial(batch), written_rows(batch), ADAPTER_TOL[torch.float16])


def test_flashmla_adapter_leaves_requests_longer_than_the_bound(stand_in):
    batch = context_batch([9, 3, 4], [2, 5, 1], block_size=64, dtype=torch.float16, **FLASHMLA_DIMS)
    out, lse = batch.sentinels(FLASHMLA_DIMS["V"])
    flashmla.absorbed_context_attention(*batch.absorbed_args(), out, lse, max_query_len=2)
    written = torch.tensor([True, True] + [False] * 5 + [True])  # request 1 (5 queries) is not served
    assert_partial(out, lse, *reference_partial(batch), written, ADAPTER_TOL[torch.float16])


def test_flashmla_metadata_per_call_or_from_the_caller(stand_in):
    batch = context_batch([9, 0, 4], [2, 1, 1], block_size=64, dtype=torch.float16, **FLASHMLA_DIMS)

    def run(**kwargs):
        out, lse = batch.sentinels(FLASHMLA_DIMS["V"])
        flashmla.absorbed_context_attention(*batch.absorbed_args(), out, lse, max_query_len=2, **kwargs)
        return out, lse

    shared = flashmla.new_metadata()  # made where the step's schedule is made
    results = [run(), run(), run(metadata=shared), run(metadata=shared)]  # two "layers" share it
    metas = [call["metadata"] for call in stand_in.calls]
    assert metas[0] is not metas[1], "a fresh metadata object per call by default"
    assert metas[2] is shared and metas[3] is shared, "the caller's metadata is used as given"
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(lse, results[0][1], equal_nan=True, rtol=0, atol=0)


def test_a_step_makes_the_metadata_once(stand_in, monkeypatch):
    """backend="flashmla": the step (``begin_step``) holds its scheduler metadata, filled by its first
    layer and passed to FlashMLA by the others; s_q is the plan's bound, the longest routed query."""
    monkeypatch.setattr(flashmla, "available", lambda *args: (True, ""))
    batch = context_batch([9, 0, 4, 70], [2, 1, 1, 3], block_size=64, dtype=torch.float16, **FLASHMLA_DIMS)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, 64,
                                absorb_max_query_len=8)

    def layer(step):
        return step.run(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight, batch.softmax_scale)

    step = mla_ops.begin_step(plan, batch.kv_cache, backend="flashmla")
    outputs = [layer(step), layer(step), layer(mla_ops.begin_step(plan, batch.kv_cache, backend="flashmla"))]
    metas = [call["metadata"] for call in stand_in.calls]  # two layers of one step, then a new step
    assert metas[0] is metas[1] and metas[2] is not metas[0]
    assert [call["s_q"] for call in stand_in.calls] == [3, 3, 3]  # not the threshold, 8
    with pytest.raises(ValueError, match="one head count"):  # the metadata is valid for one N only
        step.run(batch.q[:, :1], batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight[:32],
                 batch.softmax_scale)
    expect = mla_ops.run_prefill(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight,
                                 batch.softmax_scale, plan, backend="torch")
    for out in outputs:
        torch.testing.assert_close(out.float(), expect.float(), rtol=0, atol=ADAPTER_TOL[torch.float16])


def test_flashmla_adapter_refuses_what_it_cannot_run(stand_in):
    fp8 = context_batch([3], [1], block_size=64, dtype=torch.float16, fp8_scale=0.5, **FLASHMLA_DIMS)
    with pytest.raises(TypeError, match="fp8"):
        flashmla.absorbed_context_attention(*fp8.absorbed_args(), *fp8.sentinels(16, dtype=torch.float16))
    paged16 = context_batch([3], [1], block_size=16, dtype=torch.float16, **FLASHMLA_DIMS)
    with pytest.raises(ValueError, match="64"):
        flashmla.absorbed_context_attention(*paged16.absorbed_args(), *paged16.sentinels(16))
    fp32 = context_batch([3], [1], block_size=64, dtype=torch.float32, **FLASHMLA_DIMS)
    with pytest.raises(TypeError, match="float16"):
        flashmla.absorbed_context_attention(*fp32.absorbed_args(), *fp32.sentinels(16))
    ok, reason = flashmla.available(fp32.q, fp32.kv_cache)
    assert not ok and "CUDA" in reason  # this CPU machine; the stand-in imports fine


def test_flashmla_available_reports_a_reason():
    ok, reason = flashmla.available()
    assert isinstance(ok, bool) and isinstance(reason, str)
    if not ok:
        assert reason


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashmla_adapter_against_reference(dtype):
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


@pytest.mark.cuda
@needs_cuda
def test_a_flashmla_step_shares_its_metadata():
    ok, reason = flashmla.available()
    if not ok:
        pytest.skip(reason)
    batch = context_batch([300, 0, 70, 129], [2, 1, 1, 40], block_size=64, dtype=torch.float32, nan_fill=False,
                          **FLASHMLA_DIMS).to("cuda", torch.bfloat16)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, 64,
                                absorb_max_query_len=64)

    step = mla_ops.begin_step(plan, batch.kv_cache, backend="flashmla")

    def layer(backend):
        run = step.run if backend == "flashmla" else functools.partial(mla_ops.run_prefill, plan=plan, backend=backend)
        return run(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight,
                   softmax_scale=batch.softmax_scale)

    first, second, expect = layer("flashmla"), layer("flashmla"), layer("torch")
    metadata = step.kernels.absorbed_context_attention.metadata  # made by begin_step
    assert metadata.tile_scheduler_metadata is not None  # filled by the first layer's kernel call
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    torch.testing.assert_close(first.float(), expect.float(), rtol=0, atol=ADAPTER_TOL[torch.bfloat16])
