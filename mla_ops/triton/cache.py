"""Triton kernel: write the new tokens' rows ``[kv_c | k_pe]`` into a paged cache: the latent cache,
and DSA's index cache (``k_index`` as kv_c, R = 0; ``write_index_cache`` in ``mla_ops/ops/cache.py``).

kv_c          [T, L]        any strides (e.g. a column slice of one [T, L+R] buffer)
k_pe          [T, R]        dtype of kv_c, any strides; R = 0: never read (no rope part)
slot_mapping  [T] int64 or int32   flat slot ``block * block_size + offset``; negative = padding
k_scale       [1] float32 or None   float8_e4m3fn caches store ``row / k_scale``, saturated to +-448
kv_cache      [num_blocks, block_size, L+R]  fp32/fp16/bf16 or float8_e4m3fn, any strides (out=)

Oracle: ``write_latent_cache_reference`` in ``mla_ops/ops/cache.py``, bit for bit. One launch
per call: one program per (token tile, column tile), a grid from the shapes alone (nothing read
on the host). Each program loads its tokens' slots, splits them into block and offset itself
(``slot // block_size``, ``slot % block_size``, addressed through the cache's strides) and stores
with a mask that drops padding tokens, so padding costs no write and no host sync.

fp8: ``row.float() / k_scale`` is divided with IEEE rounding (``div_rn``: Triton's fp32 ``/`` is
approximate on GPUs), saturated to +-448 (NaN stays NaN), and encoded to e4m3fn bits here with
round-to-nearest-even, as torch's cast does; the bytes are stored through a uint8 view of the
cache. The encoding is integer arithmetic, so the interpreter and every GPU produce the same bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import device_guard

FP8_MAX = tl.constexpr(448.0)  # largest finite float8_e4m3fn
FP8_NAN = tl.constexpr(0x7F)  # e4m3fn S.1111.111
# float32 exponent bias 127 against e4m3's 7: (127 - 7) << 3 in the (exponent, 3-bit mantissa) code
FP8_NORMAL_CODE_SHIFT = tl.constexpr(960)
FP8_MIN_NORMAL_BITS = tl.constexpr(0x3C800000)  # float32 bits of 2**-6, e4m3's least normal
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def float32_to_e4m3fn(value):
    """float32 (already within +-448, or NaN) -> float8_e4m3fn bits as int32 0..255, round-to-nearest-even."""
    bits = value.to(tl.int32, bitcast=True)
    sign = tl.where(bits < 0, 0x80, 0)
    magnitude = bits & 0x7FFFFFFF
    # Normal: round the 23-bit mantissa to 3 bits (ties to even), then rebias the exponent.
    # (NaN lanes are capped first so the sum cannot overflow; they are replaced below.)
    finite = tl.minimum(magnitude, 0x7F800000)
    rounded = finite + 0x7FFFF + ((finite >> 20) & 1)
    normal = (rounded >> 20) - FP8_NORMAL_CODE_SHIFT
    # Subnormal (below 2**-6): the magnitude in units of 2**-9, rounded to an integer 0..8, ties to
    # even (8 is the least normal, code 0x08). value = m * 2**(e - 23) with the implicit bit.
    exponent = (magnitude >> 23) - 127
    mantissa = (magnitude & 0x7FFFFF) | 0x800000
    shift = tl.minimum(14 - exponent, 25)  # >= 21 here; 25 already rounds every mantissa to 0
    shift = tl.maximum(shift, 1)  # lanes on the normal path: keep the shifts defined
    quotient = mantissa >> shift
    remainder = mantissa & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (remainder > half) | ((remainder == half) & ((quotient & 1) == 1))
    subnormal = quotient + round_up.to(tl.int32)
    code = tl.where(magnitude >= FP8_MIN_NORMAL_BITS, normal, subnormal)
    code = tl.where(magnitude > 0x7F800000, FP8_NAN, code)
    return code | sign


@triton.jit
def _write_latent_cache_kernel(
    kv_c_ptr,  # [T, L]
    k_pe_ptr,  # [T, R]
    slot_ptr,  # [T] int64 / int32
    k_scale_ptr,  # [1] float32 (read only when IS_FP8)
    cache_ptr,  # [num_blocks, block_size, L+R] (uint8 bits for fp8 caches)
    num_tokens,
    latent,
    width,
    block_size,
    stride_c_row,
    stride_c_col,
    stride_pe_row,
    stride_pe_col,
    stride_slot,
    stride_cache_block,
    stride_cache_token,
    stride_cache_col,
    IS_FP8: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    slot = tl.load(slot_ptr + rows.to(tl.int64) * stride_slot, mask=rows < num_tokens, other=-1).to(tl.int64)
    real = slot >= 0  # padding rows and rows past T write nothing
    slot = tl.where(real, slot, 0)
    dst_row = (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_token

    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    in_latent = cols < latent
    rows64 = rows.to(tl.int64)
    c_src = kv_c_ptr + rows64[:, None] * stride_c_row + cols.to(tl.int64)[None, :] * stride_c_col
    values = tl.load(c_src, mask=real[:, None] & in_latent[None, :], other=0.0)
    if HAS_ROPE:  # R = 0 (the index cache, NoPE layers): one load, no k_pe pointer
        in_rope = (cols >= latent) & (cols < width)
        pe_cols = tl.where(in_rope, cols - latent, 0).to(tl.int64)
        pe_src = k_pe_ptr + rows64[:, None] * stride_pe_row + pe_cols[None, :] * stride_pe_col
        values = tl.where(
            in_latent[None, :], values, tl.load(pe_src, mask=real[:, None] & in_rope[None, :], other=0.0)
        )

    dst = cache_ptr + dst_row[:, None] + cols.to(tl.int64)[None, :] * stride_cache_col
    mask = real[:, None] & (cols < width)[None, :]
    if IS_FP8:
        scaled = tl.math.div_rn(values.to(tl.float32), tl.load(k_scale_ptr).to(tl.float32))
        scaled = tl.where(scaled > FP8_MAX, FP8_MAX, tl.where(scaled < -FP8_MAX, -FP8_MAX, scaled))
        tl.store(dst, float32_to_e4m3fn(scaled).to(tl.uint8), mask=mask)
    else:
        tl.store(dst, values.to(cache_ptr.dtype.element_ty), mask=mask)


BLOCK_ROWS = 16
MAX_BLOCK_COLS = 64  # L+R = 576 = 9 * 64, D_I = 128 = 2 * 64: no masked lanes at DeepSeek sizes
NUM_WARPS = 4


def block_columns(width: int) -> int:
    return min(MAX_BLOCK_COLS, triton.next_power_of_2(width))


def grid(num_tokens: int, width: int) -> tuple[int, int]:
    """(token tiles, column tiles): from the shapes only, so the launch reads nothing on the host."""
    return triton.cdiv(num_tokens, BLOCK_ROWS), triton.cdiv(width, block_columns(width))


def write_latent_cache(kv_c, k_pe, slot_mapping, k_scale, kv_cache) -> None:
    """Write ``[kv_c | k_pe]`` of token t at slot ``slot_mapping[t]`` (skipping negatives); see module doc.

    Arguments as the op ``mla_ops::write_latent_cache`` takes them (checked by its caller).
    """
    with device_guard(kv_cache):
        num_tokens, latent = kv_c.shape
        width = kv_cache.shape[2]
        if num_tokens == 0 or width == 0:
            return
        for name, tensor, allowed in (
            ("kv_c", kv_c, KERNEL_DTYPES),
            ("kv_cache", kv_cache, KERNEL_DTYPES + (torch.float8_e4m3fn,)),
        ):
            if tensor.dtype not in allowed:
                raise TypeError(
                    f"the Triton write_latent_cache kernel takes a float16, bfloat16 or float32 {name}"
                    f"{' (or float8_e4m3fn)' if name == 'kv_cache' else ''}, got {tensor.dtype} "
                    "(float64 runs on the torch reference)"
                )
        is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
        has_rope = k_pe.shape[1] > 0
        cache = kv_cache.view(torch.uint8) if is_fp8 else kv_cache
        block_cols = block_columns(width)
        _write_latent_cache_kernel[grid(num_tokens, width)](
            kv_c,
            k_pe if has_rope else kv_c,  # a width-0 k_pe may hold no storage: never read
            slot_mapping,
            k_scale if is_fp8 else kv_c,  # a never-read placeholder pointer otherwise
            cache,
            num_tokens,
            latent,
            width,
            kv_cache.shape[1],
            *kv_c.stride(),
            *k_pe.stride(),
            slot_mapping.stride(0),
            *cache.stride(),
            IS_FP8=is_fp8,
            HAS_ROPE=has_rope,
            BLOCK_ROWS=BLOCK_ROWS,
            BLOCK_COLS=block_cols,
            num_warps=NUM_WARPS,
        )
