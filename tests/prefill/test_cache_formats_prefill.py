"""Production cache formats read in place (DESIGN §12): every path on a ``fp8_ds_mla`` latent cache and an
``fp8_per_token`` index cache equals the float64 oracle computed from the dequantized cache.

The packed caches are made from a float64 batch by mla_ops' own writer (byte-equal to vLLM's rule:
tests/ops/test_cache_formats.py); the oracle reads the same values dequantized, as float64, through the
independent references of tests/support (dense attention, the masked sparse oracle, the indexer's).
"""

from dataclasses import replace

import pytest
import torch

import mla_ops
from mla_ops.ops.cache_formats import ds_mla_rows, ds_mla_values, per_token_quantize, per_token_rows
from mla_ops.ops.gather import gather_reference
from tests.support.batches import dense_reference, make_batch
from tests.support.gpu import TOL, needs_cuda
from tests.support.indexer import check_topk, indexer_batch
from tests.support.sparse import masked_reference, random_topk

CTX, QLENS = [0, 13, 5, 0, 9, 30, 2], [3, 4, 2, 9, 1, 5, 2]
TOPK, BLOCK, WORKSPACE = 8, 4, 8
DIMS = dict(N=2, L=512, P=8, R=64, V=8)  # fp8_ds_mla fixes L and R
PLANS = {
    "host": dict(absorb_max_query_len=0),
    "host, absorbed": dict(absorb_max_query_len=2),
    "device": dict(absorb_max_query_len=0, max_chunks=24),
    "device, absorbed": dict(absorb_max_query_len=2, max_chunks=24),
}


def pack_ds_mla(cache: torch.Tensor) -> torch.Tensor:
    """A float cache [num_blocks, block_size, 576] -> its fp8_ds_mla bytes [num_blocks, block_size, 656]."""
    rows = cache.flatten(0, 1)
    return ds_mla_rows(rows[:, :512], rows[:, 512:]).view(*cache.shape[:2], 656)


def ds_mla_batch(seed):
    """``(batch, packed)``: ``batch`` float64 with its cache replaced by the packed cache's values (the
    oracle's), ``packed`` the uint8 fp8_ds_mla cache (NaN rows outside the contexts stay NaN)."""
    batch = make_batch(CTX, QLENS, seed=seed, block_size=BLOCK, nan_fill=True, **DIMS)
    packed = pack_ds_mla(batch.kv_cache)
    return replace(batch, kv_cache=ds_mla_values(packed, torch.float64)), packed


def run(batch, packed, plan, **kwargs):
    return mla_ops.run_prefill(batch.q, batch.kv_c, batch.k_pe, packed, batch.kv_b_proj_weight, batch.softmax_scale,
                               plan, kv_cache_format="fp8_ds_mla", **kwargs)


def test_gather_dequantizes_fp8_ds_mla_rows_into_the_workspace():
    batch, packed = ds_mla_batch(seed=0)
    starts, cu = torch.tensor([3, 0], dtype=torch.int32), torch.tensor([0, 6, 11], dtype=torch.int32)
    table = batch.block_table[[1, 4]]
    got = torch.full((12, 576), 7.0, dtype=torch.float64)
    torch.ops.mla_ops.gather_context(packed, table, cu, starts, None, got)
    want = torch.full_like(got, 7.0)
    gather_reference(batch.kv_cache, table, cu, starts, None, want)  # the float64 cache of the same values
    assert torch.equal(got, want) and not got[:11].isnan().any()
    torch.library.opcheck(torch.ops.mla_ops.gather_context.default, (packed, table, cu, starts, None, got),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("form", list(PLANS))
def test_dense_paths_on_fp8_ds_mla_equal_the_float64_oracle(form):
    batch, packed = ds_mla_batch(seed=1)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK, WORKSPACE,
                                **PLANS[form])
    want, want_lse = dense_reference(*batch.args(), return_lse=True)
    for backend in ("torch", "auto"):
        out, lse = run(batch, packed, plan, backend=backend, return_lse=True)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-10)
    one_call = mla_ops.mla_prefill(*batch.args()[:3], packed, *batch.args()[4:], workspace_size=WORKSPACE,
                                   kv_cache_format="fp8_ds_mla")
    torch.testing.assert_close(one_call, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("masked_mha_ratio", [0.0, float("inf")], ids=["sparse", "masked MHA"])
@pytest.mark.parametrize("form", ["host", "device, absorbed"])
def test_sparse_attention_on_fp8_ds_mla_equals_the_masked_oracle(form, masked_mha_ratio):
    batch, packed = ds_mla_batch(seed=2)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK, WORKSPACE,
                                index_topk=TOPK, index_scores_budget=32, masked_mha_ratio=masked_mha_ratio,
                                **PLANS[form])
    topk = random_topk(CTX, QLENS, TOPK, seed=4, sparse=plan.sparse.tolist(), shuffle=False)
    out, lse = run(batch, packed, plan, topk_indices=topk, return_lse=True)
    sparse_out, sparse_lse, rows = masked_reference(batch, topk, plan.sparse)
    want, want_lse = dense_reference(*batch.args(), return_lse=True)
    assert rows.any() and not rows.all()
    torch.testing.assert_close(out, torch.where(rows[:, None, None], sparse_out, want), rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, torch.where(rows, sparse_lse, want_lse), rtol=0, atol=1e-10)


def per_token_round_trip(cache: torch.Tensor) -> torch.Tensor:
    """A float index cache's values as fp8_per_token stores them (quantized and read back), float32."""
    codes, scale = per_token_quantize(cache.flatten(0, 1))  # [n, D] codes, [n, D/128] scales: one per 128 values
    values = codes.view(torch.float8_e4m3fn).float().unflatten(-1, (-1, 128)) * scale.unsqueeze(-1)
    return values.flatten(-2).view(cache.shape)


def pack_per_token(cache: torch.Tensor) -> torch.Tensor:
    """A float index cache [num_blocks, block_size, D] -> fp8_per_token bytes [num_blocks, block_size, D + D/32]."""
    num_blocks, block_size, width = cache.shape
    packed = torch.zeros(num_blocks, block_size, width + width // 32, dtype=torch.uint8)
    slots = torch.arange(num_blocks * block_size)
    mla_ops.write_index_cache(cache.flatten(0, 1), slots, packed, index_cache_format="fp8_per_token")
    return packed


@pytest.mark.parametrize("width", [128, 256])  # D_I: one scale a key, two
@pytest.mark.parametrize("max_chunks", [None, 60])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_index_topk_on_fp8_per_token_equals_the_float64_oracle(max_chunks, dtype, width):
    ctx, qlens = [0, 13, 5, 30, 2], [3, 4, 9, 5, 2]
    batch = indexer_batch(ctx, qlens, TOPK, block_size=BLOCK, width=width, dtype=dtype, seed=5,
                          stored=per_token_round_trip)
    packed = pack_per_token(batch.index_cache.float())
    slots = torch.arange(packed.shape[0] * BLOCK)
    read = per_token_rows(packed, slots // BLOCK, slots % BLOCK, torch.float32).view(batch.index_cache.shape)
    assert torch.equal(read.nan_to_num(), per_token_round_trip(batch.index_cache.float()).nan_to_num())
    plan = batch.plan(TOPK, WORKSPACE, 32, max_chunks=max_chunks)
    assert plan.truncated is None or not plan.truncated.any()
    got = mla_ops.index_topk(batch.q_index, batch.index_weights, batch.k_index, packed, plan,
                             index_cache_format="fp8_per_token")
    check_topk(got, batch.expected, TOPK)


def test_a_step_on_both_formats_writes_selects_and_attends():
    """begin_step takes both formats once; each layer reads them, then writes its new rows in them."""
    batch, packed = ds_mla_batch(seed=6)
    g = torch.Generator().manual_seed(7)
    num_blocks, num_tokens, width, heads = packed.shape[0], batch.q.shape[0], 256, 4  # two scales a key
    index_cache = pack_per_token(torch.randn(num_blocks, BLOCK, width, generator=g))
    q_index = torch.randn(num_tokens, heads, width, generator=g, dtype=torch.float64)
    weights = torch.randn(num_tokens, heads, generator=g, dtype=torch.float64)
    k_index = torch.randn(num_tokens, width, generator=g, dtype=torch.float64)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK, WORKSPACE,
                                index_topk=TOPK, index_scores_budget=32)
    slot_mapping = torch.arange(num_tokens)  # written after the layer's reads
    step = mla_ops.begin_step(plan, packed, slot_mapping, kv_cache_format="fp8_ds_mla", index_cache=index_cache,
                              index_cache_format="fp8_per_token")
    topk = step.select(q_index, weights, k_index, index_cache)
    assert torch.equal(topk, mla_ops.index_topk(q_index, weights, k_index, index_cache, plan,
                                                index_cache_format="fp8_per_token"))
    layer = (batch.q, batch.kv_c, batch.k_pe, packed, batch.kv_b_proj_weight, batch.softmax_scale)
    before = packed.clone(), index_cache.clone()
    with pytest.raises(ValueError, match="k_scale is for a per-tensor float8_e4m3fn kv_cache: fp8_ds_mla stores"):
        step.run(*layer, k_scale=0.5, topk_indices=topk)  # a layer's scale is refused as begin_step's is
    with pytest.raises(ValueError, match="k_scale_index is for a per-tensor float8_e4m3fn index_cache"):
        step.write_index(k_index, index_cache, k_scale_index=1.0)
    assert torch.equal(packed, before[0]) and torch.equal(index_cache, before[1])
    out = step.run(*layer, topk_indices=topk)
    step.write_index(k_index, index_cache)
    sparse_out, _, rows = masked_reference(batch, topk, plan.sparse)
    want = torch.where(rows[:, None, None], sparse_out, dense_reference(*batch.args()))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
    # the new rows landed in the packed caches, in their formats
    assert torch.equal(packed.flatten(0, 1)[slot_mapping], ds_mla_rows(batch.kv_c, batch.k_pe))
    keys = per_token_rows(index_cache, slot_mapping // BLOCK, slot_mapping % BLOCK, torch.float32)
    assert torch.equal(keys, per_token_round_trip(k_index.float()[None])[0])



@pytest.mark.parametrize("width", [600, 700, 1312])
@pytest.mark.parametrize("call", ["run", "attend", "write"])
def test_an_fp8_ds_mla_layer_cache_of_another_width_is_refused_by_name(width, call):
    """Issue 48 item 10: a layer of an fp8_ds_mla step reads and writes 656-byte rows; a uint8 cache of another
    width (the step's blocks) raised a reshape RuntimeError. Refused by name as begin_step refuses it, nothing
    written."""
    batch, packed = ds_mla_batch(seed=6)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK, WORKSPACE)
    step = mla_ops.begin_step(plan, packed, torch.arange(batch.q.shape[0]), kv_cache_format="fp8_ds_mla")
    cache = torch.zeros(*packed.shape[:2], width, dtype=torch.uint8)
    layer = (batch.q, batch.kv_c, batch.k_pe, cache, batch.kv_b_proj_weight, batch.softmax_scale)
    with pytest.raises(ValueError, match=f"kv_cache_format='fp8_ds_mla' rows are 656 bytes .* but kv_cache rows "
                                         f"are {width} wide"):
        if call == "write":
            step.write(batch.kv_c, batch.k_pe, cache)
        else:
            getattr(step, call)(*layer)
    assert not cache.any()


def test_an_fp8_per_token_layer_cache_is_laid_out_as_the_format_says():
    """An fp8_per_token step's layer index cache is checked against the format as begin_step checks the step's:
    blocks that are not contiguous (a view into wider rows) were read and written through a copy, so the keys
    write_index wrote were lost; a cache of another row width. Refused by name, nothing written."""
    batch, packed = ds_mla_batch(seed=6)
    g = torch.Generator().manual_seed(7)
    num_blocks, num_tokens, width, heads = packed.shape[0], batch.q.shape[0], 128, 2
    index_cache = pack_per_token(torch.randn(num_blocks, BLOCK, width, generator=g))
    q_index = torch.randn(num_tokens, heads, width, generator=g, dtype=torch.float64)
    weights = torch.randn(num_tokens, heads, generator=g, dtype=torch.float64)
    k_index = torch.randn(num_tokens, width, generator=g, dtype=torch.float64)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK, WORKSPACE,
                                index_topk=TOPK, index_scores_budget=32)
    step = mla_ops.begin_step(plan, packed, torch.arange(num_tokens), kv_cache_format="fp8_ds_mla",
                              index_cache=index_cache, index_cache_format="fp8_per_token")
    strided = torch.zeros(num_blocks, BLOCK, 140, dtype=torch.uint8)
    strided[..., :132] = index_cache
    strided = strided[..., :132]  # the same bytes, rows 140 apart: not vLLM's block-major layout
    wider = torch.zeros(num_blocks, BLOCK, 264, dtype=torch.uint8)  # D_I = 256's rows
    for cache, match in [(strided, "is block-major: index_cache's blocks must be contiguous"),
                         (wider, "index_cache rows must be .*132")]:
        before = cache.clone()
        with pytest.raises(ValueError, match=match):
            step.write_index(k_index, cache)
        with pytest.raises(ValueError, match=match):
            step.select(q_index, weights, k_index, cache)
        assert torch.equal(cache, before)


BAD_STEP = {
    "uint8 cache without its format": (dict(), TypeError, "pass kv_cache_format='fp8_ds_mla'"),
    "format on a float cache": (dict(kv_cache_format="fp8_ds_mla", float_cache=True), TypeError,
                                "needs a uint8 kv_cache"),
    "unknown format": (dict(kv_cache_format="fp8"), ValueError, "kv_cache_format must be one of"),
    "a per-tensor scale": (dict(kv_cache_format="fp8_ds_mla", k_scale=0.5), ValueError, "k_scale is for a per-tensor"),
    "flashmla backend": (dict(kv_cache_format="fp8_ds_mla", backend="flashmla"), ValueError,
                         "flashmla"),
    "index format without index cache": (dict(kv_cache_format="fp8_ds_mla", index_cache_format="fp8_per_token"),
                                         ValueError, "describes an index_cache"),
}


@pytest.mark.parametrize("case", list(BAD_STEP))
def test_begin_step_checks_the_formats_once_by_name(case):
    batch, packed = ds_mla_batch(seed=8)
    kwargs, error, match = dict(BAD_STEP[case][0]), *BAD_STEP[case][1:]
    cache = batch.kv_cache if kwargs.pop("float_cache", False) else packed
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK, WORKSPACE)
    with pytest.raises(error, match=match):
        mla_ops.begin_step(plan, cache, **kwargs)


def test_a_layer_with_other_dims_than_fp8_ds_mla_is_refused():
    batch, packed = ds_mla_batch(seed=9)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK, WORKSPACE)
    with pytest.raises(ValueError, match="holds L = 512 and R = 64"):
        mla_ops.run_prefill(batch.q[..., :-32], batch.kv_c, batch.k_pe[:, :32].contiguous(), packed,
                            batch.kv_b_proj_weight, batch.softmax_scale, plan, kv_cache_format="fp8_ds_mla")


def test_index_topk_refuses_a_mismatched_index_format():
    index = indexer_batch([0, 13], [3, 4], TOPK, block_size=BLOCK, width=128, seed=10)
    plan = index.plan(TOPK, WORKSPACE, 32)
    with pytest.raises(TypeError, match="pass index_cache_format='fp8_per_token'"):
        mla_ops.index_topk(*index.args[:3], pack_per_token(index.index_cache), plan)
    with pytest.raises(TypeError, match="needs a uint8 index_cache"):
        mla_ops.index_topk(*index.args, plan, index_cache_format="fp8_per_token")
    with pytest.raises(ValueError, match="k_scale_index is for a per-tensor"):
        mla_ops.index_topk(*index.args[:3], pack_per_token(index.index_cache), plan, k_scale_index=1.0,
                           index_cache_format="fp8_per_token")
    # vLLM's layout holds D_I a multiple of 128 only: a row of D_I + 4 bytes at D_I = 256 is not it
    with pytest.raises(ValueError, match="rows are D_I \\+ D_I/128\\*4 bytes .* index_cache rows are 260"):
        mla_ops.index_topk(*index.args[:3], torch.zeros(8, BLOCK, 260, dtype=torch.uint8), plan,
                           index_cache_format="fp8_per_token")
    q_index, weights, k_index = index.args[:3]
    with pytest.raises(ValueError, match="needs D_I a multiple of 128, but q_index's D_I is 64"):
        mla_ops.index_topk(q_index[..., :64], weights, k_index[:, :64], pack_per_token(index.index_cache), plan,
                           index_cache_format="fp8_per_token")


# ---- on a GPU (benchmarks/gpu_check.sh, step dsa): the Triton kernels read the formats in place ----------


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("form", ["host, absorbed", "device"])
def test_cuda_dsa_step_on_both_formats_matches_the_cpu_oracle(dtype, form):
    """Writes (byte-equal to the CPU's), index_topk and run_prefill on CUDA over packed caches against the torch
    kernels on CPU (float64 queries over the same bytes)."""
    batch, packed = ds_mla_batch(seed=11)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, BLOCK, WORKSPACE,
                                index_topk=TOPK, index_scores_budget=32, **PLANS[form])
    topk = random_topk(CTX, QLENS, TOPK, seed=4, sparse=plan.sparse.tolist(), shuffle=False)
    want = run(batch, packed, plan, topk_indices=topk)
    gpu = batch.to("cuda", dtype)
    gpu_plan = mla_ops.plan_prefill(gpu.query_start_loc, gpu.context_lens, gpu.block_table, BLOCK, WORKSPACE,
                                    index_topk=TOPK, index_scores_budget=32, **PLANS[form])
    got = run(gpu, packed.cuda(), gpu_plan, topk_indices=topk.cuda())
    torch.testing.assert_close(got.double().cpu(), want, atol=TOL[dtype], rtol=TOL[dtype])
    # the writes on the GPU: the bytes the CPU writes
    slots = torch.arange(batch.q.shape[0])
    cpu_cache, gpu_cache = packed.clone(), packed.cuda()
    mla_ops.write_latent_cache(gpu.kv_c, gpu.k_pe, slots.cuda(), gpu_cache, kv_cache_format="fp8_ds_mla")
    mla_ops.write_latent_cache(gpu.kv_c.cpu(), gpu.k_pe.cpu(), slots, cpu_cache, kv_cache_format="fp8_ds_mla")
    assert torch.equal(gpu_cache.cpu(), cpu_cache)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_index_topk_on_fp8_per_token_equals_the_oracle(dtype):
    ctx, qlens = [0, 13, 5, 30, 2], [3, 4, 9, 5, 2]
    batch = indexer_batch(ctx, qlens, TOPK, block_size=BLOCK, width=256, dtype=dtype, seed=5,
                          stored=per_token_round_trip)
    packed = pack_per_token(batch.index_cache.float())
    gpu = batch.to("cuda")
    for max_chunks in (None, 60):
        plan = gpu.plan(TOPK, WORKSPACE, 32, max_chunks=max_chunks)
        got = mla_ops.index_topk(gpu.q_index, gpu.index_weights, gpu.k_index, packed.cuda(), plan,
                                 index_cache_format="fp8_per_token")
        check_topk(got, batch.expected, TOPK)


def test_a_dsa_step_on_both_formats_compiles_whole():
    """Under torch.compile (fullgraph, a device plan made in the graph) the packed formats run through the ops'
    fake implementations and give what eager gives."""
    batch, packed = ds_mla_batch(seed=12)
    g = torch.Generator().manual_seed(13)
    num_tokens, width = batch.q.shape[0], 128
    index_cache = pack_per_token(torch.randn(packed.shape[0], BLOCK, width, generator=g))
    q_index = torch.randn(num_tokens, 2, width, generator=g, dtype=torch.float64)
    weights = torch.randn(num_tokens, 2, generator=g, dtype=torch.float64)
    k_index = torch.randn(num_tokens, width, generator=g, dtype=torch.float64)

    def layer(q, kv_c, k_pe, kv_cache, index_cache, query_start_loc, context_lens, block_table, slots):
        plan = mla_ops.plan_prefill(query_start_loc, context_lens, block_table, BLOCK, WORKSPACE, max_chunks=24,
                                    index_topk=TOPK, index_scores_budget=32)
        step = mla_ops.begin_step(plan, kv_cache, slots, kv_cache_format="fp8_ds_mla", index_cache=index_cache,
                                  index_cache_format="fp8_per_token")
        topk = step.select(q_index, weights, k_index, index_cache)
        step.write_index(k_index, index_cache)
        return step.run(q, kv_c, k_pe, kv_cache, batch.kv_b_proj_weight, batch.softmax_scale, topk_indices=topk)

    slots = torch.arange(num_tokens)
    caches = [(packed.clone(), index_cache.clone()) for _ in range(2)]
    args = (batch.q, batch.kv_c, batch.k_pe)
    lengths = (batch.query_start_loc, batch.context_lens, batch.block_table, slots)
    want = layer(*args, *caches[0], *lengths)
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(*args, *caches[1], *lengths)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_opcheck_of_the_reading_ops_on_packed_caches():
    """The ops that read a packed cache (its format known from the uint8 dtype) pass opcheck: schema, fake
    tensors, AOT dispatch."""
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    batch, packed = ds_mla_batch(seed=14)
    batch = replace(batch, **{name: getattr(batch, name).float()
                                          for name in ("q", "kv_c", "k_pe", "kv_b_proj_weight")})
    t, n = batch.q.shape[:2]
    out, lse = torch.randn(t, n, 8), torch.randn(n, t)
    common = (batch.block_table, batch.query_start_loc, batch.context_lens)
    torch.library.opcheck(torch.ops.mla_ops.absorbed_context_attention.default,
                          (batch.q, packed, *common, batch.kv_b_proj_weight, batch.softmax_scale, None, out, lse),
                          test_utils=utils)
    sparse = torch.tensor([False, True, False, True, True, True, False])
    topk = random_topk(CTX, QLENS, TOPK, seed=4, sparse=sparse.tolist())
    torch.library.opcheck(torch.ops.mla_ops.sparse_attention.default,
                          (batch.q, batch.kv_c, batch.k_pe, packed, *common, sparse, topk, batch.kv_b_proj_weight,
                           batch.softmax_scale, None, out, lse), test_utils=utils)
    index = indexer_batch([0, 13, 5, 30, 2], [3, 4, 9, 5, 2], TOPK, block_size=BLOCK, width=256, seed=5,
                          stored=per_token_round_trip)
    plan = index.plan(TOPK, WORKSPACE, 32)
    s = plan.index_schedule
    torch.library.opcheck(torch.ops.mla_ops.index_topk.default,
                          (*index.args[:3], pack_per_token(index.index_cache.float()), plan.block_table,
                           plan.query_start_loc, plan.context_lens, plan.sparse, s.starts, s.cu_seq_lens,
                           s.token_start, s.token_end, None, plan.index_topk, s.rows, s.tokens,
                           [m for m, _ in s.piece_shapes], [w for _, w in s.piece_shapes]), test_utils=utils)
