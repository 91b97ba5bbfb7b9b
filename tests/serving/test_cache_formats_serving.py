"""``Generator`` and ``PrefillGraphs`` serve a sparse model on vLLM's packed caches (DESIGN §12 "Production
cache formats") and on per-tensor float8 caches with their scales: the formats and scales reach every step.

The model: DeepSeek-V3.2's latent dims (fp8_ds_mla fixes L = 512, R = 64), everything else tiny
(tests/models/test_cache_formats_model.py).
"""

import pytest
import torch

import mla_ops
from tests.models.test_cache_formats_model import FORMATS, v32_like_model
from tests.support.batches import clone_caches, model_step

BLOCK_SIZE, WORKSPACE = 4, 8
PROMPTS = [list(range(3, 17)), list(range(20, 26)), [7] * 9]


@torch.no_grad()
def test_prefill_graphs_pass_the_formats_to_the_model():
    model = v32_like_model().double()  # float64: the padded bucket's rows quantize to the same bytes
    caches = model.allocate_kv_caches(32, BLOCK_SIZE, **FORMATS)
    runner = mla_ops.PrefillGraphs(model.model, max_tokens=32, max_requests=4, max_blocks_per_request=8,
                                   block_size=BLOCK_SIZE, workspace_size=WORKSPACE, mode="eager",
                                   chunk_buckets=(4, 16))
    for i, (context_lens, query_lens) in enumerate([([0, 0], [13, 5]), ([13, 5], [2, 3])]):
        ids, positions, slots, table, qsl, ctx = model_step(model.config, context_lens, query_lens, seed=0,
                                                            num_blocks=32, block_size=BLOCK_SIZE, max_blocks=8)
        expect_caches = clone_caches(caches)
        plan = mla_ops.plan_prefill(qsl, ctx, table, BLOCK_SIZE, WORKSPACE, index_topk=4)
        expect = model.model(ids, positions, expect_caches, slots, plan)
        got = runner(ids, positions, caches, slots, table, qsl, ctx)
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
        for a, b in zip((*caches.latent, *caches.index), (*expect_caches.latent, *expect_caches.index)):
            assert a.dtype == torch.uint8 and torch.equal(a, b)


def test_generator_allocates_and_serves_the_packed_formats():
    model = v32_like_model()
    eager = mla_ops.Generator(model, block_size=BLOCK_SIZE, workspace_size=WORKSPACE, **FORMATS)
    tokens = eager.generate(PROMPTS, 3)
    latent, index = eager.kv_caches.latent, eager.kv_caches.index
    assert latent[0].dtype == torch.uint8 and latent[0].shape[-1] == 656 and latent[0].any()
    assert index[0].dtype == torch.uint8 and index[0].shape[-1] == 128 + 4 and index[0].any()  # D_I + a scale
    compiled = mla_ops.Generator(model, block_size=BLOCK_SIZE, workspace_size=WORKSPACE, compile=True, **FORMATS)
    assert compiled.generate(PROMPTS, 3) == tokens


def test_generator_takes_a_float8_caches_scales():
    model = v32_like_model()
    gen = mla_ops.Generator(model, block_size=BLOCK_SIZE, workspace_size=WORKSPACE, cache_dtype=torch.float8_e4m3fn,
                            k_scale=0.05, k_scale_index=0.05)
    gen.generate(PROMPTS[:1], 2)
    assert all(t.dtype == torch.float8_e4m3fn for t in (*gen.kv_caches.latent, *gen.kv_caches.index))


@pytest.mark.parametrize("kwargs, match", [
    (dict(cache_dtype=torch.float8_e4m3fn), "needs k_scale"),
    (dict(cache_dtype=torch.float8_e4m3fn, k_scale=1.0), "needs k_scale_index"),
    (dict(kv_cache_format="fp8_ds_mla", k_scale=1.0), "stores its own scales"),
    (dict(kv_cache_format="fp8"), "kv_cache_format must be one of"),
])
def test_generator_refuses_cache_settings_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mla_ops.Generator(v32_like_model(), **kwargs)
