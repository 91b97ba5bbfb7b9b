"""Stacked layers (``MLAModel.stack_layers``, ``mla_ops.models.stacking``): each run of like layers' weights in one
tensor per name, the layers' parameters views of it; under a whole-model ``torch.compile`` with stacked caches each
run is one ``scan`` (``regions.run_stacked``), equal to eager."""

import dataclasses

import pytest
import torch
from torch import nn
from torch._dynamo.testing import AotEagerAndRecordGraphs

import mla_ops
from mla_ops.models import regions
from mla_ops.models.config import IndexerConfig
from tests.support.batches import model_step

TINY = mla_ops.MLAConfig.from_name("tiny")
# Two dense layers then three mixture-of-experts ones: two runs.
MOE = dataclasses.replace(TINY, num_hidden_layers=5, first_k_dense_replace=2, n_routed_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)
# No q-LoRA (DeepSeek-V2-Lite's plain q_proj), MiniCPM3's residual scale: one run.
LITE = dataclasses.replace(TINY, num_hidden_layers=4, q_lora_rank=None,
                           scalings=dataclasses.replace(TINY.scalings, residual_scale=0.5))
OPTIONS = mla_ops.PlanOptions(block_size=4, workspace_size=16, max_chunks=4, absorb_max_query_len=3)
MIXES = [([5, 0, 13], [3, 2, 4]), ([0, 0, 0], [6, 1, 2]), ([20, 9, 3], [1, 7, 2])]
needs_scan = pytest.mark.skipif(not regions.NESTED_REGIONS, reason="stacked layers scan on torch >= 2.13")


def run(model, ids, positions, caches, slots, table, qsl, ctx):
    plan = mla_ops.plan_prefill(qsl, ctx, table, options=OPTIONS)
    return model(ids, positions, caches, slots, plan)


def views_of_stacks(model) -> bool:
    for run_ in model.layer_runs:
        for name, stacked in zip(run_.names, run_.weights):
            for i, layer in enumerate(model.layers[run_.start:run_.start + run_.count]):
                tensor = layer.get_parameter(name) if name in dict(layer.named_parameters()) else layer.get_buffer(name)
                if tensor.data_ptr() != stacked[i].data_ptr() or not torch.equal(tensor, stacked[i]):
                    return False
    return True


def test_stacking_keeps_parameters_and_names_and_makes_them_views():
    torch.manual_seed(0)
    model = mla_ops.MLAModel(MOE)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: p for n, p in model.named_parameters()}
    assert model.stack_layers() is model
    assert [(r.start, r.count, r.cache) for r in model.layer_runs] == [(0, 2, 0), (2, 3, 2)]
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    assert views_of_stacks(model)


def test_conversion_and_loading_restack():
    torch.manual_seed(0)
    model = mla_ops.MLAForCausalLM(LITE).stack_layers()
    model.to(torch.float64)
    assert model.model.layer_runs[0].weights[0].dtype == torch.float64 and views_of_stacks(model.model)
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state)  # in place: into the stacks
    assert views_of_stacks(model.model)
    assert torch.equal(model.model.layer_runs[0].weights[0][1], state[f"model.layers.1.{model.model.layer_runs[0].names[0]}"])
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)  # new tensors: stacked anew
    assert model.model.layer_runs is not None and views_of_stacks(model.model)
    name = model.model.layer_runs[0].names[0]
    assert torch.equal(model.model.layer_runs[0].weights[0][2], state[f"model.layers.2.{name}"])


def test_a_tensor_set_anew_unstacks_until_stacked_again():
    model = mla_ops.MLAModel(TINY).stack_layers()
    layer = model.layers[1].mlp.up_proj
    layer.weight = nn.Parameter(torch.randn_like(layer.weight))
    assert model.layer_runs is None
    model.stack_layers()
    assert views_of_stacks(model)


def test_a_sparse_models_layers_are_refused():
    sparse = dataclasses.replace(TINY, indexer=IndexerConfig(index_topk=8, index_n_heads=4, index_head_dim=16))
    with pytest.raises(ValueError, match="layer 0 cannot be stacked: it has an indexer"):
        mla_ops.MLAModel(sparse).stack_layers()


def test_stacked_allocation_is_checked():
    model = mla_ops.MLAModel(TINY)
    caches = model.allocate_kv_caches(8, 4, stacked=True)
    assert caches.latent.shape == (2, 8, 4, TINY.kv_lora_rank + TINY.qk_rope_head_dim)
    with pytest.raises(TypeError, match="stacked must be a bool"):
        model.allocate_kv_caches(8, 4, stacked="yes")


def test_write_layers_writes_each_layers_rows_at_the_steps_slots():
    torch.manual_seed(0)
    caches = torch.zeros(4, 6, 4, 40)
    slots = torch.tensor([3, -1, 9, 22])
    plan = mla_ops.plan_prefill(torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                                torch.arange(6, dtype=torch.int32)[None], 4, 64)
    step = mla_ops.begin_step(plan, caches[0], slots)
    kv_c, k_pe = torch.randn(2, 4, 32), torch.randn(2, 4, 8)
    step.write_layers(kv_c, k_pe, caches, 1)
    expect = torch.zeros(4, 6, 4, 40)
    for i in range(2):
        step.write(kv_c[i], k_pe[i], expect[1 + i])
    assert torch.equal(caches, expect) and caches[1:3].count_nonzero() == 2 * 3 * 40
    with pytest.raises(ValueError, match=r"layers 3\.\.4 are not all in kv_caches"):
        step.write_layers(kv_c, k_pe, caches, 3)


@needs_scan
@torch.no_grad()
@pytest.mark.parametrize("config", [MOE, LITE], ids=["dense-and-moe", "lite"])
def test_a_stacked_model_compiles_to_one_scan_per_run_equal_to_eager(config):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = mla_ops.MLAForCausalLM(config).to(torch.float64).eval().stack_layers()
    base = model.allocate_kv_caches(64, 4, stacked=True).latent.normal_()
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(lambda *args: run(model, *args), backend=backend, fullgraph=True, dynamic=True)
    for i, (context_lens, query_lens) in enumerate(MIXES):
        ids, positions, slots, table, qsl, ctx = model_step(config, context_lens, query_lens, seed=i)
        caches, expect = mla_ops.KVCaches(base.clone()), [t.clone() for t in base]
        torch._dynamo.mark_static(caches.latent)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out = compiled(ids, positions, caches, slots, table, qsl, ctx)
        ref = run(model, ids, positions, expect, slots, table, qsl, ctx)
        torch.testing.assert_close(out, ref, rtol=1e-7, atol=1e-7)  # MoE's routing sums in another order
        torch.testing.assert_close(caches.latent, torch.stack(expect), rtol=1e-7, atol=1e-7)
    (graph,) = backend.graphs
    targets = [n.target for n in graph.graph.nodes]
    assert targets.count(torch.ops.higher_order.scan) == len(model.model.layer_runs)
    assert torch.ops.higher_order.invoke_subgraph not in targets


@needs_scan
@torch.no_grad()
def test_stacked_caches_under_compile_need_a_stacked_model():
    torch._dynamo.reset()
    model = mla_ops.MLAModel(TINY).eval()
    ids, positions, slots, table, qsl, ctx = model_step(TINY, [5, 0, 13], [3, 2, 4], seed=0)
    caches = model.allocate_kv_caches(64, 4, stacked=True)
    compiled = torch.compile(lambda *args: run(model, *args), backend="aot_eager", fullgraph=True, dynamic=True)
    with pytest.raises(Exception, match="stack_layers"):
        compiled(ids, positions, caches, slots, table, qsl, ctx)


@needs_scan
@torch.no_grad()
def test_inductor_compiles_the_scan_and_its_one_write():
    """Inductor's code for the scan and the run's write (one cache write into the stack read as one cache)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = mla_ops.MLAModel(dataclasses.replace(TINY, num_hidden_layers=3)).to(torch.float64).eval().stack_layers()
    ids, positions, slots, table, qsl, ctx = model_step(model.config, [5, 0, 13], [3, 2, 4], seed=0)
    caches = mla_ops.KVCaches(model.allocate_kv_caches(64, 4, stacked=True).latent.normal_())
    expect = [t.clone() for t in caches.latent]
    torch._dynamo.mark_static(caches.latent)
    out = torch.compile(lambda *args: run(model, *args), fullgraph=True, dynamic=True)(ids, positions, caches, slots,
                                                                                      table, qsl, ctx)
    ref = run(model, ids, positions, expect, slots, table, qsl, ctx)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(caches.latent, torch.stack(expect), rtol=1e-12, atol=1e-12)  # each row in its layer


def test_tied_or_hooked_layers_are_refused_before_anything_is_stacked():
    model = mla_ops.MLAModel(dataclasses.replace(TINY, num_hidden_layers=3))
    model.layers[2].mlp.up_proj.weight = model.layers[1].mlp.up_proj.weight
    with pytest.raises(ValueError, match="layer 1 cannot be stacked: it shares a tensor"):
        model.stack_layers()
    weight = model.layers[0].mlp.up_proj.weight
    assert model.layer_runs is None and weight.untyped_storage().nbytes() == weight.nbytes  # its own, no stack's
    model = mla_ops.MLAModel(TINY)
    model.layers[1].self_attn.register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match="layer 1 cannot be stacked: it has module hooks"):
        model.stack_layers()


@needs_scan
@torch.no_grad()
def test_a_float8_cache_with_one_scale_is_scanned_too():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = mla_ops.MLAModel(dataclasses.replace(TINY, num_hidden_layers=3)).eval().stack_layers()
    ids, positions, slots, table, qsl, ctx = model_step(model.config, [5, 0, 13], [3, 2, 4], seed=0)
    stacked = torch.randn(3, 64, 4, 40).to(torch.float8_e4m3fn)
    caches = model.allocate_kv_caches(64, 4, torch.float8_e4m3fn, stacked=True, k_scale=0.5)
    caches.latent.copy_(stacked)
    expect = model.allocate_kv_caches(64, 4, torch.float8_e4m3fn, k_scale=0.5)
    for t, s in zip(expect.latent, stacked):
        t.copy_(s)
    backend = AotEagerAndRecordGraphs()
    out = torch.compile(lambda *args: run(model, *args), backend=backend, fullgraph=True, dynamic=True)(
        ids, positions, caches, slots, table, qsl, ctx)
    ref = run(model, ids, positions, expect, slots, table, qsl, ctx)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches.latent.float(), torch.stack(list(expect.latent)).float(), rtol=0, atol=0)
    assert [n.target for g in backend.graphs for n in g.graph.nodes].count(torch.ops.higher_order.scan) == 1, len(backend.graphs)
