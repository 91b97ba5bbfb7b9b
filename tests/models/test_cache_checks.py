"""The caches a model step is handed (``mla_ops.models.kv_caches.check_caches``): checked across every cache
layer before any layer runs, so a refused step writes nothing.

* a cache of another dtype than the model's (float8_e4m3fn aside) is a TypeError naming the part
  (``kv_caches.latent``, ``kv_caches.index``), per-layer lists, stacked or a ``KVCaches``;
* float8 caches need their scales: one for every layer, or one per layer (as vLLM keeps them);
* two cache layers that share memory (the same tensor twice, overlapping views of one buffer, an index cache
  inside a latent one) are a ValueError naming both: one layer's writes would land in the other's rows.
  The views of one stacked tensor do not overlap and stay accepted.
"""

import dataclasses

import pytest
import torch

import mla_ops
from mla_ops import MLAConfig
from tests.support.batches import caches_equal, clone_caches, model_step, normal_caches

FLOAT8 = torch.float8_e4m3fn


def dense_model():
    torch.manual_seed(0)
    return mla_ops.MLAForCausalLM(MLAConfig.from_name("tiny")).eval()


def sparse_model():
    torch.manual_seed(0)
    indexer = dict(index_topk=4, index_n_heads=2, index_head_dim=8)
    config = dataclasses.replace(MLAConfig.from_name("tiny"), indexer=indexer)
    return mla_ops.MLAForCausalLM(config).eval()


def run_step(model, caches):
    """One step with contexts [0, 6] and queries [7, 3] (block size 4, 64 blocks) on ``caches``."""
    c = model.config
    ids, positions, slots, table, qsl, ctx = model_step(c, [0, 6], [7, 3], seed=1)
    plan = mla_ops.plan_prefill(qsl, ctx, table, 4, index_topk=c.index_topk)
    with torch.no_grad():
        return model(ids, positions, caches, slots, plan)


def refused_untouched(model, caches, error, match, run=None):
    """The step (``run(caches)``, by default ``run_step``) is refused with ``error`` matching ``match``, and writes
    none of ``caches``' bytes."""
    before = clone_caches(caches) if not isinstance(caches, torch.Tensor) else caches.clone()
    with pytest.raises(error, match=match), torch.no_grad():
        (run or (lambda c: run_step(model, c)))(caches)
    same = torch.equal(caches, before) if isinstance(caches, torch.Tensor) else caches_equal(caches, before)
    assert same, "the refused step wrote a cache"


def fresh(model):
    return normal_caches(model.allocate_kv_caches(64, 4))


def as_dtype(caches, dtype):
    return [t.to(dtype) for t in caches]


OTHER_DTYPES = [torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", OTHER_DTYPES, ids=str)
@pytest.mark.parametrize("form", ["per-layer", "stacked"])
def test_a_dense_cache_of_another_dtype_is_refused_by_name(form, dtype):
    model = dense_model()
    caches = as_dtype(fresh(model).latent, dtype)
    if form == "stacked":
        caches = torch.stack(caches)
    refused_untouched(model, caches, TypeError,
                      rf"kv_caches.latent must have the model's dtype \(torch.float32\).*{dtype}")


@pytest.mark.parametrize("dtype", OTHER_DTYPES, ids=str)
@pytest.mark.parametrize("part", ["latent", "index"])
def test_a_sparse_cache_part_of_another_dtype_is_refused_by_name(part, dtype):
    model = sparse_model()
    caches = fresh(model)
    caches = dataclasses.replace(caches, **{part: as_dtype(getattr(caches, part), dtype)})
    refused_untouched(model, caches, TypeError, rf"kv_caches.{part} must have the model's dtype .*{dtype}")


def test_float8_caches_stay_accepted():
    """float8_e4m3fn is the one other dtype a cache may have (with its scales, which are required)."""
    model = sparse_model()
    caches = fresh(model)
    caches = mla_ops.KVCaches(as_dtype(caches.latent, FLOAT8), as_dtype(caches.index, FLOAT8))
    with pytest.raises(ValueError, match="k_scale is required"):
        run_step(model, caches)
    logits = run_step(model, dataclasses.replace(caches, k_scale=0.5, k_scale_index=0.5))
    assert logits.isfinite().all()


def test_float8_scales_per_layer():
    """vLLM keeps a scale per layer: a list of one per cache layer reads as each layer's own (the same values as
    one scale give the same logits; other values, other logits), and a list of the wrong length or a bad entry
    is refused by name before anything is written."""
    model = sparse_model()
    base = fresh(model)
    caches = mla_ops.KVCaches(as_dtype(base.latent, FLOAT8), as_dtype(base.index, FLOAT8), k_scale_index=0.5)
    layers = len(caches.latent)
    one = run_step(model, clone_caches(dataclasses.replace(caches, k_scale=0.5)))
    assert torch.equal(run_step(model, clone_caches(dataclasses.replace(caches, k_scale=[0.5] * layers))), one)
    other = run_step(model, clone_caches(dataclasses.replace(caches, k_scale=[0.5] * (layers - 1) + [0.25])))
    assert not torch.equal(other, one)
    refused_untouched(model, dataclasses.replace(caches, k_scale=[0.5] * (layers + 1)), ValueError,
                      rf"k_scale must be None, one scale, or a list of one per cache layer \({layers}\)")
    refused_untouched(model, dataclasses.replace(caches, k_scale=[0.5] * (layers - 1) + [None]), ValueError,
                      rf"k_scale\[{layers - 1}\] is required")
    refused_untouched(model, dataclasses.replace(caches, k_scale=[0.5] * (layers - 1) + [-1.0]), ValueError,
                      rf"k_scale\[{layers - 1}\]")


def overlapping_views(model):
    """Two layers' caches cut from one buffer, the second starting inside the first."""
    first = fresh(model).latent[0]
    num_blocks, block_size, width = first.shape
    buffer = torch.randn(num_blocks * block_size * width + block_size * width)
    view = lambda start: buffer.narrow(0, start, first.numel()).view(first.shape)  # noqa: E731
    return [view(0), view(block_size * width)]


ALIASED_DENSE = {
    "the same tensor twice": (lambda m: [fresh(m).latent[0]] * 2,
                              r"kv_caches.latent\[1\] shares memory with kv_caches.latent\[0\]"),
    "overlapping views of one buffer": (overlapping_views,
                                        r"kv_caches.latent\[1\] shares memory with kv_caches.latent\[0\]"),
}


def expanded_layer(model):
    """The second layer's cache ``expand``ed from one block: every block the same memory."""
    caches = fresh(model).latent
    return [caches[0], caches[1][:1].expand(caches[1].shape)]


ALIASED_DENSE["a layer whose blocks share memory"] = (
    expanded_layer, r"kv_caches.latent\[1\] must give every element memory of its own, got shape \(\w+, \w+, 40\) "
                    r"with strides \(0, 40, 1\)")  # traced: symbolic sizes


@pytest.mark.parametrize("case", list(ALIASED_DENSE))
def test_dense_cache_layers_that_share_memory_are_refused(case):
    make, match = ALIASED_DENSE[case]
    model = dense_model()
    refused_untouched(model, make(model), ValueError, match)


def index_inside_latent(caches):
    """Index caches that are views of the latent caches' memory."""
    index = []
    for latent, own in zip(caches.latent, caches.index):
        index.append(latent.view(-1).narrow(0, 0, own.numel()).view(own.shape))
    return dataclasses.replace(caches, index=index)


ALIASED_SPARSE = {
    "latent twice": (lambda c: dataclasses.replace(c, latent=[c.latent[0]] * 2),
                     r"kv_caches.latent\[1\] shares memory with kv_caches.latent\[0\]"),
    "index twice": (lambda c: dataclasses.replace(c, index=[c.index[1]] * 2),
                    r"kv_caches.index\[1\] shares memory with kv_caches.index\[0\]"),
    # every layer's pair overlaps; which is found first follows the addresses
    "index inside latent": (index_inside_latent, r"kv_caches.(index|latent)\[(\d)\] shares memory with "
                                                 r"kv_caches.(latent|index)\[\2\]"),
}


@pytest.mark.parametrize("case", list(ALIASED_SPARSE))
def test_sparse_cache_layers_that_share_memory_are_refused(case):
    change, match = ALIASED_SPARSE[case]
    model = sparse_model()
    refused_untouched(model, change(fresh(model)), ValueError, match)


def test_disjoint_views_of_one_buffer_stay_accepted():
    """A stacked tensor's layers, and per-layer views of one buffer that do not overlap, run as separate
    caches would (the same logits)."""
    model = dense_model()
    caches = fresh(model).latent
    expect = run_step(model, clone_caches(caches))
    assert torch.equal(run_step(model, torch.stack(caches)), expect)
    buffer = torch.stack(caches).flatten()
    views = [layer.view(caches[0].shape) for layer in buffer.chunk(len(caches))]
    assert torch.equal(run_step(model, views), expect)


def compiled_step(model, fullgraph=True, backend="eager"):
    """A whole-model ``torch.compile`` of ``run_step``'s step (the device plan), taking the caches."""
    torch._dynamo.reset()
    c = model.config
    ids, positions, slots, table, qsl, ctx = model_step(c, [0, 6], [7, 3], seed=1)
    options = mla_ops.PlanOptions(block_size=4, workspace_size=16, max_chunks=4)

    def step(caches):
        return model(ids, positions, caches, slots, mla_ops.plan_prefill(qsl, ctx, table, options=options))

    return torch.compile(step, backend=backend, fullgraph=fullgraph, dynamic=True)


def test_under_torch_compile_the_same_checks_name_the_caches():
    """A whole-model ``torch.compile(fullgraph=True)``: both refusals reach the user in our words, at trace time
    (nothing runs)."""
    model = dense_model()
    compiled = compiled_step(model)
    caches = fresh(model).latent
    with torch.no_grad():
        for bad, error, match in (([caches[0], caches[0]], ValueError,
                                   r"^kv_caches.latent\[1\] shares memory with kv_caches.latent\[0\]"),
                                  (as_dtype(caches, torch.float16), TypeError,
                                   r"^kv_caches.latent must have the model's dtype \(torch.float32\)")):
            before = clone_caches(bad)
            with pytest.raises(error, match=match):
                compiled(bad)
            assert caches_equal(bad, before)


def view_of_the_other(model):
    """The second layer's cache a view of the first's (``[c, c[:]]``)."""
    first = fresh(model).latent[0]
    return [first, first[:]]


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph-breaks"])
@pytest.mark.parametrize("case", [*ALIASED_DENSE, "a view of the other"])
def test_under_torch_compile_cache_layers_that_share_memory_are_refused(case, fullgraph):
    """Fake tensors keep their storage, offsets and strides: the memory spans are compared at trace time, as in
    eager code (a view of another layer's cache was taken, and its step's logits were wrong). Without ``fullgraph``
    the frame falls back to eager, which refuses. Nothing is written."""
    model = dense_model()
    make, match = ALIASED_DENSE.get(case) or (view_of_the_other,
                                              r"kv_caches.latent\[1\] shares memory with kv_caches.latent\[0\]")
    refused_untouched(model, make(model), ValueError, match, run=compiled_step(model, fullgraph))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_graph_compiled_for_separate_caches_refuses_aliasing_ones_at_run_time(backend):
    """torch's guards do not compare the storages of separate inputs, so a graph traced for separate caches runs
    again for ``[c, c[:]]``: the graph's own check (``mla_ops::check_disjoint_memory``, on the addresses) refuses
    them at each call, before anything is written; separate caches run on."""
    model = dense_model()
    compiled = compiled_step(model, backend=backend)
    caches = fresh(model).latent
    with torch.no_grad():
        expect = run_step(model, clone_caches(caches))
        torch.testing.assert_close(compiled(clone_caches(caches)), expect)
        refused_untouched(model, view_of_the_other(model), ValueError,
                          r"kv_caches.latent\[1\] shares memory with kv_caches.latent\[0\]", run=compiled)
        torch.testing.assert_close(compiled(clone_caches(caches)), expect)


def test_the_run_time_check_opchecks():
    a, b = torch.zeros(2, 3), torch.zeros(2, 3)
    torch.library.opcheck(torch.ops.mla_ops.check_disjoint_memory.default, ([a, b], "a,b", "why"))
    with pytest.raises(ValueError, match=r"^b shares memory with a: why"):
        torch.ops.mla_ops.check_disjoint_memory([a, a[1:]], "a,b", "why")


def test_under_torch_compile_disjoint_views_run_and_stay_guarded():
    """Per-layer views of one buffer that do not overlap compile and match eager; the graph is guarded on their
    staying apart: overlapping views of one buffer passed to it later are traced again, and refused."""
    model = dense_model()
    compiled = compiled_step(model)
    caches = fresh(model).latent
    views = list(torch.stack(caches).unbind())
    with torch.no_grad():
        torch.testing.assert_close(compiled(views), run_step(model, clone_caches(caches)))
    refused_untouched(model, overlapping_views(model), ValueError,
                      r"kv_caches.latent\[1\] shares memory with kv_caches.latent\[0\]", run=compiled)


def test_meta_caches_are_told_apart_by_storage():
    """Meta tensors have no addresses (every data_ptr is 0): separate meta caches are separate, views of one
    meta buffer that overlap are not."""
    from mla_ops.models.kv_caches import check_caches

    config = MLAConfig.from_name("tiny")
    width, model = config.kv_lora_rank + config.qk_rope_head_dim, (torch.float32, torch.device("meta"))
    separate = [torch.empty(4, 4, width, device="meta") for _ in range(2)]
    check_caches(separate, config, 2, model)
    buffer = torch.empty(5 * 4 * width, device="meta")
    overlapping = [buffer.narrow(0, start, 4 * 4 * width).view(4, 4, width) for start in (0, 4 * width)]
    with pytest.raises(ValueError, match=r"kv_caches.latent\[1\] shares memory with kv_caches.latent\[0\]"):
        check_caches(overlapping, config, 2, model)


@pytest.mark.parametrize("size, value, error, match", [
    ("block_size", 0, ValueError, r"block_size must be a positive int, got 0"),
    ("block_size", -1, ValueError, r"block_size must be a positive int, got -1"),
    ("block_size", True, TypeError, r"block_size must be an int, got bool True"),
    ("block_size", 2.0, TypeError, r"block_size must be an int, got float 2.0"),
    ("num_blocks", 2**31, ValueError, r"num_blocks must be at most 2\*\*31 - 1 .*got 2147483648"),
    ("num_blocks", 0, ValueError, r"num_blocks must be a positive int, got 0"),
    ("num_blocks", "4", TypeError, r"num_blocks must be an int, got str '4'"),
])
def test_allocate_kv_caches_checks_its_sizes_by_name(size, value, error, match):
    """Before anything is allocated (2**31 blocks on the meta device would otherwise pass)."""
    model = dense_model()
    sizes = {"num_blocks": 4, "block_size": 4, size: value}
    with pytest.raises(error, match=match):
        model.allocate_kv_caches(sizes["num_blocks"], sizes["block_size"], device="meta")
