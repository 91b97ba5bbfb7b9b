"""What the Triton kernels share: constants, the online-softmax step, the request search, e4m3
decoding, and the device guard every launcher runs its launch under.

Scalars in Triton's interpreter are 1-element arrays. Triton 3.6's interpreter turns a
``range()`` bound into a Python int with ``int(array)``, which numpy >= 2.4 refuses for a
1-element array (newer Triton squeezes first). So a kernel never loops ``range(lo, hi)`` over
bounds read from a tensor under the interpreter: the loop-carrying kernels take an
``INTERPRETED`` constexpr (``device_guard`` yields it) and walk those bounds with a ``while``
loop there, keeping the ``for`` loop, which Triton software-pipelines, for compiled kernels.
``while`` conditions and ``if`` tests only need ``bool()``, which works on every version.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from .._env import interpreting

# Globals read inside @triton.jit must be tl.constexpr; launchers use ``.value``.
LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln(2): natural -> base-2 exponents
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): base-2 LSE -> natural log

FP8_EXPONENT_BIAS_SHIFT = tl.constexpr(120)  # fp32 exponent = e4m3 exponent - 7 + 127
FP8_SUBNORMAL_UNIT = tl.constexpr(0.001953125)  # 2**-9: e4m3 subnormal = mantissa / 8 * 2**-6
FP8_NAN_MAGNITUDE = tl.constexpr(0x7F)  # e4m3fn has no infinities; S.1111.111 is NaN
FP32_QUIET_NAN_BITS = tl.constexpr(0x7FC00000)

# Operand dtypes of tl.dot; float64 runs on the torch reference.
DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def neg_inf_to_nan(qk):
    """Scores with -inf made NaN, before a mask writes its -inf: a -inf score from the inputs (an inf in q or a
    key, an overflow) must make its row NaN, not read as a hidden key. With it every non-finite score a row sees
    makes the row NaN through the online softmax: a NaN spreads, a +inf max gives ``exp2(inf - inf)``."""
    return tl.where(qk == float("-inf"), float("nan"), qk)


@triton.jit
def online_softmax_step(qk, acc, l_i, m_i):
    """Fold a tile of base-2 logits into the running (max, sum): probabilities, rescaled acc, sums, max."""
    m_ij = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_ij)
    return p, acc * alpha[:, None], l_i * alpha + tl.sum(p, 1), m_ij


@triton.jit
def online_softmax_step_masked(qk, acc, l_i, m_i):
    """``online_softmax_step`` where a row may have seen no key yet (a sliding window's mask): a max of -inf
    stays -inf without ``exp2(nan)``, and such a row adds nothing."""
    m_ij = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    return p, acc * alpha[:, None], l_i * alpha + tl.sum(p, 1), m_ij


@triton.jit
def find_request(offsets_ptr, stride, num_requests, target, TILE: tl.constexpr, SPARE_SLOT: tl.constexpr):
    """The last request i < num_requests with ``key(i) <= target`` (0 if none), elementwise for a block target.

    ``key(i) = offsets[i] // TILE + i * SPARE_SLOT`` must not decrease with i. Rows of a chunk
    (``offsets = cu_seq_lens``, TILE 1, no spare slot) find their request, skipping empty ones;
    program slots of a query tile (``offsets = query_start_loc``, TILE = BLOCK_M, one spare slot
    per request) find the request that owns them. Branchless, ceil(log2(n)) loads.
    """
    base = tl.zeros_like(target)
    length = num_requests
    while length > 1:
        half = length // 2
        probe = base + half
        key = tl.load(offsets_ptr + probe * stride) // TILE + probe * SPARE_SLOT
        base = tl.where(key <= target, probe, base)
        length -= half
    return base


@triton.jit
def e4m3fn_to_float32(bits):
    """Decode float8_e4m3fn bytes (as int32 0..255) to float32 exactly, NaN and subnormals included.

    From the bits, not a float8 cast: Triton's interpreter casts the NaN codes 0x7f / 0xff to +-480.
    """
    magnitude = bits & 0x7F
    exponent = magnitude >> 3
    mantissa = magnitude & 0x7
    normal = (((exponent + FP8_EXPONENT_BIAS_SHIFT) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * FP8_SUBNORMAL_UNIT, normal)
    nan = tl.full(bits.shape, FP32_QUIET_NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    value = tl.where(magnitude == FP8_NAN_MAGNITUDE, nan, value)
    return tl.where(bits >= 0x80, -value, value)


# vLLM's packed caches (mla_ops/ops/cache_formats.py), read from their bytes: fp8_ds_mla rows hold 512
# e4m3 codes, 4 float32 scales (one per 128 codes) at byte 512, 64 bf16 rope values at byte 528.
DS_MLA_LATENT = tl.constexpr(512)
DS_MLA_TILE = tl.constexpr(128)
DS_MLA_SCALES_AT = tl.constexpr(512)
DS_MLA_ROPE_AT = tl.constexpr(528)


@triton.jit
def load_float32_bytes(ptrs, mask):
    """float32 values from 4 little-endian bytes at uint8 ``ptrs`` (0.0 where masked): byte loads need no
    alignment and run the same in the interpreter."""
    b0 = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
    b1 = tl.load(ptrs + 1, mask=mask, other=0).to(tl.int32)
    b2 = tl.load(ptrs + 2, mask=mask, other=0).to(tl.int32)
    b3 = tl.load(ptrs + 3, mask=mask, other=0).to(tl.int32)
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@triton.jit
def load_bfloat16_bytes(ptrs, mask):
    """bf16 values (as exact float32) from 2 little-endian bytes at uint8 ``ptrs`` (0.0 where masked)."""
    b0 = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
    b1 = tl.load(ptrs + 1, mask=mask, other=0).to(tl.int32)
    return ((b0 | (b1 << 8)) << 16).to(tl.float32, bitcast=True)


@triton.jit
def ds_mla_latent(row_ptrs, cols, mask):
    """float32 ``kv_c`` at latent columns ``cols`` (< 512) of fp8_ds_mla rows starting at uint8 ``row_ptrs``:
    code * its tile's scale, the float32 product every reader uses (0.0 where masked)."""
    codes = tl.load(row_ptrs + cols, mask=mask, other=0).to(tl.int32)
    scale = load_float32_bytes(row_ptrs + DS_MLA_SCALES_AT + 4 * (cols // DS_MLA_TILE), mask)
    return e4m3fn_to_float32(codes) * scale


@triton.jit
def ds_mla_rope(row_ptrs, cols, mask):
    """float32 ``k_pe`` at rope columns ``cols`` (0 .. 63) of fp8_ds_mla rows at uint8 ``row_ptrs``."""
    return load_bfloat16_bytes(row_ptrs + DS_MLA_ROPE_AT + 2 * cols, mask)


@triton.jit
def ds_mla_row(row_ptrs, cols, mask):
    """float32 ``[kv_c | k_pe]`` at columns ``cols`` (0 .. 575) of fp8_ds_mla rows (0.0 where masked)."""
    latent = cols < DS_MLA_LATENT
    return tl.where(latent, ds_mla_latent(row_ptrs, cols, mask & latent),
                    ds_mla_rope(row_ptrs, cols - DS_MLA_LATENT, mask & (cols >= DS_MLA_LATENT)))


@contextlib.contextmanager
def device_guard(tensor: torch.Tensor):
    """Run a launch where ``tensor`` lives; yields True under Triton's CPU interpreter, False on CUDA.

    A CUDA launch runs with ``tensor``'s device current (Triton launches on the current device,
    which may be another GPU). CPU tensors run only under ``TRITON_INTERPRET=1``.
    """
    if tensor.device.type == "cuda":
        with torch.cuda.device(tensor.device):
            yield False
    elif tensor.device.type == "cpu" and interpreting():
        yield True
    else:
        raise RuntimeError(
            "Triton kernels take CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before "
            f"mla_ops.triton is imported; got {tensor.device} tensors"
        )


def dot_dtype(dtype: torch.dtype, interpreted: bool, kernel: str):
    """The tl.dot operand dtype for ``dtype``; TypeError for dtypes the kernels don't take.

    The interpreter has no bf16 arithmetic, so bf16 is upcast to fp32 there.
    """
    if dtype not in DOT_DTYPES:
        raise TypeError(
            f"the Triton {kernel} kernel takes float16, bfloat16 or float32 q, got {dtype} "
            "(float64 runs on the torch reference)"
        )
    return tl.float32 if interpreted and dtype == torch.bfloat16 else DOT_DTYPES[dtype]


def dot_precision(dtype) -> str:
    """fp32 operands use "ieee" (no TF32), as torch does by default; the value is unused for 16-bit."""
    return "ieee" if dtype == tl.float32 else "tf32"


# Persistent launches: a kernel runs at most ``persistent_programs`` programs, each striding over
# the live tiles it reads from device counts, so a chunk without rows costs about one launch.
INTERPRETER_PROGRAMS = 1  # the interpreter runs programs one by one (one SM): more only add launch cost
PROGRAMS_OVERRIDE: int | None = None  # tests force tiny grids here


def persistent_programs(tensor: torch.Tensor, interpreted: bool, per_sm: int) -> int:
    """Programs of a persistent launch on ``tensor``'s device: ``per_sm`` (the kernel's occupancy) per SM."""
    if PROGRAMS_OVERRIDE is not None:
        return PROGRAMS_OVERRIDE
    if interpreted:
        return INTERPRETER_PROGRAMS
    return per_sm * _sm_count(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_grid(tile_capacity: int, programs: int) -> tuple[int]:
    """One program per tile up to ``programs``: the grid never exceeds the hardware, nor the tiles."""
    return (max(1, min(tile_capacity, programs)),)
