"""The MLA layer and model (mla_ops/models/decoder.py): MLAAttention against a dense float64 layer,
prefill in steps, the presets, and calls rejected before the cache is written.

kv_cache [num_blocks, block_size, L+R]   slot_mapping [T] (negative = padding)
hidden [T, H]   positions [T]   block_table [B, max_blocks] int32   query_start_loc [B+1]   context_lens [B]

The layer is checked against a dense float64 computation written here from DeepSeek-V2's
attention: projections, RMSNorms, NeoX rotary, one masked softmax per request over
[cached context rows | new rows] (causal on the new part), o_proj.
"""

import math
from dataclasses import replace

import pytest
import torch

import mla_ops
from mla_ops import MLAAttention, MLAConfig, MLAModel
from mla_ops.models.kv_caches import grown
from mla_ops.models.layer import AttentionCaches, ModelStep
from mla_ops.models.rope import RotaryEmbedding
from tests.support.batches import (
    cache_list, caches_equal, clone_caches, normal_caches, paged_block_table, spread_weights,
)


# ---- paged batches ------------------------------------------------------------------------


def block_table_for(total_lens, block_size, *, seed, spare_blocks=3):
    """Shuffled blocks for requests of total_lens tokens; one extra (valid) column per row."""
    g = torch.Generator().manual_seed(seed)
    return paged_block_table([math.ceil(n / block_size) for n in total_lens], g, spare_blocks=spare_blocks,
                             pad_cols=1)


def step_inputs(block_table, context_lens, query_lens, block_size):
    """positions [T], slot_mapping [T] int64, query_start_loc [B+1], context_lens [B] for one step."""
    positions, slots = [], []
    for r, (c, q) in enumerate(zip(context_lens, query_lens)):
        for p in range(c, c + q):
            positions.append(p)
            slots.append(int(block_table[r, p // block_size]) * block_size + p % block_size)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    return (torch.tensor(positions), torch.tensor(slots), qsl, torch.tensor(context_lens, dtype=torch.int32))


# ---- MLAAttention against a dense computation ------------------------------------------------


def rms_norm(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def neox_rope(x, positions, theta):
    """x [T, ..., R] rotated by angle pos * theta^(-2i/R) on pairs (i, i + R/2)."""
    R = x.shape[-1]
    angle = positions.double()[:, None] * theta ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)  # [T, R/2]
    cos, sin = angle.cos(), angle.sin()
    while cos.dim() < x.dim():
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., : R // 2], x[..., R // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def dense_attention_layer(attn, config, hidden, positions, cache_before, block_table, qsl, ctx):
    """float64 output [T, H], and the new tokens' latent rows [T, L+R] the layer must cache."""
    N, L, P, R, V = (config.num_attention_heads, config.kv_lora_rank, config.qk_nope_head_dim,
                     config.qk_rope_head_dim, config.v_head_dim)
    w = {name: p.detach().double() for name, p in attn.named_parameters()}
    eps, x, T = config.rms_norm_eps, hidden.double(), hidden.shape[0]
    if config.q_lora_rank is None:
        q = x @ w["q_proj.weight"].T
    else:
        q = rms_norm(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], eps) @ w["q_b_proj.weight"].T
    q = q.view(T, N, P + R)
    q = torch.cat([q[..., :P], neox_rope(q[..., P:], positions, config.rope_theta)], dim=-1)
    compressed = x @ w["kv_a_proj_with_mqa.weight"].T  # [T, L+R]
    kv_c = rms_norm(compressed[:, :L], w["kv_a_layernorm.weight"], eps)
    k_pe = neox_rope(compressed[:, L:], positions, config.rope_theta)

    block_size = cache_before.shape[1]
    out = torch.zeros(T, N, V, dtype=torch.float64)
    for r, c in enumerate(ctx.tolist()):
        s, e = int(qsl[r]), int(qsl[r + 1])
        p = torch.arange(c)
        cached = cache_before[block_table[r].long()[p // block_size], p % block_size].double()  # [c, L+R]
        latent = torch.cat([cached[:, :L], kv_c[s:e]])  # [c + q_r, L]
        rope = torch.cat([cached[:, L:], k_pe[s:e]])  # [c + q_r, R]
        kv = (latent @ w["kv_b_proj.weight"].T).view(-1, N, P + V)
        k = torch.cat([kv[..., :P], rope[:, None, :].expand(-1, N, R)], dim=-1)  # [S, N, P+R]
        scores = torch.einsum("qnd,knd->nqk", q[s:e], k) / math.sqrt(P + R)
        i, j = torch.arange(e - s)[:, None], torch.arange(c + e - s)[None, :]
        scores = scores.masked_fill(~((j < c) | (j - c <= i)), -math.inf)
        out[s:e] = torch.einsum("nqk,knv->qnv", scores.softmax(-1), kv[..., P:])
    return out.reshape(T, N * V) @ w["o_proj.weight"].T, torch.cat([kv_c, k_pe], dim=-1)


@pytest.mark.parametrize("q_lora,planning", [(True, "host"), (False, "host"), (True, "whole_requests"), (True, "device")])
def test_attention_matches_dense_layer(q_lora, planning):
    config = MLAConfig.from_name("tiny")
    if not q_lora:
        config = replace(config, q_lora_rank=None)
    torch.manual_seed(0)
    attn = spread_weights(MLAAttention(config).double(), seed=1)
    block_size, workspace = 4, 8
    ctx, qlens = [0, 13, 5, 0], [3, 4, 2, 2]  # request 1's context exceeds the workspace
    num_blocks, table = block_table_for([c + q for c, q in zip(ctx, qlens)], block_size, seed=2)
    positions, slots, qsl, ctx_t = step_inputs(table, ctx, qlens, block_size)
    g = torch.Generator().manual_seed(3)
    L_R = config.kv_lora_rank + config.qk_rope_head_dim
    kv_cache = torch.randn(num_blocks, block_size, L_R, generator=g, dtype=torch.float64)
    hidden = torch.randn(len(positions), config.hidden_size, generator=g, dtype=torch.float64)
    cache_before = kv_cache.clone()

    expect, new_rows = dense_attention_layer(attn, config, hidden, positions, cache_before, table, qsl, ctx_t)
    options = {
        "host": {},
        "whole_requests": {"policy": "whole_requests"},
        "device": {"max_chunks": math.ceil(sum(ctx) / workspace)},
    }[planning]
    plan = mla_ops.plan_prefill(qsl, ctx_t, table, block_size, workspace, absorb_max_query_len=0, **options)
    with torch.no_grad():
        cos, sin = RotaryEmbedding(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling)(positions,
                                                                                                   torch.float64)
        step = ModelStep(cos, sin, mla_ops.begin_step(plan, kv_cache, slots, backend="torch"))
        caches = (AttentionCaches(kv_cache),)
        out, made = attn(hidden, caches[0], step)
        step.write(caches, made)

    assert out.shape == hidden.shape and out.dtype == torch.float64
    err = (out - expect).abs().max().item() / max(1.0, expect.abs().max().item())
    assert err < 1e-10, f"max rel diff {err:.3e}"
    flat_after, flat_before = kv_cache.view(-1, L_R), cache_before.view(-1, L_R)
    torch.testing.assert_close(flat_after[slots], new_rows, rtol=0, atol=1e-12)
    untouched = torch.ones(flat_after.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_after[untouched], flat_before[untouched])


def test_two_step_prefill_equals_one_prefill():
    config = MLAConfig.from_name("tiny")
    torch.manual_seed(0)
    model = spread_weights(MLAModel(config).double(), seed=4)
    block_size, workspace = 4, 4
    prompt_lens, first = [11, 7], [6, 3]
    second = [n - f for n, f in zip(prompt_lens, first)]
    num_blocks, table = block_table_for(prompt_lens, block_size, seed=5)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in prompt_lens]

    def run(kv_caches, ctx, qlens, **kwargs):
        positions, slots, qsl, ctx_t = step_inputs(table, ctx, qlens, block_size)
        ids = torch.cat([p[c : c + q] for p, c, q in zip(prompts, ctx, qlens)])
        plan = mla_ops.plan_prefill(qsl, ctx_t, table, block_size, workspace, **kwargs)  # one plan, every layer
        with torch.no_grad():
            return model(ids, positions, kv_caches, slots, plan, backend="torch")

    one_caches = model.allocate_kv_caches(num_blocks, block_size)
    one = run(one_caches, [0, 0], prompt_lens)

    two_caches = model.allocate_kv_caches(num_blocks, block_size)
    step1 = run(two_caches, [0, 0], first)
    step2 = run(two_caches, first, second, absorb_max_query_len=0)

    split = lambda x, lens: x.split(lens)  # noqa: E731
    one_parts = split(one, prompt_lens)
    got = torch.cat([torch.cat([a, b]) for a, b in zip(split(step1, first), split(step2, second))])
    expect = torch.cat(one_parts)
    err = (got - expect).abs().max().item() / max(1.0, expect.abs().max().item())
    assert err < 1e-10, f"max rel diff {err:.3e}"
    torch.testing.assert_close(cache_list(two_caches), cache_list(one_caches), rtol=0, atol=1e-12)


# ---- MLAModel and presets -------------------------------------------------------------------


def test_tiny_model_runs_and_is_deterministic():
    config = MLAConfig.from_name("tiny")
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = MLAModel(config)
        ctx, qlens, block_size = [0, 5], [4, 3], 4
        num_blocks, table = block_table_for([c + q for c, q in zip(ctx, qlens)], block_size, seed=7)
        positions, slots, qsl, ctx_t = step_inputs(table, ctx, qlens, block_size)
        caches = model.allocate_kv_caches(num_blocks, block_size)
        ids = torch.arange(len(positions)) * 7 % config.vocab_size
        with torch.no_grad():
            plan = mla_ops.plan_prefill(qsl, ctx_t, table, block_size, workspace_size=4)
            outs.append(model(ids, positions, caches, slots, plan))
    assert outs[0].shape == (sum(qlens), config.hidden_size) and outs[0].dtype == torch.float32
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    assert isinstance(caches.latent, list) and len(caches.latent) == config.num_hidden_layers and caches.index is None
    assert all(c.shape == (num_blocks, block_size, config.kv_lora_rank + config.qk_rope_head_dim)
               for c in caches.latent)


def test_model_rejects_caches_for_the_wrong_layer_count():
    model = MLAModel(MLAConfig.from_name("tiny"))
    caches = model.allocate_kv_caches(4, 4).latent[:1]
    table = torch.zeros(1, 1, dtype=torch.int32)
    plan = mla_ops.plan_prefill(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), table, 4)
    with pytest.raises(ValueError, match="kv_caches"):
        model(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), caches,
              torch.zeros(1, dtype=torch.long), plan)


def test_a_stacked_tensor_runs_as_its_layers_in_eager_code():
    """``allocate_kv_caches`` gives one cache per layer; eager code also takes them stacked (as the stack's views,
    which it writes in place), and ``grown`` keeps the old rows in the first blocks."""
    torch.manual_seed(0)
    config = MLAConfig.from_name("tiny")
    model = MLAModel(config).eval()
    ctx, qlens, block_size = [0, 5, 9], [4, 3, 2], 4
    num_blocks, table = block_table_for([c + q for c, q in zip(ctx, qlens)], block_size, seed=7)
    positions, slots, qsl, ctx_t = step_inputs(table, ctx, qlens, block_size)
    ids = torch.arange(len(positions)) * 7 % config.vocab_size
    per_layer = normal_caches(model.allocate_kv_caches(num_blocks, block_size)).latent
    assert isinstance(per_layer, list) and len(per_layer) == config.num_hidden_layers
    assert all(cache.is_contiguous() for cache in per_layer)
    stacked = torch.stack(per_layer)
    plan = mla_ops.plan_prefill(qsl, ctx_t, table, block_size, workspace_size=4)
    with torch.no_grad():
        expect = model(ids, positions, tuple(per_layer), slots, plan)
        got = model(ids, positions, stacked, slots, plan)
    assert torch.equal(got, expect)
    assert torch.equal(torch.stack(per_layer), stacked)
    bigger = grown(mla_ops.KVCaches(per_layer), model.allocate_kv_caches(num_blocks + 3, block_size)).latent
    assert torch.equal(torch.stack(bigger)[:, :num_blocks], stacked) and not torch.stack(bigger)[:, num_blocks:].any()


@pytest.mark.parametrize("caches,match", [
    (lambda m: m.allocate_kv_caches(4, 4).latent[:1], "a list of 2 .* got a list of 1"),
    (lambda m: [m.allocate_kv_caches(4, 4).latent[0], m.allocate_kv_caches(5, 4).latent[0]],
     r"kv_caches.latent\[1\] must be .* like"),
    (lambda m: [c.double() if i else c for i, c in enumerate(m.allocate_kv_caches(4, 4).latent)],
     r"kv_caches.latent\[1\] must be .*float64"),
    (lambda m: [c[..., :-1] for c in m.allocate_kv_caches(4, 4).latent], r"kv_caches.latent\[0\] must be .*, 40\]"),
    (lambda m: torch.zeros(3, 4, 4, 40), r"kv_caches.latent must be a list of 2 .*got shape \(3, 4, 4, 40\)"),
    (lambda m: mla_ops.KVCaches(m.allocate_kv_caches(4, 4).latent, m.allocate_kv_caches(4, 4).latent),
     "kv_caches.index and k_scale_index are a sparse"),
    (lambda m: {"latent": m.allocate_kv_caches(4, 4).latent}, "kv_caches must be a mla_ops.KVCaches"),
])
def test_model_rejects_per_layer_caches_that_do_not_fit(caches, match):
    model = MLAModel(MLAConfig.from_name("tiny"))
    table = torch.zeros(1, 1, dtype=torch.int32)
    plan = mla_ops.plan_prefill(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), table, 4)
    with pytest.raises((ValueError, TypeError), match=match):
        model(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), caches(model),
              torch.zeros(1, dtype=torch.long), plan)


# ---- calls rejected before the cache is written ------------------------------------------------


def layer_call(seed=0):
    """A valid call of a one-layer model (keyword arguments) on a random cache: contexts [0, 5], queries [4, 3]."""
    config = replace(MLAConfig.from_name("tiny"), num_hidden_layers=1)
    torch.manual_seed(seed)
    model = MLAModel(config)
    ctx, qlens, block_size = [0, 5], [4, 3], 4
    num_blocks, table = block_table_for([c + q for c, q in zip(ctx, qlens)], block_size, seed=seed)
    positions, slots, qsl, ctx_t = step_inputs(table, ctx, qlens, block_size)
    g = torch.Generator().manual_seed(seed + 1)
    kv_cache = torch.randn(num_blocks, block_size, config.kv_lora_rank + config.qk_rope_head_dim, generator=g)
    plan = mla_ops.plan_prefill(qsl, ctx_t, table, block_size, workspace_size=4)
    call = dict(input_ids=torch.arange(len(positions)) % config.vocab_size, positions=positions, kv_cache=kv_cache,
                slot_mapping=slots, plan=plan, k_scale=None, backend="torch")
    return model, call, (qsl, ctx_t, table, block_size)


def _replan(**kwargs):
    def change(call, planned):
        qsl, ctx, table, block_size = planned
        options = dict(query_start_loc=qsl, context_lens=ctx, block_table=table, block_size=block_size,
                       workspace_size=4)
        call["plan"] = mla_ops.plan_prefill(**{**options, **kwargs})
    return change


def _set(**values):
    return lambda call, planned: call.update({k: v(call) if callable(v) else v for k, v in values.items()})


REJECTED_LAYER_CALLS = {
    "plan not a PrefillPlan": (_set(plan={}), TypeError, "plan must be a PrefillPlan"),
    "plan for another block_size": (_replan(block_size=8), ValueError, "made for block_size 8"),
    "plan for other tokens": (_replan(query_start_loc=torch.tensor([0, 4, 8], dtype=torch.int32)), ValueError,
                              "made for T=8"),
    "block id past the cache": (_set(kv_cache=lambda c: c["kv_cache"][:1]), ValueError, "past the 1 blocks"),
    "cache width": (_set(kv_cache=lambda c: c["kv_cache"][..., :-1]), ValueError, r"block_size, 40\]"),
    "fp8 cache without k_scale": (_set(kv_cache=lambda c: c["kv_cache"].to(torch.float8_e4m3fn)), ValueError,
                                  "k_scale"),
    "fp8 cache with a bad k_scale": (_set(kv_cache=lambda c: c["kv_cache"].to(torch.float8_e4m3fn), k_scale=-1.0),
                                     ValueError, "k_scale"),
    "slot_mapping 2-D": (_set(slot_mapping=lambda c: c["slot_mapping"][:, None]), ValueError, "slot_mapping"),
    "slot_mapping short": (_set(slot_mapping=lambda c: c["slot_mapping"][:-1]), ValueError, "slot_mapping"),
    "unknown backend": (_set(backend="no_such_backend"), ValueError, "backend"),
}


def _bits(x):
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


def _run(model, call):
    caches = mla_ops.KVCaches([call["kv_cache"]], k_scale=call["k_scale"])
    return model(call["input_ids"], call["positions"], caches, call["slot_mapping"], call["plan"],
                 backend=call["backend"])


@pytest.mark.parametrize("case", list(REJECTED_LAYER_CALLS))
def test_rejected_layer_call_leaves_the_cache_unchanged(case):
    """Everything is checked before the layer writes its new rows: a rejected call writes nothing."""
    model, call, planned = layer_call()
    change, error, match = REJECTED_LAYER_CALLS[case]
    change(call, planned)
    before = _bits(call["kv_cache"]).clone()
    with torch.no_grad(), pytest.raises(error, match=match):
        _run(model, call)
    assert torch.equal(_bits(call["kv_cache"]), before), f"{case}: the rejected call wrote the cache"
    model_ok, valid, _ = layer_call()  # the control: the same call unchanged does write the cache
    untouched = valid["kv_cache"].clone()
    with torch.no_grad():
        _run(model_ok, valid)
    assert not torch.equal(valid["kv_cache"], untouched)


def test_rejected_model_call_leaves_the_caches_unchanged():
    config = MLAConfig.from_name("tiny")
    torch.manual_seed(0)
    model = MLAModel(config)
    ctx, qlens, block_size = [0, 5], [4, 3], 4
    num_blocks, table = block_table_for([c + q for c, q in zip(ctx, qlens)], block_size, seed=3)
    positions, slots, qsl, ctx_t = step_inputs(table, ctx, qlens, block_size)
    caches = normal_caches(model.allocate_kv_caches(num_blocks, block_size))
    before = clone_caches(caches)
    ids = torch.arange(len(positions)) % config.vocab_size
    other_block_size = mla_ops.plan_prefill(qsl, ctx_t, table, 8, workspace_size=4)
    plan = mla_ops.plan_prefill(qsl, ctx_t, table, block_size, workspace_size=4)
    with torch.no_grad():
        with pytest.raises(ValueError, match="made for block_size 8"):
            model(ids, positions, caches, slots, other_block_size)
        with pytest.raises(TypeError, match="forward takes no block_table: the plan holds it"):
            model(ids, positions, caches, slots, table, plan)
        with pytest.raises(TypeError, match="k_scale"):  # it travels in the caches' record
            model(ids, positions, caches, slots, plan, k_scale=1.0)
        with pytest.raises(ValueError, match="slot_mapping"):
            model(ids, positions, caches, slots[:-1], plan)
    assert caches_equal(caches, before)


def test_deepseek_v2_lite_attention_shapes():
    config = MLAConfig.from_name("deepseek-v2-lite")
    c = config
    assert (c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (2048, 16, None, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (128, 64, 128)
    assert (c.rope_theta, c.rms_norm_eps) == (10000.0, 1e-6)
    assert (c.num_hidden_layers, c.intermediate_size, c.vocab_size) == (27, 10944, 102400)
    # The released config.json: YaRN x40 over 4,096 positions, 64 routed experts after 1 dense layer.
    y = c.rope_scaling
    assert (y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow) == (40, 4096, 32, 1)
    assert (y.mscale, y.mscale_all_dim, c.max_position_embeddings) == (0.707, 0.707, 163840)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.moe_intermediate_size) == (64, 6, 2, 1408)
    assert (c.first_k_dense_replace, c.scoring_func, c.topk_method, c.norm_topk_prob) == (1, "softmax", "greedy", False)
    assert (c.routed_scaling_factor, c.lora_norm_eps, c.dtype) == (1.0, 1e-6, "bfloat16")
    assert [c.is_moe_layer(i) for i in (0, 1, 26)] == [False, True, True]
    with torch.device("meta"):
        attn = MLAAttention(config)
    shapes = {name: tuple(p.shape) for name, p in attn.named_parameters()}
    assert shapes == {
        "q_proj.weight": (16 * (128 + 64), 2048),
        "kv_a_proj_with_mqa.weight": (512 + 64, 2048),
        "kv_a_layernorm.weight": (512,),
        "kv_b_proj.weight": (16 * (128 + 128), 512),
        "o_proj.weight": (2048, 16 * 128),
    }
    mscale = 0.1 * 0.707 * math.log(40) + 1  # YaRN's correction: x 1.5896
    assert attn.softmax_scale == pytest.approx(mscale**2 / math.sqrt(192))
    assert mscale**2 == pytest.approx(1.5896, abs=1e-4)


def test_deepseek_v3_preset():
    c = MLAConfig.from_name("deepseek-v3")
    assert (c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.num_hidden_layers) == (
        7168, 128, 1536, 512, 61)
    assert (c.intermediate_size, c.moe_intermediate_size, c.vocab_size) == (18432, 2048, 129280)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.first_k_dense_replace) == (256, 8, 1, 3)
    assert (c.scoring_func, c.topk_method, c.n_group, c.topk_group) == ("sigmoid", "noaux_tc", 8, 4)
    assert (c.norm_topk_prob, c.routed_scaling_factor) == (True, 2.5)
    assert (c.rope_scaling.factor, c.rope_scaling.mscale, c.rope_scaling.mscale_all_dim) == (40, 1.0, 1.0)
    assert c.softmax_scale == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(192))


def test_unknown_preset_is_rejected():
    with pytest.raises(ValueError, match="deepseek-v2-lite"):
        MLAConfig.from_name("deepseek-v9")
