"""Generation: on a GPU against the CPU, eager and compiled; with prefix caching against a full
recompute on the CPU (across calls, eviction and weight edits). (The block bookkeeping:
test_paged_cache.py; greedy tokens against transformers: tests/models/test_hf.py.)"""

import copy

import pytest
import torch

import mla_ops
from mla_ops.models.config import MLAConfig
from tests.support.batches import tiny_model
from tests.support.gpu import needs_cuda


@pytest.mark.cuda
@needs_cuda
@torch.no_grad()
def test_generation_on_cuda_equals_cpu_eager_and_compiled():
    """float32 (MoE dense on CUDA), Triton kernels, prefix sharing, a deferred prompt, YaRN."""
    config = MLAConfig(
        hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, rope_theta=1e4, rms_norm_eps=1e-6, intermediate_size=96,
        num_hidden_layers=2, vocab_size=96, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4,
        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_scaling=dict(type="yarn", factor=4, original_max_position_embeddings=32, mscale=1, mscale_all_dim=1),
    )
    torch.manual_seed(0)
    model = mla_ops.MLAForCausalLM(config).eval()
    for p in model.parameters():
        p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5 * 1.5 if p.dim() >= 2 else 1 + 0.3 * torch.randn(p.shape))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (9, 3, 14)]
    prompts.append(prompts[2][:9] + [1])
    expect = mla_ops.Generator(model, block_size=4).generate(prompts, 6)
    gpu = copy.deepcopy(model).cuda()
    assert mla_ops.Generator(gpu, block_size=4).generate(prompts, 6) == expect
    torch._dynamo.reset()
    assert mla_ops.Generator(gpu, block_size=4, compile=True).generate(prompts, 6) == expect


# ---- prefix caching gives the tokens of a full recompute (CPU, the tiny model) --------------------


def shared_prompts(seed: int = 1):
    """Three prompts for block size 4: two share 2 full blocks, one shares none; and two others."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    base = draw(12)
    return [base + [1, 2], base[:9] + [7], draw(10)], [draw(13), draw(11)]


def recompute(model, prompts, n):
    """The reference: a fresh Generator, nothing cached, nothing shared."""
    return mla_ops.Generator(model, block_size=4, prefix_caching=False).generate(prompts, n)


def test_prefix_caching_equals_recompute_across_calls_and_eviction(one_thread):
    model = tiny_model()
    a, b = shared_prompts()
    expect_a, expect_b = recompute(model, a, 5), recompute(model, b, 5)
    assert len({tuple(t) for t in expect_a + expect_b}) == 5  # distinct outputs: a mix-up would show

    roomy = mla_ops.Generator(model, block_size=4, num_blocks=64)  # room for everything: no eviction
    uncached = mla_ops.Generator(model, block_size=4, prefix_caching=False)
    hits = []
    for prompts, expect in ((a, expect_a), (a, expect_a), (b, expect_b), (a, expect_a)):
        assert roomy.generate(prompts, 5) == expect
        assert uncached.generate(prompts, 5) == expect and uncached.stats.cached_tokens == 0
        hits.append(roomy.stats.cached_tokens)
    # First call: prompt 1 reuses prompt 0's 2 blocks; later: every full block but the last token's.
    assert hits == [8, 12 + 8 + 8, 0, 28]

    # 12 blocks: a call of a takes 11, the b call between evicts part of what a left cached.
    small = mla_ops.Generator(model, block_size=4, num_blocks=12)
    hits = []
    for prompts, expect in ((a, expect_a), (b, expect_b), (a, expect_a), (a, expect_a)):
        assert small.generate(prompts, 5) == expect
        assert small.manager.num_available == 12  # every block released after the call
        hits.append(small.stats.cached_tokens)
    assert hits[:2] == [8, 0] and 0 < hits[2] < 28 and hits[3] == 28  # evicted prefixes recomputed, then cached


def test_prefix_caching_equals_recompute_after_an_in_place_weight_edit(one_thread):
    model = tiny_model()
    a, _ = shared_prompts()
    generator = mla_ops.Generator(model, block_size=4)
    before = generator.generate(a, 5)
    assert generator.generate(a, 5) == before and generator.stats.cached_tokens > 0
    with torch.no_grad():
        model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.mul_(1.5)  # the cached rows are stale now
    expect = recompute(model, a, 5)
    assert expect != before  # the edit changes the tokens: stale rows could not pass unnoticed
    assert generator.generate(a, 5) == expect
    assert generator.stats.cached_tokens == 8  # the index was cleared: only this call's own sharing
    assert generator.generate(a, 5) == expect and generator.stats.cached_tokens == 28
    assert mla_ops.generate(model, a, 5, block_size=4) == expect  # the per-model Generator of generate()
    with torch.no_grad():
        model.lm_head.weight.add_(0.0)  # a write without a change still clears it (the version moved)
    assert mla_ops.generate(model, a, 5, block_size=4) == expect


# ---- the planning options: options= or the loose keywords ---------------------------------------


def test_the_routing_options_reach_every_step_plan(one_thread, monkeypatch):
    """absorb_max_query_len / max_absorbed_tokens (loose or in options=) plan every eager step; the
    tokens are the same whichever path a request takes."""
    from mla_ops.serving import generation

    model = tiny_model()
    a, _ = shared_prompts()
    expect = recompute(model, a, 4)
    plans = []
    real = generation.plan_with_options
    monkeypatch.setattr(generation, "plan_with_options", lambda *args: plans.append(real(*args)) or plans[-1])

    assert mla_ops.Generator(model, block_size=4).generate(a, 4) == expect
    assert all(p.absorbed_token_loc is not None for p in plans[1:])  # decode steps: one token and a context
    for generator in (mla_ops.Generator(model, block_size=4, absorb_max_query_len=0),
                      mla_ops.Generator(model, options=mla_ops.PlanOptions(4, absorb_max_query_len=0)),
                      mla_ops.Generator(model, block_size=4, max_absorbed_tokens=0)):
        plans.clear()
        assert generator.generate(a, 4) == expect
        assert plans and all(p.absorbed_token_loc is None for p in plans)  # every request took the chunk loop
    plans.clear()
    whole = mla_ops.PlanOptions(4, workspace_size=8, policy="whole_requests", split_alignment=4)
    assert mla_ops.Generator(model, options=whole).generate(a, 4) == expect
    assert {(p.workspace_size, p.block_size) for p in plans} == {(8, 4)}


def test_generate_keeps_its_generator_while_the_options_are_equal(one_thread):
    from mla_ops.serving import generation

    model = tiny_model()
    a, _ = shared_prompts()
    expect = recompute(model, a, 3)
    assert mla_ops.generate(model, a, 3, block_size=4) == expect
    kept = generation._generators[model]
    assert kept.settings.options == mla_ops.PlanOptions(4)
    assert mla_ops.generate(model, a, 3, options=mla_ops.PlanOptions(block_size=4)) == expect
    assert generation._generators[model] is kept  # the same options, spelled differently
    assert mla_ops.generate(model, a, 3, block_size=4, absorb_max_query_len=0) == expect
    replaced = generation._generators[model]
    assert replaced is not kept and replaced.options.absorb_max_query_len == 0


def test_compiled_generation_takes_the_routing_options(one_thread):
    """compile=True: PrefillGraphs plans the packed device form with the Generator's routing."""
    model = tiny_model()
    a, _ = shared_prompts()
    expect = recompute(model, a, 3)
    torch._dynamo.reset()
    compiled = mla_ops.Generator(model, block_size=4, absorb_max_query_len=0, max_absorbed_tokens=2, compile=True)
    assert compiled.generate(a, 3) == expect
    options = compiled._runner.options
    assert (options.absorb_max_query_len, options.max_absorbed_tokens, options.block_size) == (0, 2, 4)
    assert options.device_form and options.policy == "packed"
