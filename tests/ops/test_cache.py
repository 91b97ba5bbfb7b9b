"""write_latent_cache: the new tokens' latent rows [kv_c | k_pe] into the paged cache at their slots,
fp8-quantized with k_scale; padding slots (negative) skipped; bad input rejected before any write.

kv_c [T, L]   k_pe [T, R]   slot_mapping [T] (negative = padding)   kv_cache [num_blocks, block_size, L+R]
"""

import math

import pytest
import torch

import mla_ops  # noqa: F401  (registers torch.ops.mla_ops)
from mla_ops.ops.cache import write_latent_cache, write_latent_cache_reference
from tests.support.gpu import needs_cuda

FP8 = torch.float8_e4m3fn
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


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
    # By value, a float and a CPU tensor alike: 0 would store every element as +-448, inf as 0.
    **{f"k_scale {kind} {value}": (lambda a, v=value, k=kind: a.update(k_scale=torch.tensor([v]) if k == "tensor"
                                                                     else v), ValueError, "k_scale must be finite and positive")
       for kind in ("float", "tensor") for value in (0.0, -0.5, math.inf, -math.inf, math.nan)},
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
