"""DeepSeek's MoE feed-forward (mla_ops.moe) against transformers' DeepSeek-V2/V3 routers and MoE blocks.

x [T, H]   gate -> weights [T, k], indices [T, k]   experts.gate_up_proj [E, 2I, H]   down_proj [E, H, I]
"""

import pytest
import torch

from mla_ops.models.config import MLAConfig
from mla_ops.models.moe import MoE, MoEGate
from tests.support.hf_checkpoints import hf_config

HF_MOE = {"v2": "DeepseekV2Moe", "v2-group": "DeepseekV2Moe", "v3": "DeepseekV3MoE"}
V3_STYLE = dict(hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=16, v_head_dim=16, rope_theta=1e4, rms_norm_eps=1e-6, intermediate_size=96,
                num_hidden_layers=2, vocab_size=96, n_routed_experts=16, num_experts_per_tok=4,
                moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, scoring_func="sigmoid",
                topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)


def hf_moe(kind, seed=0):
    """transformers' MoE block with spread weights (and a random score-correction bias for V3)."""
    transformers = pytest.importorskip("transformers")
    config = hf_config(kind)
    module = {"v3": transformers.models.deepseek_v3.modeling_deepseek_v3,
              "v2": transformers.models.deepseek_v2.modeling_deepseek_v2}[kind[:2]]
    torch.manual_seed(seed)
    block = getattr(module, HF_MOE[kind])(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for name, b in block.named_buffers():
            b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return config, block


def ours(config, block, impl="auto"):
    moe = MoE(MLAConfig.from_hf(config.to_dict()), impl=impl).eval()
    moe.load_state_dict(block.state_dict(), strict=True)  # transformers 5's in-memory names are ours
    return moe


def inputs(config, tokens=37, seed=3):
    return torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["v2", "v2-group", "v3"])
@torch.no_grad()
def test_gate_picks_transformers_experts_and_weights(kind):
    config, block = hf_moe(kind)
    gate = ours(config, block).gate
    x = inputs(config)
    _, hf_weights, hf_indices = block.gate(x)
    weights, indices = gate(x)
    order, hf_order = indices.argsort(-1), hf_indices.argsort(-1)
    assert torch.equal(indices.gather(1, order), hf_indices.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=1e-6, atol=1e-7)
    assert weights.dtype == torch.float32


@pytest.mark.parametrize("impl", ["dense", "grouped"])
@pytest.mark.parametrize("kind", ["v2", "v3"])
@torch.no_grad()
def test_moe_block_matches_transformers(kind, impl):
    config, block = hf_moe(kind)
    moe = ours(config, block, impl)
    x = inputs(config)
    torch.testing.assert_close(moe(x), block(x[None])[0], rtol=1e-5, atol=1e-5)


def test_softmax_gate_with_norm_topk_prob_normalises_as_deepseek_does():
    """DeepSeek's V2 code: with norm_topk_prob (k > 1) the top-k weights sum to 1, unscaled."""
    pytest.importorskip("transformers")
    config = MLAConfig.from_hf(dict(hf_config("v2").to_dict(), norm_topk_prob=True, routed_scaling_factor=16.0))
    gate = MoEGate(config)
    x = torch.randn(9, config.hidden_size)
    weights, indices = gate(x)
    scores = (x @ gate.weight.T).softmax(-1)
    top = scores.topk(config.num_experts_per_tok, -1)
    torch.testing.assert_close(weights.sort(-1).values, (top.values / top.values.sum(-1, keepdim=True)).sort(-1).values)
    assert torch.equal(indices.sort(-1).values, top.indices.sort(-1).values)


@torch.no_grad()
def test_grouped_moe_compiles_without_host_sync_or_recompiles():
    """bfloat16 (the grouped-GEMM path) under fullgraph compile: one graph for every token count."""
    config, block = hf_moe("v3")
    moe = ours(config, block, "grouped").to(torch.bfloat16)
    moe.gate.float()
    torch._dynamo.reset()
    compiled = torch.compile(moe, fullgraph=True, dynamic=True)
    for i, tokens in enumerate((6, 23, 9)):
        x = inputs(config, tokens, seed=i).to(torch.bfloat16)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out = compiled(x)
        torch.testing.assert_close(out.float(), moe(x).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
def test_grouped_moe_on_cuda_compiles_and_captures():
    """bfloat16 grouped GEMMs on the GPU: eager, compiled and replayed from a CUDA graph, against the
    float32 dense form on the CPU."""
    torch.manual_seed(0)
    moe = MoE(MLAConfig(**V3_STYLE), impl="grouped").eval()
    with torch.no_grad():
        for p in moe.experts.parameters():
            p.normal_(std=p.shape[-1] ** -0.5)
        moe.gate.e_score_correction_bias.normal_(std=0.1)
    reference = MoE(MLAConfig(**V3_STYLE), impl="dense").eval()
    reference.load_state_dict(moe.state_dict())
    gpu = moe.to("cuda", torch.bfloat16)
    gpu.gate.float()
    x = torch.randn(37, 64, device="cuda", dtype=torch.bfloat16)
    expect = reference(x.float().cpu())
    # bfloat16 rounding can flip a near-tie in the router: compare the tokens whose experts agree.
    same = (gpu.gate(x)[1].sort(-1).values.cpu() == reference.gate(x.float().cpu())[1].sort(-1).values).all(-1)
    assert same.float().mean() > 0.8
    check = lambda out: torch.testing.assert_close(out.float().cpu()[same], expect[same], rtol=5e-2, atol=5e-2)  # noqa: E731
    check(gpu(x))
    torch._dynamo.reset()
    check(torch.compile(gpu, fullgraph=True, dynamic=False)(x))
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gpu(static)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gpu(static)
    static.copy_(torch.randn(37, 64, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(out, gpu(static), rtol=1e-2, atol=1e-2)  # index_add_ adds atomically


def test_config_rejects_impossible_routing():
    pytest.importorskip("transformers")
    base = hf_config("v3").to_dict()
    with pytest.raises(ValueError, match="n_group"):
        MLAConfig.from_hf(dict(base, n_group=3))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MLAConfig.from_hf(dict(base, num_experts_per_tok=9))
    with pytest.raises(ValueError, match="topk_group"):
        MLAConfig.from_hf(dict(base, topk_group=1, num_experts_per_tok=3))
    with pytest.raises(ValueError, match="scoring_func"):
        MLAConfig.from_hf(dict(base, scoring_func="relu"))
    with pytest.raises(ValueError, match="impl"):
        MoE(MLAConfig.from_hf(base), impl="fast")
