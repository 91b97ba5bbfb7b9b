"""Production cache formats (DESIGN §12): writes byte-equal to vLLM's kernels, round trips, refusals.

vLLM's rules are written here again, independently of mla_ops/ops/cache_formats.py, in numpy with a
hand-made float8_e4m3fn encoder (csrc/cache_kernels.cu: concat_and_cache_ds_mla_kernel,
indexer_k_quant_and_cache_kernel with scale_fmt="ue8m0"):

* fp8_ds_mla row (656 bytes): 512 fp8 codes of kv_c / s_tile, s_tile = max(amax_tile / 448, FLT_MIN)
  for each of 4 tiles of 128 (float32); the 4 scales as float32 little-endian; 64 bf16 of k_pe.
* fp8_per_token (D a multiple of 128): a block's bytes = block_size x D codes (token-major), then
  block_size x D/128 float32 scales (token-major: token i's tile j at block_size * D + 4 (i * D/128 + j));
  per 128-value tile s = 2 ** ceil(log2(max(amax, 1e-4) / 448)).
Codes: x / s in float32, saturated to +-448, rounded to nearest even.
"""

import numpy as np
import pytest
import torch

import mla_ops  # noqa: F401  (registers torch.ops.mla_ops)
from mla_ops.ops.cache import write_index_cache, write_latent_cache
from mla_ops.ops.cache_formats import ds_mla_values, per_token_rows

OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def e4m3_code(v: np.ndarray) -> np.ndarray:
    """float8_e4m3fn codes (uint8) of float32 ``v``: saturating, round half to even (by hand)."""
    v = v.astype(np.float64)
    sign = (v < 0).astype(np.uint8) << 7
    a = np.minimum(np.abs(v), 448.0)
    with np.errstate(divide="ignore"):
        e = np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), -6)  # subnormals share exponent -6
    step = np.exp2(e - 3)  # 3 mantissa bits
    n = np.rint(a / step)  # half to even; n = 16 rolls into the next binade by itself
    code = (e + 6) * 8 + n
    code = np.where(a == 0, 0, code)
    return (code.astype(np.uint8) | sign).astype(np.uint8)


def vllm_ds_mla_row(kv_c: np.ndarray, k_pe_bf16_bits: np.ndarray) -> np.ndarray:
    """One 656-byte fp8_ds_mla row: kv_c float32 [512] (bf16 values), k_pe as bf16 bit patterns [64]."""
    codes, scales = [], []
    for tile in kv_c.reshape(4, 128):
        s = np.maximum(np.float32(np.abs(tile).max()) / np.float32(448.0), np.finfo(np.float32).tiny)
        s = np.float32(s)
        codes.append(e4m3_code((tile / s).astype(np.float32)))
        scales.append(s)
    scale_bytes = np.array(scales, dtype="<f4").view(np.uint8)
    rope_bytes = k_pe_bf16_bits.astype("<u2").view(np.uint8)
    return np.concatenate([np.concatenate(codes), scale_bytes, rope_bytes])


def vllm_per_token(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A key's codes [D] and its float32 scales [D/128], one per 128-value tile."""
    codes, scales = [], []
    for tile in k.reshape(-1, 128):
        s = np.float32(np.maximum(np.float32(np.abs(tile).max()), np.float32(1e-4)) / np.float32(448.0))
        s = np.float32(np.exp2(np.ceil(np.log2(s))))
        codes.append(e4m3_code((tile / s).astype(np.float32)))
        scales.append(s)
    return np.concatenate(codes), np.array(scales, dtype=np.float32)


def bf16_bits(x: torch.Tensor) -> np.ndarray:
    """bf16 bit patterns of bf16 values, from their float32 bits (the high half)."""
    return (x.float().numpy().view(np.uint32) >> 16).astype(np.uint16)


SLOTS = [5, -1, 0, 13, 7, -1, 2]  # padding tokens between real ones


def ds_mla_case(seed=0, num_blocks=4, block_size=4, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    T = len(SLOTS)
    kv_c = (torch.randn(T, 512, generator=g) * torch.rand(T, 1, generator=g) * 4).to(dtype)
    kv_c[1, 128:256] = 0  # an all-zero tile: scale FLT_MIN
    kv_c[2, :128] *= 1000  # a large tile
    k_pe = (torch.randn(T, 64, generator=g) * 2).to(dtype)
    cache = torch.randint(0, 256, (num_blocks, block_size, 656), generator=g, dtype=torch.uint8)
    return kv_c, k_pe, cache


def test_write_fp8_ds_mla_is_byte_equal_to_vllms_rule():
    kv_c, k_pe, cache = ds_mla_case()
    before = cache.clone()
    slots = torch.tensor(SLOTS, dtype=torch.int64)
    write_latent_cache(kv_c, k_pe, slots, cache, kv_cache_format="fp8_ds_mla")
    expected = before.view(-1, 656).numpy().copy()
    for t, s in enumerate(SLOTS):
        if s >= 0:
            expected[s] = vllm_ds_mla_row(kv_c[t].float().numpy(), bf16_bits(k_pe[t]))
    np.testing.assert_array_equal(cache.view(-1, 656).numpy(), expected)


def test_fp8_ds_mla_round_trip_within_fp8_error():
    kv_c, k_pe, cache = ds_mla_case(seed=1)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    write_latent_cache(kv_c, k_pe, slots, cache, kv_cache_format="fp8_ds_mla")
    real = [t for t, s in enumerate(SLOTS) if s >= 0]
    rows = ds_mla_values(cache.view(-1, 656)[[SLOTS[t] for t in real]])  # [n, 576] float32
    latent, rope = rows[:, :512], rows[:, 512:]
    assert torch.equal(rope, k_pe[real].float())  # k_pe is stored exactly
    tiles = kv_c[real].float().view(len(real), 4, 128)
    bound = tiles.abs().amax(-1, keepdim=True) / 448 * 32 / 2  # half an fp8 step at the tile's top binade
    err = (latent.view(len(real), 4, 128) - tiles).abs()
    assert (err <= bound + 1e-30).all()
    assert (err / tiles.abs().clamp_min(1e-3)).max() < 0.07  # e4m3: 3 mantissa bits, relative error <= 1/16


@pytest.mark.parametrize("D", [128, 256, 384])
def test_write_fp8_per_token_is_byte_equal_to_vllms_rule(D):
    """vLLM's layout built by hand: at D = 256 a token is 256 codes and two scales, 264 bytes."""
    g = torch.Generator().manual_seed(2)
    num_blocks, block_size = 4, 4
    T = len(SLOTS)
    k = (torch.randn(T, D, generator=g) * torch.rand(T, 1, generator=g) * 3).to(torch.bfloat16)
    k[3] = 0  # amax clamps to 1e-4
    k[0, -128:] *= 300  # a token's tiles far apart: each its own scale
    row = D + D // 128 * 4
    cache = torch.randint(0, 256, (num_blocks, block_size, row), generator=g, dtype=torch.uint8)
    before = cache.clone()
    write_index_cache(k, torch.tensor(SLOTS), cache, index_cache_format="fp8_per_token")
    expected = before.view(num_blocks, -1).numpy().copy()  # a block's bytes, block-major
    for t, s in enumerate(SLOTS):
        if s >= 0:
            block, offset = divmod(s, block_size)
            codes, scales = vllm_per_token(k[t].float().numpy())
            expected[block, offset * D:(offset + 1) * D] = codes
            at = block_size * D + 4 * (D // 128) * offset
            expected[block, at:at + 4 * (D // 128)] = scales.astype("<f4").view(np.uint8)
    np.testing.assert_array_equal(cache.view(num_blocks, -1).numpy(), expected)
    # read back: each code times its own tile's scale, from the hand-built bytes
    real = [t for t, s in enumerate(SLOTS) if s >= 0]
    slots = torch.tensor([SLOTS[t] for t in real])
    keys = per_token_rows(cache, slots // block_size, slots % block_size, torch.float32)
    for i, s in enumerate(slots.tolist()):
        block, offset = divmod(s, block_size)
        codes = torch.from_numpy(expected[block, offset * D:(offset + 1) * D].copy()).view(torch.float8_e4m3fn)
        at = block_size * D + 4 * (D // 128) * offset
        scales = torch.from_numpy(expected[block, at:at + 4 * (D // 128)].copy()).view(torch.float32)
        assert torch.equal(keys[i], (codes.float().view(-1, 128) * scales[:, None]).flatten())
    # round trip: within half an fp8 step of each tile's scale range
    tiles = k[real].float().view(len(real), -1, 128)
    scale = tiles.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448
    err = (keys.view_as(tiles) - tiles).abs()
    assert (err <= 2 * scale * 32 / 2).all()  # ue8m0 scale < 2x the exact one
    if D > 128:  # a scale per tile: the small tile keeps its precision beside the large one
        assert (err[0, 0] <= tiles[0, 0].abs().amax() / 448 * 32).all()


def test_packed_writes_opcheck():
    kv_c, k_pe, cache = ds_mla_case(seed=3)
    slots = torch.tensor(SLOTS)
    op = torch.ops.mla_ops.write_packed_cache.default
    torch.library.opcheck(op, (kv_c, k_pe, slots, cache, "fp8_ds_mla"), test_utils=OPCHECK_UTILS)
    k = torch.randn(len(SLOTS), 256, dtype=torch.float32)
    index_cache = torch.zeros(4, 4, 264, dtype=torch.uint8)
    torch.library.opcheck(op, (k, k[:, :0], slots, index_cache, "fp8_per_token"), test_utils=OPCHECK_UTILS)


BAD_LATENT = {
    "auto_with_uint8_cache": (dict(), TypeError, "kv_cache_format='fp8_ds_mla'"),
    "unknown_format": (dict(kv_cache_format="fp8_e5m2"), ValueError, "kv_cache_format must be one of"),
    "float_cache": (dict(kv_cache_format="fp8_ds_mla", cache=torch.zeros(4, 4, 576, dtype=torch.bfloat16)),
                    TypeError, "needs a uint8 kv_cache"),
    "wrong_width": (dict(kv_cache_format="fp8_ds_mla", cache=torch.zeros(4, 4, 576, dtype=torch.uint8)),
                    ValueError, "656 bytes"),
    "wrong_latent": (dict(kv_cache_format="fp8_ds_mla", kv_c=torch.zeros(7, 256, dtype=torch.bfloat16)),
                     ValueError, "kv_c must be \\[T, 512\\]"),
    "wrong_rope_dtype": (dict(kv_cache_format="fp8_ds_mla", k_pe=torch.zeros(7, 64)), TypeError, "k_pe must have"),
    "k_scale": (dict(kv_cache_format="fp8_ds_mla", k_scale=1.0), ValueError, "k_scale is for a per-tensor"),
    # every block one memory: a write would land in all of them
    "expanded": (dict(kv_cache_format="fp8_ds_mla", cache=torch.zeros(1, 4, 656, dtype=torch.uint8).expand(4, 4, 656)),
                 ValueError, r"kv_cache must give every element memory of its own, got shape \(4, 4, 656\) with "
                             r"strides \(0, 656, 1\)"),
}


@pytest.mark.parametrize("case", list(BAD_LATENT))
def test_fp8_ds_mla_write_refuses_bad_input_by_name(case):
    kv_c, k_pe, cache = ds_mla_case()
    change, error, match = BAD_LATENT[case]
    kv_c, k_pe, cache = change.get("kv_c", kv_c), change.get("k_pe", k_pe), change.get("cache", cache)
    before = cache.clone()
    kwargs = {k: v for k, v in change.items() if k in ("kv_cache_format", "k_scale")}
    k_scale = kwargs.pop("k_scale", None)
    with pytest.raises(error, match=match):
        write_latent_cache(kv_c, k_pe, torch.tensor(SLOTS), cache, k_scale, **kwargs)
    assert torch.equal(cache, before)  # nothing written


BAD_INDEX = {
    "auto_with_uint8_cache": (dict(), TypeError, "index_cache_format='fp8_per_token'"),
    "unknown_format": (dict(index_cache_format="fp8"), ValueError, "index_cache_format must be one of"),
    "fp8_cache": (dict(index_cache_format="fp8_per_token", cache=torch.zeros(4, 4, 132, dtype=torch.float8_e4m3fn)),
                  TypeError, "needs a uint8 index_cache"),
    "width_without_scale": (dict(index_cache_format="fp8_per_token", cache=torch.zeros(4, 4, 128, dtype=torch.uint8)),
                            ValueError, "index_cache rows are 128"),
    "one_scale_at_256": (dict(index_cache_format="fp8_per_token", k=torch.randn(len(SLOTS), 256),
                              cache=torch.zeros(4, 4, 260, dtype=torch.uint8)), ValueError,
                         "D_I \\+ D_I/128\\*4 bytes .* index_cache rows are 260"),
    "width_of_another_d": (dict(index_cache_format="fp8_per_token", k=torch.randn(len(SLOTS), 256)), ValueError,
                           "so index_cache rows must be 264 wide, got 132"),
    "d_not_a_multiple_of_128": (dict(index_cache_format="fp8_per_token", k=torch.randn(len(SLOTS), 64),
                                     cache=torch.zeros(4, 4, 66 * 2, dtype=torch.uint8)), ValueError,
                                "needs D_I a multiple of 128, but k_index's D_I is 64"),
    "k_scale_index": (dict(index_cache_format="fp8_per_token", k_scale_index=0.5), ValueError,
                      "k_scale_index is for a per-tensor"),
    "expanded": (dict(index_cache_format="fp8_per_token",
                      cache=torch.zeros(1, 4, 132, dtype=torch.uint8).expand(4, 4, 132)), ValueError,
                 r"index_cache must give every element memory of its own, got shape \(4, 4, 132\) with strides "
                 r"\(0, 132, 1\)"),
}


@pytest.mark.parametrize("case", list(BAD_INDEX))
def test_fp8_per_token_write_refuses_bad_input_by_name(case):
    change, error, match = BAD_INDEX[case]
    k = change.get("k", torch.randn(len(SLOTS), 128))
    cache = change.get("cache", torch.zeros(4, 4, 132, dtype=torch.uint8))
    before = cache.clone()
    kwargs = {key: v for key, v in change.items() if key == "index_cache_format"}
    with pytest.raises(error, match=match):
        write_index_cache(k, torch.tensor(SLOTS), cache, change.get("k_scale_index"), **kwargs)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("part", ["latent", "index"])
def test_caches_whose_elements_share_memory_are_refused_in_every_format(part):
    """A cache built with ``expand`` (every block the same bytes) or with overlapping strides, in the plain format
    too: a write would land in several places. Refused by name before anything is written."""
    width = 40 if part == "latent" else 16
    rows = torch.randn(len(SLOTS), width)
    for cache in (torch.zeros(1, 4, width).expand(4, 4, width),  # stride 0
                  torch.zeros(4 * 4 + width).as_strided((4, 4, width), (4, 1, 1))):  # rows overlapping rows
        before = cache.clone()
        name = "kv_cache" if part == "latent" else "index_cache"
        with pytest.raises(ValueError, match=rf"^{name} must give every element memory of its own"):
            if part == "latent":
                write_latent_cache(rows[:, :32], rows[:, 32:], torch.tensor(SLOTS), cache, None)
            else:
                write_index_cache(rows, torch.tensor(SLOTS), cache, None)
        assert torch.equal(cache, before)
