"""The Triton write_latent_cache kernel against its torch oracle (``write_latent_cache_reference``),
bit for bit, under Triton's CPU interpreter (TRITON_INTERPRET=1 is set by this folder's conftest
before the kernels are defined). bf16 caches are checked on a GPU (tests/ops/test_cache.py): the
interpreter has no bf16 arithmetic; bf16 sources are covered here (they are read, then upcast).

kv_c [T, L]   k_pe [T, R]   slot_mapping [T] (negative = padding)   kv_cache [num_blocks, block_size, L+R]
R = 0 is the index cache's write (``write_index_cache``: k_index [T, D_I] as kv_c) and a NoPE layer's.
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 set before import", allow_module_level=True)
pytest.importorskip("triton")

import torch  # noqa: E402

from mla_ops.ops.cache import write_latent_cache_reference  # noqa: E402
from mla_ops.triton import cache as triton_cache  # noqa: E402
from mla_ops.triton.cache import write_latent_cache  # noqa: E402

FP8 = torch.float8_e4m3fn


def bits(x):
    """The stored bytes: exact comparison, NaN codes and -0 included."""
    return x.contiguous().view(torch.uint8)


def scattered_slots(num_tokens, num_blocks, block_size, padding, seed):
    """Distinct slots in shuffled blocks (each block partly used, offsets shuffled), ``padding``
    tokens set to -1 at random positions (first and last included when there are any)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(num_blocks, generator=g)
    slots = (blocks[:, None] * block_size + torch.randperm(block_size, generator=g)[None, :]).flatten()
    assert num_tokens <= slots.numel()
    slots = slots[torch.randperm(slots.numel(), generator=g)[:num_tokens]]
    if padding and num_tokens:
        pad = torch.randperm(num_tokens, generator=g)[:padding]
        slots[pad] = -1
        slots[0] = slots[-1] = -1
    return slots


def run_both(kv_c, k_pe, slots, k_scale, kv_cache):
    """(reference cache, kernel cache) after one write each from the same starting cache."""
    want, got = kv_cache.clone(), kv_cache.clone()
    write_latent_cache_reference(kv_c, k_pe, slots, k_scale, want)
    write_latent_cache(kv_c, k_pe, slots, k_scale, got)
    return want, got


def case(T, L, R, num_blocks, block_size, src_dtype, cache_dtype, *, padding=0, seed=0, joint=False,
         slot_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    if joint:  # kv_c and k_pe: column slices of one [T, L+R+3] buffer
        buf = (torch.randn(T, L + R + 3, generator=g) * 3).to(src_dtype)
        kv_c, k_pe = buf[:, :L], buf[:, L + 1:L + 1 + R]
    else:
        kv_c = (torch.randn(T, L, generator=g) * 3).to(src_dtype)
        k_pe = (torch.randn(T, R, generator=g) * 3).to(src_dtype)
    kv_cache = torch.randn(num_blocks, block_size, L + R, generator=g).to(cache_dtype)
    slots = scattered_slots(T, num_blocks, block_size, padding, seed).to(slot_dtype)
    k_scale = torch.tensor([0.05]) if cache_dtype == FP8 else None  # |row| / 0.05 saturates often
    return kv_c, k_pe, slots, k_scale, kv_cache


SHAPES = {  # T, L, R, num_blocks, block_size, padding
    "L12_R4": (10, 12, 4, 8, 4, 3),
    "L20_R3": (37, 20, 3, 6, 16, 5),  # width 23: masked column lanes, more than one token tile
    "deepseek_512_64": (21, 512, 64, 5, 8, 4),  # width 576: nine column tiles
    "block_size_1": (9, 12, 4, 16, 1, 2),
    "index_128_R0": (21, 128, 0, 5, 8, 4),  # DSA's index cache: D_I = 128, two column tiles
    "index_20_R0": (19, 20, 0, 6, 4, 3),  # width 20: masked column lanes without a rope part
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, FP8])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16])
def test_write_latent_cache_kernel_matches_reference(shape, cache_dtype, src_dtype):
    T, L, R, num_blocks, block_size, padding = SHAPES[shape]
    want, got = run_both(*case(T, L, R, num_blocks, block_size, src_dtype, cache_dtype, padding=padding))
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_write_latent_cache_kernel_bf16_source(cache_dtype):
    want, got = run_both(*case(13, 12, 4, 8, 4, torch.bfloat16, cache_dtype, padding=2, seed=1))
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("cache_dtype", [torch.float16, FP8])
def test_write_latent_cache_kernel_strided_views(cache_dtype, slot_dtype):
    """kv_c / k_pe column slices of one buffer, a strided slot vector, a cache that is a slice of a
    wider buffer with its blocks in reverse order: the columns outside it stay untouched."""
    kv_c, k_pe, slots, k_scale, _ = case(19, 12, 4, 8, 4, torch.float32, cache_dtype, padding=4, seed=2,
                                         joint=True, slot_dtype=slot_dtype)
    slots = torch.stack([slots, torch.full_like(slots, 7)], dim=1)[:, 0]  # stride 2
    assert slots.stride(0) == 2 and kv_c.stride() == (19, 1) and k_pe.stride() == (19, 1)
    big = torch.randn(8, 4, 16 + 5).to(cache_dtype).flip(0)
    kv_cache = big[..., 2:18]
    want = kv_cache.clone()
    write_latent_cache_reference(kv_c, k_pe, slots, k_scale, want)
    outside = torch.cat([bits(big[..., :2]), bits(big[..., 18:])], -1).clone()
    write_latent_cache(kv_c, k_pe, slots, k_scale, kv_cache)
    assert torch.equal(bits(kv_cache), bits(want))
    assert torch.equal(torch.cat([bits(big[..., :2]), bits(big[..., 18:])], -1), outside)


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_write_latent_cache_kernel_padding_only_and_empty(cache_dtype):
    kv_c, k_pe, _, k_scale, kv_cache = case(5, 12, 4, 4, 4, torch.float32, cache_dtype)
    before = bits(kv_cache).clone()
    write_latent_cache(kv_c, k_pe, torch.full((5,), -1), k_scale, kv_cache)
    assert torch.equal(bits(kv_cache), before)
    write_latent_cache(kv_c[:0], k_pe[:0], torch.zeros(0, dtype=torch.int64), k_scale, kv_cache)  # T = 0
    assert torch.equal(bits(kv_cache), before)


def test_fp8_encoding_every_code_every_tie_and_specials():
    """Through k_scale = 1: every finite e4m3fn value, the midpoints between neighbours (ties to
    even), points just off them, subnormals, -0, values past 448 and +-inf (saturated), NaN."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = codes[~codes.isnan()].unique()  # ascending, -448 .. 448 (one zero)
    mids = (finite[1:] + finite[:-1]) / 2
    near = torch.cat([mids.nextafter(torch.tensor(-1e9)), mids.nextafter(torch.tensor(1e9))])
    specials = torch.tensor([-0.0, 0.0, 1e-30, -1e-30, 2.0**-10, 3 * 2.0**-11, 449.0, 464.0, 465.0, -470.0, 1e6,
                             float("inf"), float("-inf"), float("nan"), 2.0**-6 * 0.9999, 2.0**-149])
    values = torch.cat([finite, mids, near, specials])
    width = 16
    values = torch.cat([values, values.new_zeros(-values.numel() % width)]).reshape(-1, width)
    T = values.shape[0]
    kv_cache = torch.zeros(T, 1, width, dtype=FP8)
    slots = torch.arange(T).flip(0)
    want, got = run_both(values[:, :12], values[:, 12:], slots, torch.tensor([1.0]), kv_cache)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("cache_dtype", [torch.float16, FP8])
def test_index_cache_write_kernel_through_the_op_view(cache_dtype):
    """k_pe as ``write_index_cache`` passes it (a width-0 view of k_index, a column slice of a wider
    buffer), a strided cache: the columns outside it stay untouched."""
    g = torch.Generator().manual_seed(4)
    buf = (torch.randn(17, 24 + 6, generator=g) * 3).to(torch.float32)
    k_index = buf[:, 6:]
    big = torch.randn(6, 4, 24 + 3, generator=g).to(cache_dtype)
    index_cache = big[..., 1:25]
    slots = scattered_slots(17, 6, 4, 3, seed=4)
    k_scale = torch.tensor([0.05]) if cache_dtype == FP8 else None
    want = index_cache.clone()
    write_latent_cache_reference(k_index, k_index[:, :0], slots, k_scale, want)
    outside = torch.cat([bits(big[..., :1]), bits(big[..., 25:])], -1).clone()
    write_latent_cache(k_index, k_index[:, :0], slots, k_scale, index_cache)
    assert torch.equal(bits(index_cache), bits(want))
    assert torch.equal(torch.cat([bits(big[..., :1]), bits(big[..., 25:])], -1), outside)


def test_write_latent_cache_kernel_rejects_float64():
    kv_c, k_pe, slots, _, kv_cache = case(4, 12, 4, 4, 4, torch.float64, torch.float32)
    with pytest.raises(TypeError, match="float64"):
        write_latent_cache(kv_c, k_pe, slots, None, kv_cache)


def test_grid_depends_on_shapes_only():
    assert triton_cache.grid(1, 576) == (1, 9)
    assert triton_cache.grid(37, 23) == (3, 1)
    assert triton_cache.grid(300, 128) == (19, 2)  # the index cache at DeepSeek-V3.2's D_I
