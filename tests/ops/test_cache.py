"""write_latent_cache: the new tokens' latent rows [kv_c | k_pe] into the paged cache at their slots,
fp8-quantized with k_scale; padding slots (negative) skipped; bad input rejected before any write.
write_index_cache: DSA's index keys through the same op with R = 0, its messages naming its arguments.

kv_c [T, L]   k_pe [T, R]   slot_mapping [T] (negative = padding)   kv_cache [num_blocks, block_size, L+R]
k_index [T, D_I]   index_cache [num_blocks, block_size, D_I]   k_scale_index (fp8)
"""

import math

import pytest
import torch

import mla_ops  # noqa: F401  (registers torch.ops.mla_ops)
from mla_ops.ops.cache import write_index_cache, write_latent_cache, write_latent_cache_reference
from tests.support.gpu import needs_cuda

FP8 = torch.float8_e4m3fn
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def loop_reference(kv_c, k_pe, slot_mapping, kv_cache, k_scale):
    out = kv_cache.clone()
    block_size = kv_cache.shape[1]
    for t, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        row = kv_c[t] if k_pe is None else torch.cat([kv_c[t], k_pe[t]])
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
    # By value, a float and a CPU tensor alike: 0 would store every element as +-448, inf as 0.
    **{f"k_scale {kind} {value}": (lambda a, v=value, k=kind: a.update(k_scale=torch.tensor([v]) if k == "tensor"
                                                                     else v), ValueError, "k_scale must be finite and positive")
       for kind in ("float", "tensor") for value in (0.0, -0.5, math.inf, -math.inf, math.nan)},
    # Checked as the kernels' float32: 1e-46 is 0 there, 1e39 inf, 1e-40 subnormal.
    **{f"k_scale float {value}": (lambda a, v=value: a.update(k_scale=v), ValueError,
                                  "k_scale must be finite and positive, a normal float32")
       for value in (1e-46, 1e39, 1e-40)},
    "k_scale subnormal tensor": (lambda a: a.update(k_scale=torch.tensor([1e-40])), ValueError,
                                 "k_scale must be finite and positive, a normal float32"),
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


# ---- write_index_cache: the same op with R = 0 ------------------------------------------------------


def index_case(cache_dtype, slots, *, src_dtype=torch.float32, num_blocks=8, block_size=4, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_index = (torch.randn(len(slots), D, generator=g) * 3).to(src_dtype)
    index_cache = torch.randn(num_blocks, block_size, D, generator=g).to(cache_dtype)
    return k_index, index_cache


@pytest.mark.parametrize("slots", list(SLOTS))
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float32, FP8])
def test_write_index_cache_matches_loop(cache_dtype, slots):
    """Rows written at their slots, padding (negative) slots and every other slot untouched."""
    k_index, index_cache = index_case(cache_dtype, SLOTS[slots])
    slot_mapping = torch.tensor(SLOTS[slots], dtype=torch.int32 if slots == "mixed" else torch.int64)
    k_scale_index = 0.05 if cache_dtype == FP8 else None  # |k_index| / 0.05 saturates often
    expect = loop_reference(k_index, None, slot_mapping, index_cache, k_scale_index)
    write_index_cache(k_index, slot_mapping, index_cache, k_scale_index=k_scale_index)
    assert torch.equal(bits(index_cache), bits(expect))


def test_write_index_cache_fp8_saturates_and_keeps_nan():
    """Stored = k_index / k_scale_index cast to e4m3fn, saturated to +-448 (inf too); NaN stays NaN."""
    k_index = torch.tensor([[1000.0, -1000.0, 2.0, -0.25, float("inf"), float("-inf"), float("nan"), 0.0]])
    index_cache = torch.zeros(2, 2, 8, dtype=FP8)
    write_index_cache(k_index, torch.tensor([3]), index_cache, k_scale_index=torch.tensor([0.5]))
    row = index_cache[1, 1].float()
    assert row[:6].tolist() == [448.0, -448.0, 4.0, -0.5, 448.0, -448.0]
    assert row[6].isnan() and row[7] == 0
    assert not index_cache.view(torch.uint8)[:1].any() and not index_cache.view(torch.uint8)[1, 0].any()


def test_write_index_cache_strided_source_and_cache():
    """k_index a column slice of a wider buffer (as a fused projection leaves it), the cache a slice of
    a wider one: the columns outside it stay untouched."""
    slots = SLOTS["mixed"]
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(len(slots), 16 + 7, generator=g).to(torch.bfloat16)
    k_index = buf[:, 3:19]
    big = torch.randn(8, 4, 16 + 5, generator=g).to(FP8)
    index_cache = big[..., 2:18]
    outside = torch.cat([bits(big[..., :2]), bits(big[..., 18:])], -1).clone()
    expect = loop_reference(k_index, None, torch.tensor(slots), index_cache, 0.25)
    write_index_cache(k_index, torch.tensor(slots), index_cache, 0.25)
    assert torch.equal(bits(index_cache), bits(expect))
    assert torch.equal(torch.cat([bits(big[..., :2]), bits(big[..., 18:])], -1), outside)


def test_write_latent_cache_takes_a_nope_layer():
    """R = 0 through the latent call too (a NoPE layer): rows [kv_c] only."""
    kv_c, _, kv_cache, _ = cache_case(torch.float32, SLOTS["mixed"], L=12, R=0)
    k_pe = kv_c.new_empty(kv_c.shape[0], 0)
    expect = loop_reference(kv_c, None, torch.tensor(SLOTS["mixed"]), kv_cache, None)
    write_latent_cache(kv_c, k_pe, torch.tensor(SLOTS["mixed"]), kv_cache)
    assert torch.equal(kv_cache, expect)


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_write_index_cache_opcheck_and_compile(cache_dtype):
    """The op with a width-0 k_pe (the index call's) passes opcheck; the public call compiles whole."""
    k_index, index_cache = index_case(cache_dtype, SLOTS["mixed"])
    slots = torch.tensor(SLOTS["mixed"])
    k_scale = torch.tensor([0.05]) if cache_dtype == FP8 else None
    utils = OPCHECK_UTILS[1:] if cache_dtype == FP8 else OPCHECK_UTILS
    torch.library.opcheck(torch.ops.mla_ops.write_latent_cache.default,
                          (k_index, k_index[:, :0], slots, k_scale, index_cache), test_utils=utils)
    if cache_dtype == torch.float32:
        expect = loop_reference(k_index, None, slots, index_cache, None)
        torch.compile(write_index_cache, fullgraph=True, dynamic=True)(k_index, slots, index_cache)
        assert torch.equal(index_cache, expect)


def _valid_index_args():
    k_index, index_cache = index_case(FP8, SLOTS["mixed"])
    return dict(k_index=k_index, slot_mapping=torch.tensor(SLOTS["mixed"]), index_cache=index_cache,
                k_scale_index=0.5)


BAD_INDEX_WRITES = {
    "k_index not a tensor": (lambda a: a.update(k_index=a["k_index"].tolist()), TypeError, "k_index"),
    "k_index 3-D": (lambda a: a.update(k_index=a["k_index"][:, None]), ValueError, "k_index"),
    "k_index 1-D": (lambda a: a.update(k_index=a["k_index"][:, 0]), ValueError, "k_index"),
    "k_index integer": (lambda a: a.update(k_index=a["k_index"].int()), TypeError, "k_index"),
    "k_index device": (lambda a: a.update(k_index=a["k_index"].to("meta")), ValueError, "k_index"),
    "index_cache not a tensor": (lambda a: a.update(index_cache=None), TypeError, "index_cache"),
    "index_cache 2-D": (lambda a: a.update(index_cache=a["index_cache"][0]), ValueError, "index_cache"),
    "index_cache dtype": (lambda a: a.update(index_cache=a["index_cache"].view(torch.uint8)), TypeError,
                          "index_cache"),
    "cache width": (lambda a: a.update(k_index=a["k_index"][:, :-1]), ValueError, "index_cache rows must be D_I"),
    "slot count": (lambda a: a.update(slot_mapping=a["slot_mapping"][:-1]), ValueError, "k_index and slot_mapping"),
    "slot dtype float": (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), TypeError, "slot_mapping"),
    "slot past the cache": (lambda a: a.update(slot_mapping=a["slot_mapping"] + 32), ValueError,
                            "past the 32 slots of index_cache"),
    "fp8 without k_scale_index": (lambda a: a.update(k_scale_index=None), ValueError,
                                  "k_scale_index is required for a float8_e4m3fn index_cache"),
    "k_scale_index two elements": (lambda a: a.update(k_scale_index=torch.ones(2)), ValueError, "k_scale_index"),
    "k_scale_index string": (lambda a: a.update(k_scale_index="0.5"), TypeError, "k_scale_index"),
    "k_scale_index zero": (lambda a: a.update(k_scale_index=0.0), ValueError, "k_scale_index must be finite"),
    "k_scale_index nan tensor": (lambda a: a.update(k_scale_index=torch.tensor([math.nan])), ValueError,
                                 "k_scale_index must be finite"),
    **{f"k_scale_index float32 {value}": (lambda a, v=value: a.update(k_scale_index=v), ValueError,
                                          "k_scale_index must be finite and positive, a normal float32")
       for value in (1e-46, 1e39, 1e-40)},
}


@pytest.mark.parametrize("case", list(BAD_INDEX_WRITES))
def test_write_index_cache_rejects_bad_input(case):
    args = _valid_index_args()
    change, error, name = BAD_INDEX_WRITES[case]
    change(args)
    cache = args["index_cache"]
    before = bits(cache).clone() if isinstance(cache, torch.Tensor) else None
    with pytest.raises(error, match=name) as info:
        write_index_cache(**args)
    assert "kv_c" not in str(info.value) and "kv_cache" not in str(info.value) and "k_pe" not in str(info.value)
    if before is not None:
        assert torch.equal(bits(cache), before)


# ---- GPU: the Triton kernel (the op's CUDA kernel) against the reference on CPU, bit for bit -------


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("src_dtype,cache_dtype,L,R,block_size", [  # few cases: each compiles kernels
    (torch.bfloat16, torch.bfloat16, 512, 64, 64),  # DeepSeek's
    (torch.bfloat16, FP8, 512, 64, 64),
    (torch.float16, FP8, 12, 4, 4),
    (torch.float16, torch.float16, 12, 4, 4),
    (torch.float32, torch.bfloat16, 12, 4, 4),  # rounded to bf16 (the interpreter can't check it)
    (torch.float32, torch.float32, 12, 4, 4),  # and float64 rows, on the reference
])
def test_cuda_write_latent_cache_kernel(src_dtype, cache_dtype, L, R, block_size, monkeypatch):
    """torch.ops.mla_ops.write_latent_cache on CUDA runs the Triton kernel, one call per write:
    rows scattered over shuffled blocks, padding tokens, kv_c / k_pe column slices of one buffer,
    int32 and int64 slots, T = 0, and float64 falling back to the reference."""
    from mla_ops.triton import cache as triton_cache

    calls = []
    kernel = triton_cache.write_latent_cache
    monkeypatch.setattr(triton_cache, "write_latent_cache", lambda *a: (calls.append(1), kernel(*a)))
    g = torch.Generator().manual_seed(L + block_size)
    num_blocks = 8
    slots = (torch.randperm(num_blocks, generator=g)[:, None] * block_size  # shuffled blocks and offsets
             + torch.randperm(block_size, generator=g)[None, :]).flatten()
    slots = slots[torch.randperm(slots.numel(), generator=g)][:150]
    slots[torch.randperm(slots.numel(), generator=g)[: slots.numel() // 4]] = -1  # padding
    T = slots.numel()
    buf = (torch.randn(T, L + R + 8, generator=g) * 3).to(src_dtype)
    kv_c, k_pe = buf[:, :L], buf[:, L + 8:]
    kv_cache = torch.randn(num_blocks, block_size, L + R, generator=g).to(cache_dtype)
    k_scale = torch.tensor([0.05]) if cache_dtype == FP8 else None
    for slot_dtype in (torch.int64, torch.int32):
        want = kv_cache.clone()
        write_latent_cache_reference(kv_c, k_pe, slots.to(slot_dtype), k_scale, want)
        args = [x.cuda() if isinstance(x, torch.Tensor) else x
                for x in (kv_c, k_pe, slots.to(slot_dtype), k_scale, kv_cache)]
        torch.ops.mla_ops.write_latent_cache(*args)
        assert torch.equal(bits(args[-1].cpu()), bits(want))
    assert len(calls) == 2
    got = kv_cache.cuda()
    torch.ops.mla_ops.write_latent_cache(kv_c[:0].cuda(), k_pe[:0].cuda(), slots[:0].cuda(),
                                         None if k_scale is None else k_scale.cuda(), got)  # T = 0
    assert torch.equal(bits(got.cpu()), bits(kv_cache)) and len(calls) == 3
    if cache_dtype == torch.float32:  # float64 rows: the reference, on the GPU
        want = kv_cache.clone()
        write_latent_cache_reference(kv_c.double(), k_pe.double(), slots, None, want)
        got = kv_cache.cuda()
        torch.ops.mla_ops.write_latent_cache(kv_c.double().cuda(), k_pe.double().cuda(), slots.cuda(), None, got)
        assert torch.equal(got.cpu(), want) and len(calls) == 3


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("src_dtype,cache_dtype", [
    (torch.bfloat16, FP8),  # DeepSeek-V3.2's index cache
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16),
])
def test_cuda_write_index_cache_kernel(src_dtype, cache_dtype, monkeypatch):
    """write_index_cache on CUDA: the latent cache's Triton kernel with R = 0, one call, bit for bit
    against the reference on CPU; k_index a column slice of a wider buffer, padding slots."""
    from mla_ops.triton import cache as triton_cache

    calls = []
    kernel = triton_cache.write_latent_cache
    monkeypatch.setattr(triton_cache, "write_latent_cache", lambda *a: (calls.append(a[1].shape), kernel(*a)))
    g = torch.Generator().manual_seed(7)
    num_blocks, block_size, D = 8, 64, 128
    slots = torch.randperm(num_blocks * block_size, generator=g)[:300]
    slots[torch.randperm(300, generator=g)[:50]] = -1
    buf = (torch.randn(300, D + 64, generator=g) * 3).to(src_dtype)
    k_index = buf[:, 32:32 + D]
    index_cache = torch.randn(num_blocks, block_size, D, generator=g).to(cache_dtype)
    k_scale = torch.tensor([0.05]) if cache_dtype == FP8 else None
    want = index_cache.clone()
    write_latent_cache_reference(k_index, k_index[:, :0], slots, k_scale, want)
    got = index_cache.cuda()
    write_index_cache(k_index.cuda(), slots.cuda(), got, None if k_scale is None else k_scale.cuda())
    assert torch.equal(bits(got.cpu()), bits(want))
    assert calls == [torch.Size([300, 0])]
