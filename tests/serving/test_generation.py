"""Generation on a GPU against the CPU, eager and compiled. (The block bookkeeping:
test_paged_cache.py; greedy tokens against transformers: tests/models/test_hf.py.)"""

import copy

import pytest
import torch

import mla_ops
from mla_ops.models.config import MLAConfig
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
