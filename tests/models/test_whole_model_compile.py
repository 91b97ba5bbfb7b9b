"""``torch.compile`` of a whole model step: the device plan made inside the graph, each layer's parts nested
compile regions (``mla_ops.models.regions``), traced once per layer kind and stamped out for every other
layer. (The generated code, the fused merge and the planner run once: tests/prefill/test_compile.py; the
families' layer kinds: their test files.)"""

import dataclasses
import warnings

import pytest
import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs

import mla_ops
from mla_ops.models import regions
from mla_ops.models.config import IndexerConfig
from mla_ops.planning import options as plan_options
from tests.support.batches import cache_list, clone_caches, model_step, normal_caches
from tests.support.gpu import DEVICE, TOL, needs_cuda

# Two dense layers then two mixture-of-experts ones: two kinds of the part after the cache write, one before it
# (a region called once is inlined: two of each kind).
MOE = dataclasses.replace(mla_ops.MLAConfig.from_name("tiny"), num_hidden_layers=4, first_k_dense_replace=2,
                          n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)
OPTIONS = mla_ops.PlanOptions(block_size=4, workspace_size=16, max_chunks=4, absorb_max_query_len=3)
# The same layers with DeepSeek Sparse Attention's indexer: each layer writes a latent row and an index key per token.
SPARSE = dataclasses.replace(MOE, indexer=IndexerConfig(index_topk=8, index_n_heads=4, index_head_dim=16))
# Three requests every step (the cache's block size is 4, and so is B + 1: kept apart by marking nothing
# static, a different B would only be another graph); contexts and queries vary, chunked and absorbed.
MIXES = [([5, 0, 13], [3, 2, 4]), ([0, 0, 0], [6, 1, 2]), ([20, 9, 3], [1, 7, 2]), ([31, 0, 8], [2, 2, 9])]


def run(model, ids, positions, caches, slots, table, qsl, ctx):
    plan = mla_ops.plan_prefill(qsl, ctx, table, options=OPTIONS)
    return model(ids, positions, caches, slots, plan)


@torch.no_grad()
@pytest.mark.skipif(not regions.NESTED_REGIONS, reason="this torch has no reusable nested regions")
def test_dense_and_moe_layers_compile_once_for_every_batch_mix():
    """Each layer is one region (its cache writes between the regions), one per layer kind."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = mla_ops.MLAForCausalLM(MOE).eval()
    base = normal_caches(model.allocate_kv_caches(64, 4))
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(lambda *args: run(model, *args), backend=backend, fullgraph=True, dynamic=True)
    for i, (context_lens, query_lens) in enumerate(MIXES):
        ids, positions, slots, table, qsl, ctx = model_step(MOE, context_lens, query_lens, seed=i)
        caches, expect_caches = clone_caches(base), clone_caches(base)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out = compiled(ids, positions, caches, slots, table, qsl, ctx)
        expect = run(model, ids, positions, expect_caches, slots, table, qsl, ctx)
        torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache_list(caches), cache_list(expect_caches), rtol=1e-5, atol=1e-5)
    (graph,) = backend.graphs
    calls = [n.args[1] for n in graph.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == MOE.num_hidden_layers  # a layer is one region
    assert len(set(calls)) == 2, calls  # one per MLP kind


def test_a_stacked_cache_tensor_is_refused_by_name_under_compile():
    """Compiled writes into the views of one stacked buffer would land in the wrong layer (pytorch#198068)."""
    torch._dynamo.reset()
    model = mla_ops.MLAForCausalLM(MOE).eval()
    ids, positions, slots, table, qsl, ctx = model_step(MOE, [5, 0, 13], [3, 2, 4], seed=0)
    compiled = torch.compile(lambda *args: run(model, *args), backend="eager", fullgraph=True, dynamic=True)
    with torch.no_grad(), pytest.raises(ValueError, match=r"^kv_caches.latent is one stacked tensor: under torch.compile "
                                                          r"pass a list of 4 \[num_blocks, block_size, 40\]"):
        compiled(ids, positions, torch.stack(model.allocate_kv_caches(64, 4).latent), slots, table, qsl, ctx)


@torch.no_grad()
def test_the_model_compiles_with_inductor_on_unmarked_caches():
    """``torch.compile(model, fullgraph=True, dynamic=True)`` with Inductor on CPU, the caches marked neither
    static nor dynamic (issue 48 item 6 reported an Inductor crash there): one graph for two batch mixes, eager's
    logits and caches."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = mla_ops.MLAConfig.from_name("tiny")
    model = mla_ops.MLAForCausalLM(config).eval()
    base = normal_caches(model.allocate_kv_caches(64, 4))
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for i, (context_lens, query_lens) in enumerate(MIXES[:2]):
        ids, positions, slots, table, qsl, ctx = model_step(config, context_lens, query_lens, seed=i)
        plan = mla_ops.plan_prefill(qsl, ctx, table, options=OPTIONS)
        caches, expect_caches = clone_caches(base), clone_caches(base)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out = compiled(ids, positions, caches, slots, plan)
        torch.testing.assert_close(out, model(ids, positions, expect_caches, slots, plan), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache_list(caches), cache_list(expect_caches), rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("scales", [(0.05, 0.125), ([0.05, 0.1, 0.05, 0.1], [0.125, 0.05, 0.1, 0.125])],
                         ids=["one float", "a float per layer"])
def test_float8_caches_with_float_scales_compile_and_check_their_scales(scales):
    """A float scale in a compiled model's caches is traced (a symbol under dynamic=True): another value runs
    with that value, and one that float32 makes 0 or inf is refused by name, as in eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = mla_ops.MLAForCausalLM(MOE).eval()
    compiled = torch.compile(lambda *args: run(model, *args), backend="eager", fullgraph=True, dynamic=True)
    ids, positions, slots, table, qsl, ctx = model_step(MOE, [5, 0, 13], [3, 2, 4], seed=0)
    base = model.allocate_kv_caches(64, 4)
    normal_caches(base)
    for k_scale in scales:
        fp8 = [c.to(torch.float8_e4m3fn) for c in base.latent]
        caches = mla_ops.KVCaches(latent=[c.clone() for c in fp8], k_scale=k_scale)
        expect_caches = mla_ops.KVCaches(latent=[c.clone() for c in fp8], k_scale=k_scale)
        out = compiled(ids, positions, caches, slots, table, qsl, ctx)
        expect = run(model, ids, positions, expect_caches, slots, table, qsl, ctx)
        torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close([c.float() for c in caches.latent], [c.float() for c in expect_caches.latent],
                                   rtol=0, atol=0)
    bad = 1e39 if isinstance(scales[0], float) else [0.05, 0.05, 1e-46, 0.05]
    name = "k_scale" if isinstance(scales[0], float) else r"k_scale\[2\]"
    with pytest.raises(ValueError, match=rf"^{name} must be finite and positive, a normal float32"):
        compiled(ids, positions, mla_ops.KVCaches(latent=[c.to(torch.float8_e4m3fn) for c in base.latent],
                                                  k_scale=bad), slots, table, qsl, ctx)


def test_without_reusable_regions_a_compiled_model_warns_once(monkeypatch):
    """Where torch cannot reuse nested regions (before 2.13) a compiled model traces every layer, and says so
    once, at trace time (the flag is what the layers read; the graph still equals eager)."""
    monkeypatch.setattr(regions, "NESTED_REGIONS", False)
    regions._warn_once.cache_clear()
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = mla_ops.MLAConfig.from_name("tiny")
    model = mla_ops.MLAModel(config).eval()
    ids, positions, slots, table, qsl, ctx = model_step(config, [5, 0, 13], [3, 2, 4], seed=0)
    compiled = torch.compile(lambda *args: run(model, *args), backend="aot_eager", fullgraph=True, dynamic=True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = compiled(ids, positions, model.allocate_kv_caches(64, 4), slots, table, qsl, ctx)
        compiled(ids, positions, model.allocate_kv_caches(64, 4), slots, table, qsl, ctx)
    messages = [str(w.message) for w in caught if "nested compile regions" in str(w.message)]
    assert len(messages) == 1 and "model.compile_layers()" in messages[0], messages
    with torch.no_grad():
        expect = run(model, ids, positions, model.allocate_kv_caches(64, 4), slots, table, qsl, ctx)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@needs_cuda
@torch.no_grad()
def test_the_whole_model_compiles_on_cuda_and_equals_eager():
    """Inductor with the CUDA kernels (Triton ops inside the regions), unmarked caches, two batch mixes."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = mla_ops.MLAForCausalLM(MOE).eval().to(DEVICE)
    base = normal_caches(model.allocate_kv_caches(64, 4))
    compiled = torch.compile(lambda *args: run(model, *args), fullgraph=True, dynamic=True)
    for i, (context_lens, query_lens) in enumerate(MIXES[:2]):
        inputs = [t.to(DEVICE) for t in model_step(MOE, context_lens, query_lens, seed=i)]
        caches, expect_caches = clone_caches(base), clone_caches(base)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out = compiled(*inputs[:2], caches, *inputs[2:])
        expect = run(model, *inputs[:2], expect_caches, *inputs[2:])
        torch.testing.assert_close(out, expect, rtol=TOL[torch.float32], atol=TOL[torch.float32])
        tol = TOL[torch.float32]
        torch.testing.assert_close(cache_list(caches), cache_list(expect_caches), rtol=tol, atol=tol)


class Runner:
    """An engine-style runner: the plan's sizes live on ``self``, as plain ints."""

    def __init__(self, model):
        self.model, self.block_size, self.workspace_size, self.max_chunks = model, 4, 16, 4

    def step(self, ids, positions, caches, slots, table, qsl, ctx):
        plan = mla_ops.plan_prefill(qsl, ctx, table, self.block_size, self.workspace_size, max_chunks=self.max_chunks)
        return self.model(ids, positions, caches, slots, plan)


@torch.no_grad()
@pytest.mark.parametrize("holder", ["closure", "self"])
def test_plan_sizes_held_in_closures_or_on_self_compile_under_dynamic_shapes(holder):
    """Ints a compiled step closes over (or reads from ``self``) arrive symbolic under ``dynamic=True``; the plan
    specialises them (a guard on their values), so the nested regions meet constants and one graph serves
    every batch mix."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = mla_ops.MLAForCausalLM(MOE).eval()
    base = normal_caches(model.allocate_kv_caches(64, 4))
    block_size, workspace_size, max_chunks = 4, 16, 4

    def closure_step(ids, positions, caches, slots, table, qsl, ctx):
        plan = mla_ops.plan_prefill(qsl, ctx, table, block_size, workspace_size, max_chunks=max_chunks)
        return model(ids, positions, caches, slots, plan)

    step = closure_step if holder == "closure" else Runner(model).step
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for i, (context_lens, query_lens) in enumerate(MIXES):
        ids, positions, slots, table, qsl, ctx = model_step(MOE, context_lens, query_lens, seed=i)
        caches, expect_caches = clone_caches(base), clone_caches(base)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out = compiled(ids, positions, caches, slots, table, qsl, ctx)
        torch.testing.assert_close(out, step(ids, positions, expect_caches, slots, table, qsl, ctx),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache_list(caches), cache_list(expect_caches), rtol=1e-5, atol=1e-5)


def steps(model, config, backend=None) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Every mix of MIXES on the same random caches, eagerly or compiled with ``backend``: each step's logits and
    caches."""
    # The sparse route on both sides: eager CPU may route a request to top-k-masked MHA (exact, not bit for bit)
    options = dataclasses.replace(OPTIONS, index_topk=config.index_topk)

    def step(ids, positions, caches, slots, table, qsl, ctx):
        return model(ids, positions, caches, slots, mla_ops.plan_prefill(qsl, ctx, table, options=options))

    if backend is not None:
        step = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
    torch.manual_seed(1)
    base = normal_caches(model.allocate_kv_caches(64, 4))
    done = []
    for i, (context_lens, query_lens) in enumerate(MIXES):
        ids, positions, slots, table, qsl, ctx = model_step(config, context_lens, query_lens, seed=i)
        caches = clone_caches(base)
        with torch.compiler.set_stance("fail_on_recompile" if i and backend is not None else "default"):
            done.append((step(ids, positions, caches, slots, table, qsl, ctx), cache_list(caches)))
    return done


WRITES = (torch.ops.mla_ops.write_latent_cache.default, torch.ops.mla_ops.write_packed_cache.default)


@torch.no_grad()
@pytest.mark.skipif(not regions.NESTED_REGIONS, reason="this torch has no reusable nested regions")
@pytest.mark.parametrize("config", [MOE, SPARSE], ids=["dense", "sparse"])
def test_cache_writes_inside_and_between_the_regions_agree_bit_for_bit(config, monkeypatch):
    """float64: a compiled step whose layers write their rows (latent rows; a sparse layer's index keys too) inside
    their regions (torch >= 2.14: ``WRITES_IN_REGIONS``) and one whose rows are written between the regions (torch
    2.13's path, the only one there) give eager's logits and caches bit for bit; with the writes inside, the step's
    graph holds none of them (a write per layer and cache between the regions)."""
    torch.manual_seed(0)
    model = mla_ops.MLAForCausalLM(config).double().eval()
    # Eager on the sparse route too: its cost model may pick top-k-masked MHA (exact, not bit for bit), which
    # compiled code never takes
    monkeypatch.setattr(plan_options, "MEASURED_MASKED_MHA_RATIO", 0.0)
    expect = steps(model, config)
    for inside in (False, True) if regions.WRITES_IN_REGIONS else (False,):
        monkeypatch.setattr(regions, "WRITES_IN_REGIONS", inside)
        torch._dynamo.reset()
        backend = AotEagerAndRecordGraphs()
        for (out, caches), (expect_out, expect_caches) in zip(steps(model, config, backend), expect, strict=True):
            assert torch.equal(out, expect_out), inside
            assert all(torch.equal(a, b) for a, b in zip(caches, expect_caches, strict=True)), inside
        (graph,) = backend.graphs
        writes = [n for n in graph.graph.nodes if n.target in WRITES]
        per_layer = 1 + (config.index_topk is not None)
        assert len(writes) == (0 if inside else per_layer * config.num_hidden_layers), (inside, len(writes))
        calls = [n for n in graph.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
        assert len(calls) == config.num_hidden_layers
