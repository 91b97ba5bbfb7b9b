"""Serving a DeepSeek Sparse Attention model (DESIGN §12): ``PrefillGraphs`` in mode "compile" against the eager
model with a host plan (the outputs and both caches' writes), the bucket's chunk capacity holding the indexer's
chunks; ``Generator(compile=True)`` against eager generation, the caches growing with no recompile; on a GPU,
mode "cuda_graph" against the CPU.

The model: the tiny config with an indexer (``index_topk`` 8, 16 heads of 16) and GLM-5's layer kinds (full,
shared, full), so steps mix sparse requests (more than 8 keys), dense ones and the padding request, which a
bucket may make sparse.
"""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import mla_ops
from mla_ops.models.config import grouped, mla_configs
from tests.support.batches import cache_list, clone_caches, map_caches, model_step, normal_caches, spread_weights
from tests.support.gpu import needs_cuda

BLOCK_SIZE, WORKSPACE, NUM_BLOCKS = 4, 16, 64
SPARSE = dict(indexer=dict(index_topk=8, index_n_heads=16, index_head_dim=16),
              layer_kinds=dict(indexer_types=["full", "shared", "full"]))


def make_model(dtype=torch.float64):
    config = mla_ops.MLAConfig(**{**mla_configs["tiny"], "num_hidden_layers": 3, **SPARSE})
    return spread_weights(mla_ops.MLAForCausalLM(config).to(dtype).eval(), seed=0)


def random_caches(model, num_blocks=NUM_BLOCKS):
    return normal_caches(model.allocate_kv_caches(num_blocks, BLOCK_SIZE))


# (context_lens, query_lens): sparse (c + q > 8), dense (<= 8, absorbed or chunked) and mixed steps
STEPS = [([0], [13]), ([9], [1]), ([0, 3], [2, 4]), ([12, 0, 5], [1, 9, 2]), ([20, 6], [3, 1]), ([7, 30], [1, 2])]


def check_steps(runner, reference, caches, steps, stance="default"):
    for i, (context_lens, query_lens) in enumerate(steps):
        ids, positions, slots, table, qsl, ctx = model_step(reference.config, context_lens, query_lens, seed=i,
                                                            num_blocks=caches.num_blocks, block_size=BLOCK_SIZE,
                                                            max_blocks=12)
        expect_caches = clone_caches(caches)
        with torch.no_grad():
            plan = mla_ops.plan_prefill(qsl, ctx, table, BLOCK_SIZE, WORKSPACE, index_topk=8)
            expect = reference.model(ids, positions, expect_caches, slots, plan)
        with torch.compiler.set_stance(stance):
            out = runner(ids, positions, caches, slots, table, qsl, ctx)
        torch.testing.assert_close(out, expect, msg=lambda m: f"step {i} {context_lens} {query_lens}: {m}")
        torch.testing.assert_close(cache_list(caches), cache_list(expect_caches))


def test_compile_mode_serves_a_sparse_model_equal_to_eager():
    model = make_model()
    reference = copy.deepcopy(model)  # compile_layers compiles the runner's model in place
    runner = mla_ops.PrefillGraphs(model.model, max_tokens=32, max_requests=4, max_blocks_per_request=12,
                                   block_size=BLOCK_SIZE, workspace_size=WORKSPACE, mode="compile",
                                   compile_backend="aot_eager", chunk_buckets=(1, 2, 4, 8))
    assert runner.regional and runner.options.index_topk == 8  # the model's K_I
    caches = random_caches(model)
    graphs_before = counters["stats"]["unique_graphs"]
    check_steps(runner, reference, caches, STEPS[:1])
    graphs = counters["stats"]["unique_graphs"] - graphs_before
    check_steps(runner, reference, caches, STEPS[1:], stance="fail_on_recompile")
    grown = map_caches(lambda t: torch.cat([t, torch.randn_like(t[:16])]), caches)
    check_steps(runner, reference, grown, [([40, 2], [3, 9])], stance="fail_on_recompile")
    assert counters["stats"]["unique_graphs"] - graphs_before == graphs
    assert runner.stats["replays"] == len(STEPS) + 1


def test_a_bucket_holds_the_indexer_chunks_of_the_padded_step():
    model = make_model()
    runner = mla_ops.PrefillGraphs(model.model, max_tokens=32, max_requests=4, max_blocks_per_request=12,
                                   block_size=BLOCK_SIZE, workspace_size=WORKSPACE, mode="eager",
                                   chunk_buckets=(1, 2, 4, 8))
    # One token with 3 context keys (dense): the padding request takes 15 tokens of the 16-token bucket, a
    # sparse sequence of 15 keys; 4 dense requests of 9 context keys (chunked, 36 rows) need 3 chunks.
    assert runner._variant_for(*_host([3], [1])).chunks == 1
    assert runner._variant_for(*_host([30], [3])).chunks == 4  # sparse: 33 keys, 3 index chunks of 16 rows
    check_steps(runner, make_model(), random_caches(model), [([3], [1]), ([30], [3]), ([0, 0], [20, 9])])


def _host(context_lens, query_lens):
    import numpy as np

    return np.cumsum([0, *query_lens]).astype(np.int32), np.array(context_lens, np.int32)


def test_compiled_generation_equals_eager_with_no_recompile_as_the_cache_grows():
    model = make_model(torch.float32)
    g = torch.Generator().manual_seed(3)
    short = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (10, 5)]
    long = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (23, 14, 9)]
    eager = mla_ops.Generator(model, block_size=BLOCK_SIZE, workspace_size=WORKSPACE)
    expect_short, expect_long = eager.generate(short, 4), eager.generate(long, 4)
    torch._dynamo.reset()
    compiled = mla_ops.Generator(model, block_size=BLOCK_SIZE, workspace_size=WORKSPACE, compile=True)
    assert compiled.generate(short, 4) == expect_short
    blocks, graphs = compiled.kv_caches.num_blocks, counters["stats"]["unique_graphs"]
    with torch.compiler.set_stance("fail_on_recompile"):
        assert compiled.generate(long, 4) == expect_long
    assert compiled.kv_caches.num_blocks > blocks and counters["stats"]["unique_graphs"] == graphs
    usage = compiled.cache_usage
    assert usage.in_use == 0 and usage.cached + usage.free == usage.total


@pytest.mark.cuda
@needs_cuda
@torch.no_grad()
def test_cuda_graph_generation_equals_the_cpu():
    model = make_model(torch.float32)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (13, 4, 21)]
    prompts.append(prompts[2][:12] + [1])  # a shared prefix
    expect = mla_ops.Generator(model, block_size=BLOCK_SIZE, workspace_size=WORKSPACE).generate(prompts, 6)
    gpu = copy.deepcopy(model).cuda()
    assert mla_ops.Generator(gpu, block_size=BLOCK_SIZE, workspace_size=WORKSPACE).generate(prompts, 6) == expect
    torch._dynamo.reset()
    graphs = mla_ops.Generator(gpu, block_size=BLOCK_SIZE, workspace_size=WORKSPACE, num_blocks=64, compile=True)
    assert graphs.generate(prompts, 6) == expect
    assert graphs._runner.mode == "cuda_graph" and graphs._runner.stats["replays"] > 0


def test_compile_mode_serves_mistral_large4_layers_equal_to_eager():
    # Mistral Large 4's layer kinds: a NoPE layer (R = 0, L-wide latent rows) and a KV-sharing layer (no latent
    # cache of its own, layer 0's rows), with the learned query scale and RoPE frequencies.
    config = mla_ops.MLAConfig(**grouped({
        **mla_configs["tiny"], "num_hidden_layers": 3, "q_lora_rank": None, "index_topk": 8, "index_n_heads": 16,
        "index_head_dim": 16, "indexer_q_norm": True, "learned_query_scale": True, "learned_rope_frequencies": True,
        "no_rope_layers": [1, 0, 1], "kv_source_layers": [0, 1, 0], "indexer_types": ["full", "shared", "full"],
        "final_logit_softcapping": 30.0}))
    model = spread_weights(mla_ops.MLAForCausalLM(config).to(torch.float64).eval(), seed=0)
    reference = copy.deepcopy(model)
    runner = mla_ops.PrefillGraphs(model.model, max_tokens=32, max_requests=4, max_blocks_per_request=12,
                                   block_size=BLOCK_SIZE, workspace_size=WORKSPACE, mode="compile",
                                   compile_backend="aot_eager", chunk_buckets=(1, 2, 4, 8))
    caches = random_caches(model)
    assert len(caches.latent) == 2  # layer 2 shares layer 0's
    check_steps(runner, reference, caches, STEPS[:1])
    check_steps(runner, reference, caches, STEPS[1:], stance="fail_on_recompile")
