"""Regional compilation (``MLAModel.compile_layers``) in normal use: dtype casts, grad and inference
modes, dense and MoE layers, steps of 0, 1 and many tokens. Each combination compiles its regions
once, none meets torch's recompile limit, and every step equals the eager model's."""

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import mla_ops
from tests.support.batches import cache_list, clone_caches, model_step

# Tiny with a mixture of experts after the first layer: dense and MoE layers share one model.
MOE = dataclasses.replace(mla_ops.MLAConfig.from_name("tiny"), num_hidden_layers=3, first_k_dense_replace=1,
                          n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)
MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "grad": torch.enable_grad}
STEPS = [([5, 0], [3, 4]), ([0], [0]), ([7], [1]), ([2, 9, 0], [2, 5, 6])]  # 7, 0, 1 and 13 tokens


def run_step(model, caches, lens, seed):
    context_lens, query_lens = lens
    num_blocks, block_size = caches.latent[0].shape[:2]
    ids, positions, slots, table, qsl, ctx = model_step(MOE, context_lens, query_lens, seed, num_blocks=num_blocks)
    plan = mla_ops.plan_prefill(qsl, ctx, table, block_size, 8, absorb_max_query_len=0)
    return model(ids, positions, caches, slots, plan)


def test_casts_modes_and_step_sizes_never_meet_the_recompile_limit():
    torch.manual_seed(0)
    eager = mla_ops.MLAModel(MOE).eval()
    model = mla_ops.MLAModel(MOE).eval()
    model.load_state_dict(eager.state_dict())
    counter = CompileCounter()
    model.compile_layers(backend=counter)
    regions = model.compiled_regions
    combinations = 0
    with torch._dynamo.config.patch(recompile_limit=2):  # one graph per region and combination fits in 2
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            eager.to(dtype), model.to(dtype)
            for mode, context in MODES.items():
                combinations += 1
                caches = model.allocate_kv_caches(64, 4)
                eager_caches = clone_caches(caches)
                for i, lens in enumerate(STEPS):
                    with context():
                        out = run_step(model, caches, lens, seed=i)
                        expect = run_step(eager, eager_caches, lens, seed=i)
                    assert out.shape == expect.shape
                    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
                    torch.testing.assert_close(out, expect, rtol=tol, atol=tol, msg=f"{dtype} {mode} {lens}")
                    torch.testing.assert_close(cache_list(caches), cache_list(eager_caches), rtol=tol, atol=tol)
    # Per combination: the projections once, the MLPs once per kind (dense, MoE; its shared experts inline).
    assert counter.frame_count == 3 * combinations
    assert len(regions[0].compiled) == combinations and len(regions[1].compiled) == 2 * combinations
    frames = counter.frame_count
    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):  # steps of every size reuse them
        for i, lens in enumerate([([3], [0]), ([0], [1]), ([4, 4], [9, 2])]):
            run_step(model, model.allocate_kv_caches(64, 4), lens, seed=10 + i)
    assert counter.frame_count == frames


def test_compile_layers_again_with_the_same_options_keeps_the_regions():
    model = mla_ops.MLAModel(MOE).eval()
    counter = CompileCounter()
    regions = model.compile_layers(backend=counter).compiled_regions
    assert model.compile_layers(backend=counter).compiled_regions is regions
    assert model.compile_layers(backend="eager").compiled_regions is not regions


@pytest.mark.parametrize("options, error, message", [
    (dict(mode="bogus"), ValueError, "compile_layers: Unrecognized mode=bogus"),
    (dict(backend="no_such_backend"), ValueError, "compile_layers: Invalid backend: 'no_such_backend'"),
    (dict(options={"no_such_option": 1}), ValueError, "compile_layers: Unexpected optimization option no_such_option"),
    (dict(bogus=1), TypeError, "compile_layers: .*unexpected keyword argument 'bogus'"),
])
def test_compile_layers_refuses_what_torch_compile_refuses_and_changes_nothing(options, error, message):
    model = mla_ops.MLAModel(MOE).eval().compile_layers(backend="eager")
    regions, projections = model.compiled_regions, [layer.self_attn.project for layer in model.layers]
    with pytest.raises(error, match=message):
        model.compile_layers(**options)
    assert model.compiled_regions is regions and [layer.self_attn.project for layer in model.layers] == projections
    fresh = mla_ops.MLAModel(MOE).eval()
    with pytest.raises(error, match=message):
        fresh.compile_layers(**options)
    assert getattr(fresh, "compiled_regions", None) is None and all("project" not in vars(layer.self_attn)
                                                                     for layer in fresh.layers)


@pytest.mark.parametrize("num_tokens", [0, 1])
def test_a_step_under_two_tokens_runs_padded(num_tokens):
    model = mla_ops.MLAModel(MOE).eval().compile_layers(backend=CompileCounter())
    with torch.no_grad():
        out = run_step(model, model.allocate_kv_caches(64, 4), ([3], [num_tokens]), seed=0)
    assert out.shape == (num_tokens, MOE.hidden_size)
