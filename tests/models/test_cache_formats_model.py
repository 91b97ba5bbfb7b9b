"""A sparse (DSA) model on vLLM's packed caches (DESIGN §12 "Production cache formats"): ``allocate_kv_caches``
takes ``kv_cache_format`` / ``index_cache_format`` and its ``KVCaches`` carries them to ``forward``; every layer
writes its new rows in them and reads its context back from them.

The oracle: the same step on float caches holding the packed caches' values, dequantized (the formats'
rounding is the only difference a packed cache makes, and it happens when a row is written).
"""

from dataclasses import replace

import pytest
import torch

import mla_ops
from mla_ops.models.config import mla_configs
from mla_ops.ops.cache_formats import ds_mla_values, per_token_views
from tests.support.families import step_inputs

# DeepSeek-V3.2's latent dims (fp8_ds_mla fixes them), everything else tiny.
CONFIG = dict(hidden_size=64, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=16,
              qk_rope_head_dim=64, v_head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, intermediate_size=64,
              num_hidden_layers=2, vocab_size=64, indexer=dict(index_topk=4, index_n_heads=2, index_head_dim=128))
FORMATS = dict(kv_cache_format="fp8_ds_mla", index_cache_format="fp8_per_token")


@torch.no_grad()
def v32_like_model(seed=0):
    config = mla_ops.MLAConfig(**{**mla_configs["tiny"], **CONFIG})
    torch.manual_seed(seed)
    model = mla_ops.MLAForCausalLM(config).eval()
    for p in model.parameters():
        p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5 * 1.5 if p.dim() >= 2 else 1 + 0.3 * torch.randn(p.shape))
    return model


def dequantized(caches: mla_ops.KVCaches) -> mla_ops.KVCaches:
    """Float32 caches holding the packed caches' values (fp8_ds_mla rows, fp8_per_token keys)."""
    def index_values(cache):
        codes, scale_bytes = per_token_views(cache)
        return codes.view(torch.float8_e4m3fn).float() * scale_bytes.contiguous().view(torch.float32)

    return mla_ops.KVCaches([ds_mla_values(c) for c in caches.latent], [index_values(c) for c in caches.index])


def run(model, caches, prompts, starts):
    ids, positions, slots, table, qsl, ctx = step_inputs(prompts, starts, block_size=4, max_blocks=8)
    plan = mla_ops.plan_prefill(qsl, ctx, table, 4, workspace_size=8, index_topk=4)
    return model(ids, positions, caches, slots, plan)


@torch.no_grad()
def test_a_sparse_model_writes_and_reads_both_packed_formats():
    model = v32_like_model()
    caches = model.allocate_kv_caches(16, 4, **FORMATS)
    assert caches.latent[0].dtype == torch.uint8 and caches.latent[0].shape == (16, 4, 656)
    assert caches.index[0].dtype == torch.uint8 and caches.index[0].shape == (16, 4, 132)
    prompts = [list(range(3, 14)), list(range(20, 27))]
    run(model, caches, prompts, [0, 0])  # the prompts' first tokens: written in the packed formats
    assert all(c.any() for c in (*caches.latent, *caches.index))
    floats = dequantized(caches)
    prompts = [p + [5, 6, 7] for p in prompts]
    starts = [11, 7]  # the rest attends its context, read back from the caches (top-k 4 < the context: sparse)
    got = run(model, caches, prompts, starts)
    want = run(model, floats, prompts, starts)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_formats_a_model_cannot_hold_are_refused_by_name():
    dense = mla_ops.MLAForCausalLM(mla_ops.MLAConfig.from_name("tiny"))
    with pytest.raises(ValueError, match="fp8_ds_mla' holds kv_lora_rank 512 and qk_rope_head_dim 64"):
        dense.allocate_kv_caches(4, 4, kv_cache_format="fp8_ds_mla")
    with pytest.raises(ValueError, match="is for a sparse"):
        dense.allocate_kv_caches(4, 4, index_cache_format="fp8_per_token")
    with pytest.raises(ValueError, match="kv_cache_format must be one of"):
        dense.allocate_kv_caches(4, 4, kv_cache_format="fp8")
    narrow = mla_ops.MLAForCausalLM(mla_ops.MLAConfig(**{**mla_configs["tiny"], **CONFIG, "indexer": dict(
        CONFIG["indexer"], index_head_dim=64)}))  # vLLM's layout: a float32 scale per 128 values
    with pytest.raises(ValueError, match="fp8_per_token' needs index_head_dim a multiple of 128, got 64"):
        narrow.allocate_kv_caches(4, 4, index_cache_format="fp8_per_token")
    model = v32_like_model()
    packed = model.allocate_kv_caches(4, 4, **FORMATS)
    with pytest.raises(ValueError, match=r"kv_caches.latent\[0\] must be \[num_blocks, block_size, 576\]"):
        run(model, replace(packed, kv_cache_format="auto"), [[1, 2, 3]], [0])  # packed caches without their formats
