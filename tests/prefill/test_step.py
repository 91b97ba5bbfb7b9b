"""The step object (``begin_step`` / ``PrefillStep.run``), ``return_lse``, ``options=`` and the plan's repr.

A step is set up once for every layer: the plan's fit with the caches, the slots, the scale and the
kernel choice happen in ``begin_step``, which makes everything the step holds (it is frozen); each layer's
``run`` checks only its own tensors (and its own ``k_scale``), writes its rows and attends. The outputs and
LSEs are checked against the dense float64 reference.
"""

import dataclasses
import math

import pytest
import torch

import mla_ops
from mla_ops.ops import backends
from mla_ops.planning import plan as planning
from tests.support.batches import dense_reference, make_batch

CTX, QLENS = [0, 13, 5, 0, 9], [3, 4, 2, 2, 1]  # request 1's context exceeds the workspace of 8
PLANS = {
    "host": dict(absorb_max_query_len=0),
    "whole_requests": dict(absorb_max_query_len=0, policy="whole_requests"),
    "device": dict(absorb_max_query_len=0, max_chunks=math.ceil(sum(CTX) / 8)),
    "host, absorbed": dict(absorb_max_query_len=2),
    "device, absorbed": dict(absorb_max_query_len=2, max_chunks=4),
}


def batch_and_plan(planning_kwargs, **batch_kwargs):
    batch = make_batch(CTX, QLENS, seed=3, block_size=4, **batch_kwargs)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, 4, 8,
                                **planning_kwargs)
    return batch, plan


@pytest.mark.parametrize("form", list(PLANS))
def test_return_lse_is_the_softmax_log_sum_exp(form):
    batch, plan = batch_and_plan(PLANS[form])
    out, lse = mla_ops.run_prefill(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight,
                                   batch.softmax_scale, plan, backend="torch", return_lse=True)
    expect, expect_lse = dense_reference(*batch.args(), return_lse=True)
    assert lse.shape == (batch.q.shape[1], batch.q.shape[0]) and lse.dtype == torch.float64
    torch.testing.assert_close(out, expect, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, expect_lse, rtol=0, atol=1e-10)
    alone = mla_ops.run_prefill(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight,
                                batch.softmax_scale, plan, backend="torch")
    torch.testing.assert_close(alone, out, rtol=0, atol=0)


def prefix_partial(batch, num_rows):
    """An engine's own partial, in float64: one request's queries over its first ``num_rows`` context
    rows (a shared prefix), non-causal: ``(out [T, N, V], lse [N, T])``."""
    t, n = batch.q.shape[:2]
    r = batch.k_pe.shape[1]
    p = batch.q.shape[2] - r
    pos = torch.arange(num_rows)
    rows = batch.kv_cache[batch.block_table[0].long()[pos // 4], pos % 4].double()  # [S, L+R]
    kv = (rows[:, :-r] @ batch.kv_b_proj_weight.double().T).view(num_rows, n, -1)
    k = torch.cat([kv[..., :p], rows[:, None, -r:].expand(-1, n, r)], -1)
    scores = torch.einsum("qnd,knd->nqk", batch.q.double(), k) * batch.softmax_scale
    return torch.einsum("nqk,knd->qnd", scores.softmax(-1), kv[..., p:]), scores.logsumexp(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_return_lse_merges_with_an_engines_own_partial(dtype):
    """A cascade: the engine attends a shared prefix (8 rows) itself, mla-ops the rest of the context
    (4 rows) and the new tokens; merged by their LSEs, they equal attention over the whole context."""
    batch = make_batch([12], [3], seed=5, block_size=4, dtype=dtype)
    expect = dense_reference(*batch.args())
    rest = mla_ops.plan_prefill(batch.query_start_loc, torch.tensor([4], dtype=torch.int32),
                                batch.block_table[:, 2:].contiguous(), 4, absorb_max_query_len=0)
    ours = mla_ops.run_prefill(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight,
                               batch.softmax_scale, rest, return_lse=True)
    theirs = prefix_partial(batch, 8)
    out, _ = mla_ops.merge_attn_states(*(x.to(y.dtype) for x, y in zip(theirs, ours)), *ours)
    torch.testing.assert_close(out.double(), expect, rtol=0, atol=1e-10 if dtype == torch.float64 else 2e-5)


def stacked_caches(batch, layers=3):
    """``layers`` caches of the batch's geometry, each its own random rows."""
    g = torch.Generator().manual_seed(11)
    caches = torch.randn(layers, *batch.kv_cache.shape, generator=g, dtype=batch.kv_cache.dtype)
    caches[0] = batch.kv_cache
    return caches


def new_slots(batch):
    """A slot per new token in the blocks no context reads."""
    num_blocks, block_size = batch.kv_cache.shape[:2]
    used = {int(b) for row, c in zip(batch.block_table, batch.context_lens.tolist()) for b in row[: -(-c // block_size)]}
    free = [b for b in range(num_blocks) if b not in used]
    slots = [free[i // block_size] * block_size + i % block_size for i in range(batch.q.shape[0])]
    return torch.tensor(slots)


def test_one_step_serves_every_layer_and_checks_once(monkeypatch):
    batch, plan = batch_and_plan(PLANS["host, absorbed"], garbage_blocks=6)
    caches, slots = stacked_caches(batch), new_slots(batch)
    calls = {"block ids": 0, "select": 0}
    real_max_id, real_select = planning.current_max_block_id, backends.select

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(planning, "current_max_block_id", counted("block ids", real_max_id))
    monkeypatch.setattr(backends, "select", counted("select", real_select))
    step = mla_ops.begin_step(plan, caches, slots, backend="torch")
    outputs = [step.run(batch.q, batch.kv_c, batch.k_pe, caches[i], batch.kv_b_proj_weight, batch.softmax_scale)
               for i in range(caches.shape[0])]
    assert calls == {"block ids": 1, "select": 1}, "the plan's fit and the kernels: once per step"
    monkeypatch.undo()
    for i, out in enumerate(outputs):
        expect = dense_reference(batch.q, batch.kv_c, batch.k_pe, caches[i], *batch.args()[4:])
        torch.testing.assert_close(out, expect, rtol=0, atol=1e-10)
        rows = caches[i].view(-1, caches.shape[-1]).index_select(0, slots)
        torch.testing.assert_close(rows, torch.cat([batch.kv_c, batch.k_pe], 1), rtol=0, atol=0)


def test_a_step_without_slots_writes_nothing():
    batch, plan = batch_and_plan(PLANS["host"])
    before = batch.kv_cache.clone()
    step = mla_ops.begin_step(plan, batch.kv_cache, backend="torch")
    step.run(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight, batch.softmax_scale)
    assert torch.equal(batch.kv_cache, before)


BAD_STEPS = {
    "not a plan": (lambda b, p, c, s: dict(plan=object()), TypeError, "plan must be a PrefillPlan"),
    "cache rank": (lambda b, p, c, s: dict(kv_cache=c[0, 0]), ValueError, r"kv_cache must be \[num_blocks"),
    "block size": (lambda b, p, c, s: dict(kv_cache=c.view(3, -1, 2, c.shape[-1])), ValueError,
                   "made for block_size 4"),
    "blocks past the cache": (lambda b, p, c, s: dict(kv_cache=c[:, :2]), ValueError, "past the 2 blocks"),
    "slot past the cache": (lambda b, p, c, s: dict(slot_mapping=s + 10_000), ValueError, "past the"),
    "slot count": (lambda b, p, c, s: dict(slot_mapping=s[:-1]), ValueError, "plan was made for T="),
    "slot dtype": (lambda b, p, c, s: dict(slot_mapping=s.float()), TypeError, "slot_mapping must be int64"),
    "backend": (lambda b, p, c, s: dict(backend="cuda"), ValueError, "backend must be one of"),
    **{f"fp8 k_scale {value}": (lambda b, p, c, s, v=value: dict(kv_cache=c.to(torch.float8_e4m3fn),
                                                               k_scale=torch.tensor([v])), ValueError,
                                "k_scale must be finite and positive")
       for value in (0.0, -1.0, math.inf, math.nan, 1e-40)},
    **{f"fp8 k_scale float {value}": (lambda b, p, c, s, v=value: dict(kv_cache=c.to(torch.float8_e4m3fn), k_scale=v),
                                      ValueError, "k_scale must be finite and positive, a normal float32")
       for value in (1e-46, 1e39)},
}


@pytest.mark.parametrize("case", list(BAD_STEPS))
def test_begin_step_refuses_what_does_not_fit(case):
    batch, plan = batch_and_plan(PLANS["host"], garbage_blocks=6)
    caches, slots = stacked_caches(batch), new_slots(batch)
    change, error, match = BAD_STEPS[case]
    call = dict(plan=plan, kv_cache=caches, slot_mapping=slots, backend="torch")
    call.update(change(batch, plan, caches, slots))
    with pytest.raises(error, match=match):
        mla_ops.begin_step(call.pop("plan"), call.pop("kv_cache"), call.pop("slot_mapping"), **call)


BAD_LAYERS = {
    "another cache geometry": (lambda b, c: dict(kv_cache=torch.zeros(2, 4, c.shape[-1], dtype=c.dtype)),
                               ValueError, "not shaped like the cache the step began with"),
    "tokens": (lambda b, c: dict(q=b.q[:-1], kv_c=b.kv_c[:-1], k_pe=b.k_pe[:-1]), ValueError, "plan was made for T="),
    "softmax_scale": (lambda b, c: dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a float"),
    "return_lse": (lambda b, c: dict(return_lse=1), TypeError, "return_lse must be a bool"),
}


@pytest.mark.parametrize("case", list(BAD_LAYERS))
def test_a_layer_that_does_not_fit_its_step_writes_nothing(case):
    batch, plan = batch_and_plan(PLANS["host"], garbage_blocks=6)
    caches, slots = stacked_caches(batch), new_slots(batch)
    step = mla_ops.begin_step(plan, caches, slots, backend="torch")
    step.run(batch.q, batch.kv_c, batch.k_pe, caches[0], batch.kv_b_proj_weight, batch.softmax_scale)  # layer 0
    before = caches.clone()
    change, error, match = BAD_LAYERS[case]
    call = dict(q=batch.q, kv_c=batch.kv_c, k_pe=batch.k_pe, kv_cache=caches[1],
                kv_b_proj_weight=batch.kv_b_proj_weight, softmax_scale=batch.softmax_scale)
    call.update(change(batch, caches))
    with pytest.raises(error, match=match):
        step.run(**call)
    assert torch.equal(caches, before)



BAD_WRITES = {  # PrefillStep.write: the rows against the layer's cache and the step's slots
    "rows of another width": (lambda b: dict(kv_c=b.kv_c[:, :-2]), ValueError, r"kv_cache rows must be L\+R = 14\+4"),
    "fewer rows than slots": (lambda b: dict(kv_c=b.kv_c[:-1], k_pe=b.k_pe[:-1]), ValueError,
                              "kv_c, k_pe and slot_mapping must have one row per new token: kv_c has 11"),
    "k_pe of another dtype": (lambda b: dict(k_pe=b.k_pe.float()), TypeError, "k_pe must have the dtype of kv_c"),
}


@pytest.mark.parametrize("case", list(BAD_WRITES))
def test_a_layers_write_checks_its_rows_before_anything_is_written(case):
    """``PrefillStep.write`` (an engine's write after its own ``attend``) checks the rows as ``write_latent_cache``
    does (their shapes against the cache and the step's slots: no value read), and writes nothing when refused."""
    batch, plan = batch_and_plan(PLANS["host"], garbage_blocks=6)
    caches, slots = stacked_caches(batch), new_slots(batch)
    step = mla_ops.begin_step(plan, caches, slots, backend="torch")
    change, error, match = BAD_WRITES[case]
    call = dict(kv_c=batch.kv_c, k_pe=batch.k_pe, kv_cache=caches[1])
    call.update(change(batch))
    before = caches.clone()
    with pytest.raises(error, match=match):
        step.write(**call)
    assert torch.equal(caches, before)


# ---- a scale per layer; the step frozen ----------------------------------------------------------

FP8 = torch.float8_e4m3fn
SCALES = (0.5, 0.125, 2.0)  # one per layer, as engines keep them


def fp8_step(form="host", k_scale=None):
    """A step over three float8 caches (stacked) with free slots: ``(batch, step, caches, slots, layer args)``."""
    batch, plan = batch_and_plan(PLANS[form], garbage_blocks=6, dtype=torch.float32)
    caches, slots = stacked_caches(batch).to(FP8), new_slots(batch)
    step = mla_ops.begin_step(plan, caches, slots, k_scale=k_scale, backend="torch")
    return batch, step, caches, slots, (batch.q, batch.kv_c, batch.k_pe)


@pytest.mark.parametrize("form", ["host", "device, absorbed"])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_a_layers_k_scale_equals_a_step_begun_with_it(form, as_tensor):
    """One step, each layer passing its own scale (a float, or a 0-d float32 tensor as vLLM keeps it), equals a
    step per layer begun with that scale: through run, attend + write, over a step with another scale or none."""
    for i, scale in enumerate(SCALES):
        layer_scale = torch.tensor(scale) if as_tensor else scale
        batch, alone, want, _, new = fp8_step(form, k_scale=scale)
        expect = alone.run(*new, want[i], batch.kv_b_proj_weight, batch.softmax_scale)
        for begun, call in ((None, "run"), (4.0, "run"), (None, "attend + write")):
            _, step, caches, _, _ = fp8_step(form, k_scale=begun)
            layer = (*new, caches[i], batch.kv_b_proj_weight, batch.softmax_scale)
            if call == "run":
                out = step.run(*layer, k_scale=layer_scale)
            else:
                out = step.attend(*layer, k_scale=layer_scale)
                step.write(batch.kv_c, batch.k_pe, caches[i], k_scale=layer_scale)
            torch.testing.assert_close(out, expect, rtol=0, atol=0)
            assert torch.equal(caches.view(torch.uint8), want.view(torch.uint8)), "the rows stored with its scale"


def test_a_float8_layer_needs_a_scale_from_the_step_or_its_call():
    batch, step, caches, _, new = fp8_step()
    before = caches.clone()
    with pytest.raises(ValueError, match=r"k_scale is required for a float8_e4m3fn kv_cache .*pass the layer's k_scale="):
        step.run(*new, caches[0], batch.kv_b_proj_weight, batch.softmax_scale)
    with pytest.raises(ValueError, match="k_scale is required"):
        step.write(batch.kv_c, batch.k_pe, caches[0])
    assert torch.equal(caches.view(torch.uint8), before.view(torch.uint8))


BAD_LAYER_SCALES = {
    "zero": (0.0, ValueError, "k_scale must be finite and positive"),
    "negative": (-1.0, ValueError, "k_scale must be finite and positive"),
    "nan": (math.nan, ValueError, "k_scale must be finite and positive"),
    "past float32": (1e39, ValueError, "k_scale must be finite and positive, a normal float32"),
    "zero tensor": (torch.tensor([0.0]), ValueError, "k_scale must be finite and positive"),
    "two elements": (torch.tensor([0.5, 0.5]), ValueError, "k_scale must be a float or a one-element float32 tensor"),
    "float64 tensor": (torch.tensor(0.5, dtype=torch.float64), ValueError, "k_scale must be a float or a one-element"),
    "a string": ("0.5", TypeError, "k_scale must be a float or a one-element float32 tensor"),
    "a bool": (True, TypeError, "k_scale must be a float"),
    "on meta": (torch.tensor([0.5], device="meta"), ValueError, "k_scale must be on cpu"),
}


@pytest.mark.parametrize("case", list(BAD_LAYER_SCALES))
@pytest.mark.parametrize("call", ["run", "attend", "write"])
def test_a_bad_layer_scale_is_refused_by_name_before_anything_is_written(case, call):
    scale, error, match = BAD_LAYER_SCALES[case]
    batch, step, caches, _, new = fp8_step(k_scale=0.5)
    before, out = caches.clone(), torch.full((batch.q.shape[0], *batch.q.shape[1:2], 8), math.nan)
    layer = (*new, caches[1], batch.kv_b_proj_weight, batch.softmax_scale)
    with pytest.raises(error, match=match):
        if call == "write":
            step.write(batch.kv_c, batch.k_pe, caches[1], k_scale=scale)
        else:
            getattr(step, call)(*layer, k_scale=scale, out=out)
    assert torch.equal(caches.view(torch.uint8), before.view(torch.uint8)) and out.isnan().all()


def test_the_step_is_frozen_and_a_layer_changes_nothing_in_it():
    batch, plan = batch_and_plan(PLANS["device, absorbed"])
    caches, slots = stacked_caches(batch), new_slots(batch)
    step = mla_ops.begin_step(plan, caches, slots, backend="torch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.k_scale = torch.tensor([1.0])
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.anything = None  # no new attribute either
    held = {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
    assert held["truncated"] is not None and held["tokens_known"]  # the device plan's token map: made once, here
    step.run(batch.q, batch.kv_c, batch.k_pe, caches[0], batch.kv_b_proj_weight, batch.softmax_scale)
    assert all(getattr(step, name) is value for name, value in held.items())
    leaves, spec = torch.utils._pytree.tree_flatten(step)  # a nested compile region's input
    assert any(x is step.slot_mapping for x in leaves) and any(x is step.truncated for x in leaves)  # tensors: leaves
    assert not any(isinstance(x, (backends.Kernels, torch.dtype)) for x in leaves)  # kernels and dtype: context
    again = torch.utils._pytree.tree_unflatten(leaves, spec)
    assert type(again) is mla_ops.PrefillStep and again.kernels is step.kernels and again.truncated is step.truncated


def test_run_has_no_write_switch():
    batch, plan = batch_and_plan(PLANS["host"])
    step = mla_ops.begin_step(plan, batch.kv_cache, new_slots(batch), backend="torch")
    before = batch.kv_cache.clone()
    with pytest.raises(TypeError, match="unexpected keyword argument 'write'"):
        step.run(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight, batch.softmax_scale,
                 write=False)
    assert torch.equal(batch.kv_cache, before)


# ---- options= ---------------------------------------------------------------------------------


def test_plan_prefill_takes_its_options_as_one_object():
    batch = make_batch(CTX, QLENS, seed=3, block_size=4)
    lengths = (batch.query_start_loc, batch.context_lens, batch.block_table)
    options = mla_ops.PlanOptions(block_size=4, workspace_size=8, absorb_max_query_len=0)
    by_object = mla_ops.plan_prefill(*lengths, options=options)
    by_keywords = mla_ops.plan_prefill(*lengths, 4, 8, absorb_max_query_len=0)
    assert by_object.options == by_keywords.options == options
    assert repr(by_object) == repr(by_keywords) and by_object.schedule.num_chunks == 4
    with pytest.raises(ValueError, match="workspace_size=16 was passed beside options="):
        mla_ops.plan_prefill(*lengths, workspace_size=16, options=options)
    with pytest.raises(TypeError, match="options must be a mla_ops.PlanOptions"):
        mla_ops.plan_prefill(*lengths, options={"block_size": 4})


def test_the_plans_repr_shows_what_was_asked_and_what_was_planned():
    batch = make_batch(CTX, QLENS, seed=3, block_size=4)
    lengths = (batch.query_start_loc, batch.context_lens, batch.block_table)
    host = repr(mla_ops.plan_prefill(*lengths, 4, 8))  # the default routing: every request with context routed
    assert "form='host'" in host and "absorbed_query_bound=4" in host and "absorb_max_query_len=None" in host
    assert "absorbed_rows=7" in host and "chunks=0" in host
    device = repr(mla_ops.plan_prefill(*lengths, 4, 8, max_chunks=4, absorb_max_query_len=2))
    assert "form='device'" in device and "max_chunks=4" in device and "absorbed_query_bound=2" in device
    off = repr(mla_ops.plan_prefill(*lengths, 4, 8, absorb_max_query_len=0))
    assert "absorbed=none" in off and "chunks=4" in off
