"""The latent-cache write op and the MLA layer / model built on mla_ops.

kv_c [T, L]   k_pe [T, R]   slot_mapping [T] (negative = padding)   kv_cache [num_blocks, block_size, L+R]
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
from mla_ops.ops.cache import write_latent_cache
from mla_ops.models.deepseek import MLAAttention, MLAConfig, MLAModel

FP8 = torch.float8_e4m3fn
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


# ---- write_latent_cache --------------------------------------------------------------------


def loop_reference(kv_c, k_pe, slot_mapping, kv_cache, k_scale):
    out = kv_cache.clone()
    block_size = kv_cache.shape[1]
    for t, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        row = torch.cat([kv_c[t], k_pe[t]])
        if kv_cache.dtype == FP8:
            row = (row.float() / float(k_scale)).clamp(-448.0, 448.0)
        out[s // block_size, s % block_size] = row.to(kv_cache.dtype)
    return out


def bits(x):
    return x.contiguous().view(torch.uint8)


SLOTS = {
    "mixed": [-1, 9, 0, -1, 17, 3, -1, -1, 30, 12],  # padding before and after slot 0's writer
    "no_padding": [5, 0, 31, 8, 2, 19],
    "all_padding": [-1, -1, -1, -1],
    "empty": [],
}


def cache_case(cache_dtype, slots, *, src_dtype=torch.float32, num_blocks=8, block_size=4, L=12, R=4,
               strided=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = len(slots)
    kv_c = (torch.randn(T, L, generator=g) * 3).to(src_dtype)
    k_pe = (torch.randn(T, R, generator=g) * 3).to(src_dtype)
    width = L + R + (5 if strided else 0)
    big = torch.randn(num_blocks, block_size, width, generator=g).to(cache_dtype)
    kv_cache = big[..., : L + R] if strided else big
    return kv_c, k_pe, kv_cache, big


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("slots", list(SLOTS))
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, FP8])
def test_write_latent_cache_matches_loop(cache_dtype, slots, slot_dtype):
    kv_c, k_pe, kv_cache, _ = cache_case(cache_dtype, SLOTS[slots])
    slot_mapping = torch.tensor(SLOTS[slots], dtype=slot_dtype)
    k_scale = 0.05 if cache_dtype == FP8 else None  # large rows / 0.05 exercise fp8 saturation
    expect = loop_reference(kv_c, k_pe, slot_mapping, kv_cache, k_scale)
    write_latent_cache(kv_c, k_pe, slot_mapping, kv_cache, k_scale=k_scale)
    assert torch.equal(bits(kv_cache), bits(expect))


def test_write_latent_cache_strided_cache_and_tensor_scale():
    slots = SLOTS["mixed"]
    kv_c, k_pe, kv_cache, big = cache_case(FP8, slots, src_dtype=torch.bfloat16, strided=True)
    untouched = bits(big[..., kv_cache.shape[-1]:]).clone()
    k_scale = torch.tensor([0.5])
    expect = loop_reference(kv_c, k_pe, torch.tensor(slots), kv_cache, 0.5)
    write_latent_cache(kv_c, k_pe, torch.tensor(slots), kv_cache, k_scale=k_scale)
    assert torch.equal(bits(kv_cache), bits(expect))
    assert torch.equal(bits(big[..., kv_cache.shape[-1]:]), untouched)


def test_write_latent_cache_ignores_k_scale_for_float_caches():
    kv_c, k_pe, kv_cache, _ = cache_case(torch.float32, SLOTS["mixed"])
    expect = loop_reference(kv_c, k_pe, torch.tensor(SLOTS["mixed"]), kv_cache, None)
    write_latent_cache(kv_c, k_pe, torch.tensor(SLOTS["mixed"]), kv_cache, k_scale=0.25)
    assert torch.equal(kv_cache, expect)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, FP8])
def test_write_latent_cache_opcheck(cache_dtype):
    kv_c, k_pe, kv_cache, _ = cache_case(cache_dtype, SLOTS["mixed"])
    k_scale = torch.tensor([0.05]) if cache_dtype == FP8 else None
    # SchemaCheckMode compares outputs with float arithmetic that CPU float8 lacks.
    utils = OPCHECK_UTILS[1:] if cache_dtype == FP8 else OPCHECK_UTILS
    torch.library.opcheck(
        torch.ops.mla_ops.write_latent_cache.default,
        (kv_c, k_pe, torch.tensor(SLOTS["mixed"]), k_scale, kv_cache), test_utils=utils,
    )


def test_write_latent_cache_compiles_without_graph_breaks():
    kv_c, k_pe, kv_cache, _ = cache_case(torch.float32, SLOTS["mixed"])
    expect = loop_reference(kv_c, k_pe, torch.tensor(SLOTS["mixed"]), kv_cache, None)
    compiled = torch.compile(write_latent_cache, fullgraph=True, dynamic=True)
    compiled(kv_c, k_pe, torch.tensor(SLOTS["mixed"]), kv_cache)
    assert torch.equal(kv_cache, expect)


def _valid_write_args():
    kv_c, k_pe, kv_cache, _ = cache_case(FP8, SLOTS["mixed"])
    return dict(kv_c=kv_c, k_pe=k_pe, slot_mapping=torch.tensor(SLOTS["mixed"]), kv_cache=kv_cache, k_scale=0.5)


BAD_WRITES = {
    "kv_c not a tensor": (lambda a: a.update(kv_c=a["kv_c"].tolist()), TypeError, "kv_c"),
    "kv_c 3-D": (lambda a: a.update(kv_c=a["kv_c"][:, None]), ValueError, "kv_c"),
    "k_pe 1-D": (lambda a: a.update(k_pe=a["k_pe"][:, 0]), ValueError, "k_pe"),
    "slot_mapping 2-D": (lambda a: a.update(slot_mapping=a["slot_mapping"][:, None]), ValueError, "slot_mapping"),
    "kv_cache 2-D": (lambda a: a.update(kv_cache=a["kv_cache"][0]), ValueError, "kv_cache"),
    "cache width": (lambda a: a.update(k_pe=a["k_pe"][:, :-1]), ValueError, "L+R"),
    "token counts": (lambda a: a.update(k_pe=a["k_pe"][:-1]), ValueError, "k_pe"),
    "slot count": (lambda a: a.update(slot_mapping=a["slot_mapping"][:-1]), ValueError, "slot_mapping"),
    "slot dtype float": (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), TypeError, "slot_mapping"),
    "slot dtype int16": (lambda a: a.update(slot_mapping=a["slot_mapping"].short()), TypeError, "slot_mapping"),
    "kv_c integer": (lambda a: a.update(kv_c=a["kv_c"].int(), k_pe=a["k_pe"].int()), TypeError, "kv_c"),
    "k_pe dtype": (lambda a: a.update(k_pe=a["k_pe"].double()), TypeError, "k_pe"),
    "cache dtype": (lambda a: a.update(kv_cache=a["kv_cache"].view(torch.uint8)), TypeError, "kv_cache"),
    "fp8 without k_scale": (lambda a: a.update(k_scale=None), ValueError, "k_scale"),
    "k_scale two elements": (lambda a: a.update(k_scale=torch.ones(2)), ValueError, "k_scale"),
    "k_scale float64": (lambda a: a.update(k_scale=torch.ones(1, dtype=torch.float64)), ValueError, "k_scale"),
    "k_scale string": (lambda a: a.update(k_scale="0.5"), TypeError, "k_scale"),
    "k_scale zero": (lambda a: a.update(k_scale=0.0), ValueError, "k_scale"),
    "kv_c device": (lambda a: a.update(kv_c=a["kv_c"].to("meta")), ValueError, "kv_c"),
    "slot device": (lambda a: a.update(slot_mapping=a["slot_mapping"].to("meta")), ValueError, "slot_mapping"),
}


@pytest.mark.parametrize("case", list(BAD_WRITES))
def test_write_latent_cache_rejects_bad_input(case):
    args = _valid_write_args()
    change, error, name = BAD_WRITES[case]
    change(args)
    before = bits(args["kv_cache"]).clone() if args["kv_cache"].dtype == FP8 else args["kv_cache"].clone()
    with pytest.raises(error, match=name.replace("+", r"\+")):
        write_latent_cache(**args)
    after = bits(args["kv_cache"]) if args["kv_cache"].dtype == FP8 else args["kv_cache"]
    assert torch.equal(after, before)


# ---- paged batches ------------------------------------------------------------------------


def block_table_for(total_lens, block_size, *, seed, spare_blocks=3):
    """Shuffled blocks for requests of total_lens tokens; one extra (valid) column per row."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in total_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(need), max(need, default=0) + 1), num_blocks - 1, dtype=torch.int32)
    start = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[start : start + n]
        start += n
    return num_blocks, table


def step_inputs(block_table, context_lens, query_lens, block_size):
    """positions [T], slot_mapping [T] int64, query_start_loc [B+1], context_lens [B] for one step."""
    positions, slots = [], []
    for r, (c, q) in enumerate(zip(context_lens, query_lens)):
        for p in range(c, c + q):
            positions.append(p)
            slots.append(int(block_table[r, p // block_size]) * block_size + p % block_size)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    return (torch.tensor(positions), torch.tensor(slots), qsl, torch.tensor(context_lens, dtype=torch.int32))


def spread_weights(module, seed):
    """Re-draw weights at ~1/sqrt(fan_in) scale (and norm gains around 1) so attention is far from
    uniform; the default init (std 0.02) would make every softmax nearly flat."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * p.shape[1] ** -0.5 * 1.5)
            else:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return module


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
        out = attn(hidden, positions, kv_cache, slots, table, plan, backend="torch")

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
            return model(ids, positions, kv_caches, slots, table, plan, backend="torch")

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
    torch.testing.assert_close(two_caches, one_caches, rtol=0, atol=1e-12)


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
            outs.append(model(ids, positions, caches, slots, table, plan))
    assert outs[0].shape == (sum(qlens), config.hidden_size) and outs[0].dtype == torch.float32
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    assert caches.shape == (config.num_hidden_layers, num_blocks, block_size,
                            config.kv_lora_rank + config.qk_rope_head_dim)


def test_model_rejects_caches_for_the_wrong_layer_count():
    model = MLAModel(MLAConfig.from_name("tiny"))
    caches = model.allocate_kv_caches(4, 4)[:1]
    table = torch.zeros(1, 1, dtype=torch.int32)
    plan = mla_ops.plan_prefill(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), table, 4)
    with pytest.raises(ValueError, match="kv_caches"):
        model(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), caches,
              torch.zeros(1, dtype=torch.long), table, plan)


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
