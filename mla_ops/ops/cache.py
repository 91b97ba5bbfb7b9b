"""Writing the new tokens' rows into a paged cache: the latent cache (vLLM's ``concat_and_cache_mla``)
and DSA's index cache (DESIGN §12), through one op and one kernel.

kv_c          [T, L]        latent rows of the new tokens (after ``kv_a_layernorm``)
k_pe          [T, R]        rotated rope keys of the new tokens, dtype of kv_c; R may be 0
slot_mapping  [T] int64 or int32   flat cache slot of each token: block * block_size + offset;
                            a negative slot marks a padding token, which writes nothing
k_scale       [1] float32 or None   float8_e4m3fn caches store ``row / k_scale`` (saturated)
kv_cache      [num_blocks, block_size, L+R]   slot s is ``kv_cache[s // block_size, s % block_size]``
                            and receives ``[kv_c | k_pe]`` cast to the cache dtype (out=)

The index cache is the same write with R = 0 (``write_index_cache``: ``k_index [T, D_I]`` in the
place of kv_c, a width-0 view of it as k_pe, rows ``[k_index]`` into ``index_cache [num_blocks,
block_size, D_I]`` with ``k_scale_index``): the two caches share the block table, the slot mapping
and the block size, so a step writes both with the same ``slot_mapping``. NoPE layers (R = 0) write
their latent rows the same way.

Two real tokens must not share a slot (which of them lands is then unspecified, as in vLLM);
slots past the end of the cache are rejected where the slots are readable (CPU), not on a GPU
(that would read device values).

Implementations: on CPU the torch reference below (the oracle); on CUDA the Triton kernel of
``mla_ops/triton/cache.py`` (one launch, slot arithmetic and fp8 quantization in the kernel),
falling back to the reference where Triton is not installed or for float64, which it doesn't take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import FLOAT_DTYPES, check_scale, check_tensor, k_scale_tensor, values_readable
from .._env import triton_available
from .._mla import DS_MLA_LATENT, DS_MLA_ROPE
from .cache_formats import (check_index_format, check_latent_format, check_per_token_width, ds_mla_rows, index_width,
                            per_token_quantize, per_token_row_bytes, per_token_views)

CACHE_DTYPES = FLOAT_DTYPES + (torch.float8_e4m3fn,)
_SLOT_DTYPES = (torch.int64, torch.int32)


def write_latent_cache_reference(kv_c, k_pe, slot_mapping, k_scale, kv_cache) -> None:
    rows = torch.cat([kv_c, k_pe], dim=-1)  # [T, L+R]
    if kv_cache.dtype == torch.float8_e4m3fn:
        fp8_max = torch.finfo(torch.float8_e4m3fn).max
        rows = (rows.float() / k_scale.float()).clamp(-fp8_max, fp8_max)  # saturate, as vLLM
    rows = rows.to(kv_cache.dtype)
    target = kv_cache
    if kv_cache.dtype == torch.float8_e4m3fn:  # move bytes: float8 indexing kernels vary by device/version
        rows, target = rows.view(torch.uint8), kv_cache.view(torch.uint8)
    scatter_rows(rows, slot_mapping, target)


def scatter_rows(rows: torch.Tensor, slot_mapping: torch.Tensor, target: torch.Tensor) -> None:
    """``rows`` [T, width] into ``target`` [num_blocks, block_size, width] at ``slot_mapping`` [T]
    (negative: padding, written nothing), on the device without a host read."""
    # Padding tokens (slot < 0) are skipped without a host sync or a boolean-mask index: each one
    # repeats the write of the first real token (same slot, same row), so every slot that is
    # written more than once receives identical bytes and the unordered scatter is exact. In a
    # batch with no real token, every write goes to slot 0 and puts back the row it already holds.
    num_tokens = slot_mapping.shape[0]
    block_size = target.shape[1]
    slot = slot_mapping.long()
    valid = slot >= 0  # [T]
    first = torch.cat([valid, valid.new_ones(1)]).int().argmax()  # first real token, T if none
    source = torch.where(valid, torch.arange(num_tokens, device=slot.device), first)  # [T] in [0, T]
    slot = torch.cat([slot, slot.new_zeros(1)])[source]  # [T], all >= 0
    block, offset = slot // block_size, slot % block_size
    rows = torch.cat([rows, target[:1, 0]])[source]  # [T, L+R]; row T: what slot 0 holds now
    target.index_put_((block, offset), rows)  # strided caches work: no flattened view


@torch.library.custom_op("mla_ops::write_latent_cache", mutates_args=("kv_cache",))
def _write_latent_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    kv_cache: torch.Tensor,
) -> None:
    write_latent_cache_reference(kv_c, k_pe, slot_mapping, k_scale, kv_cache)


@_write_latent_cache.register_fake
def _(kv_c, k_pe, slot_mapping, k_scale, kv_cache) -> None:
    return None


def _write_latent_cache_cuda(kv_c, k_pe, slot_mapping, k_scale, kv_cache) -> None:
    """The op's CUDA kernel: Triton (imported on first use), else the reference (as backends._cuda_kernel)."""
    if not triton_available() or torch.float64 in (kv_c.dtype, k_pe.dtype, kv_cache.dtype):
        write_latent_cache_reference(kv_c, k_pe, slot_mapping, k_scale, kv_cache)
        return
    from ..triton.cache import write_latent_cache as triton_write_latent_cache

    triton_write_latent_cache(kv_c, k_pe, slot_mapping, k_scale, kv_cache)


torch.library.register_kernel("mla_ops::write_latent_cache", "cuda", _write_latent_cache_cuda)

_write_latent_cache_op = torch.ops.mla_ops.write_latent_cache.default


def write_packed_cache_reference(rows, rope, slot_mapping, cache, cache_format: str) -> None:
    """A packed format's write (``cache_formats``): ``fp8_ds_mla`` rows ``[rows | rope]`` = ``[kv_c | k_pe]``,
    or ``fp8_per_token`` keys ``rows`` = ``k_index`` (``rope`` unused), quantized as vLLM does."""
    if cache_format == "fp8_ds_mla":
        scatter_rows(ds_mla_rows(rows, rope), slot_mapping, cache)
        return
    codes, scale = per_token_quantize(rows)
    code_view, scale_view = per_token_views(cache)
    scatter_rows(codes, slot_mapping, code_view)
    scatter_rows(scale.contiguous().view(torch.uint8), slot_mapping, scale_view)  # [T, D/128 * 4] bytes


@torch.library.custom_op("mla_ops::write_packed_cache", mutates_args=("cache",))
def _write_packed_cache(
    rows: torch.Tensor, rope: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor, cache_format: str
) -> None:
    write_packed_cache_reference(rows, rope, slot_mapping, cache, cache_format)


@_write_packed_cache.register_fake
def _(rows, rope, slot_mapping, cache, cache_format) -> None:
    return None


_write_packed_cache_op = torch.ops.mla_ops.write_packed_cache.default


@dataclass(frozen=True)
class CacheNames:
    """The argument names a write's messages use: the latent cache's call or the index cache's."""

    rows: str  # the rows written (before the rope part)
    rows_shape: str
    rope: str | None  # None: the call has no rope part (R = 0 by construction)
    cache: str
    cache_shape: str
    width: str  # the cache row width's symbol
    scale: str


LATENT = CacheNames("kv_c", "[T, L]", "k_pe", "kv_cache", "[num_blocks, block_size, L+R]", "L+R", "k_scale")
INDEX = CacheNames("k_index", "[T, D_I]", None, "index_cache", "[num_blocks, block_size, D_I]", "D_I", "k_scale_index")


def check_write(kv_c, k_pe, slot_mapping, kv_cache, k_scale, names: CacheNames = LATENT,
                cache_format: str = "auto") -> None:
    """Every check of a cache write (``write_latent_cache``; ``write_index_cache`` with ``names=INDEX``
    and ``k_pe=None``): the rows (``check_write_rows``), the scale, the slots by value where readable (CPU).
    Messages use ``names``."""
    n = names
    cache_format = check_write_rows(kv_c, k_pe, slot_mapping, kv_cache, n, cache_format)
    if cache_format != "auto":
        if k_scale is not None:
            raise ValueError(f"{n.scale} is for a per-tensor float8_e4m3fn {n.cache}: {cache_format} stores its own "
                             "scales (pass None)")
    elif kv_cache.dtype == torch.float8_e4m3fn and k_scale is None:
        raise ValueError(f"{n.scale} is required for a float8_e4m3fn {n.cache} (dequantized = stored * {n.scale})")
    elif k_scale is not None:  # checked when given, even where the cache dtype ignores it
        check_scale(k_scale, n.scale, kv_cache.device)
    check_slot_mapping(slot_mapping, kv_cache, n.cache)


def check_write_rows(kv_c, k_pe, slot_mapping, kv_cache, names: CacheNames = LATENT,
                     cache_format: str = "auto") -> str:
    """A write's rows against its cache (in ``cache_format``, returned) and the slot mapping's length: shapes,
    dtypes and layouts only, no value read. What a step's layer checks of its write (``PrefillStep``):
    ``begin_step`` checked the slots and the scales once."""
    n = names
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"{n.cache} must be a torch.Tensor {n.cache_shape}, got {type(kv_cache).__name__}")
    if n.rope is None:
        cache_format = check_index_format(cache_format, kv_cache)
    else:
        cache_format = check_latent_format(cache_format, kv_cache)
    device = kv_cache.device
    check_tensor(kv_cache, n.cache, 3, n.cache_shape, device, n.cache)
    check_tensor(kv_c, n.rows, 2, n.rows_shape, device, n.cache)
    if n.rope is not None:
        check_tensor(k_pe, n.rope, 2, "[T, R]", device, n.cache)
    check_slot_tensor(slot_mapping, device, n.cache)
    if kv_c.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{n.rows} must be float16, bfloat16, float32 or float64, got {kv_c.dtype}")
    if n.rope is not None and k_pe.dtype != kv_c.dtype:
        raise TypeError(f"{n.rope} must have the dtype of {n.rows} ({kv_c.dtype}), got {k_pe.dtype}")
    if cache_format != "auto":
        check_packed_rows(kv_c, k_pe, kv_cache, n, cache_format)
    elif kv_cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"{n.cache} must be float16, bfloat16, float32, float64 or float8_e4m3fn, got {kv_cache.dtype}")
    num_tokens = kv_c.shape[0]
    rope_tokens, rope_width = (num_tokens, 0) if n.rope is None else k_pe.shape
    if rope_tokens != num_tokens or slot_mapping.shape[0] != num_tokens:
        listed = f"{n.rows}{'' if n.rope is None else f', {n.rope}'} and slot_mapping"
        rope_count = "" if n.rope is None else f"{n.rope} {rope_tokens}, "
        raise ValueError(
            f"{listed} must have one row per new token: {n.rows} has {num_tokens}, "
            f"{rope_count}slot_mapping {slot_mapping.shape[0]}"
        )
    width = kv_c.shape[1] + rope_width
    if cache_format == "auto" and kv_cache.shape[2] != width:
        size, why = ((f"{width}", f"the width of {n.rows}") if n.rope is None else
                     (f"{kv_c.shape[1]}+{rope_width} = {width}", f"{n.rows} and {n.rope} widths"))
        raise ValueError(f"{n.cache} rows must be {n.width} = {size} wide ({why}), got {kv_cache.shape[2]}")
    return cache_format


def check_packed_rows(kv_c, k_pe, cache, n: CacheNames, cache_format: str) -> None:
    """A packed format's rows (``cache_formats``): the widths the format fixes."""
    if cache_format == "fp8_ds_mla":
        if kv_c.shape[1] != DS_MLA_LATENT or k_pe.shape[1] != DS_MLA_ROPE:
            raise ValueError(f"kv_cache_format='fp8_ds_mla' stores L = {DS_MLA_LATENT} and R = {DS_MLA_ROPE}: "
                             f"{n.rows} must be [T, {DS_MLA_LATENT}] and {n.rope} [T, {DS_MLA_ROPE}], got "
                             f"{list(kv_c.shape)} and {list(k_pe.shape)}")
    else:
        check_per_token_width(kv_c.shape[1], f"{n.rows}'s D_I")
        if kv_c.shape[1] != index_width(cache):
            raise ValueError(f"index_cache_format='fp8_per_token' rows are D_I + D_I/128*4 bytes: {n.rows} is "
                             f"[T, {kv_c.shape[1]}], so {n.cache} rows must be {per_token_row_bytes(kv_c.shape[1])} "
                             f"wide, got {cache.shape[2]}")


def check_slot_tensor(slot_mapping, device: torch.device, cache_name: str = "kv_cache") -> None:
    """``slot_mapping`` [T] int64/int32 on ``device``, the cache's (``cache_name``)."""
    check_tensor(slot_mapping, "slot_mapping", 1, "[T]", device, cache_name)
    if slot_mapping.dtype not in _SLOT_DTYPES:
        raise TypeError(f"slot_mapping must be int64 or int32, got {slot_mapping.dtype}")


def check_slot_mapping(slot_mapping, kv_cache, cache_name: str = "kv_cache") -> None:
    """``slot_mapping`` [T] int64/int32 on the cache's device, its slots inside ``kv_cache``
    (``[..., num_blocks, block_size, width]``) by value where readable (CPU); ``cache_name`` names it."""
    check_slot_tensor(slot_mapping, kv_cache.device, cache_name)
    num_slots = kv_cache.shape[-3] * kv_cache.shape[-2]
    if slot_mapping.shape[0] and num_slots == 0:
        raise ValueError(f"{cache_name} has no slots (shape {tuple(kv_cache.shape)}) to write "
                         f"{slot_mapping.shape[0]} tokens into")
    if slot_mapping.shape[0] and values_readable(slot_mapping):
        last = int(slot_mapping.max())
        if last >= num_slots:
            raise ValueError(f"slot_mapping holds slot {last}, past the {num_slots} slots of {cache_name}")


def write_latent_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    k_scale: float | torch.Tensor | None = None,
    *,
    kv_cache_format: str = "auto",
) -> None:
    """Write ``[kv_c | k_pe]`` of token t into ``kv_cache`` at flat slot ``slot_mapping[t]``, in place.

    Tokens with a negative slot (padding) write nothing. A float8_e4m3fn cache needs ``k_scale``
    (a float or a one-element float32 tensor) and stores ``row / k_scale``, saturated to the fp8
    range; other caches store the row cast to their dtype and ignore ``k_scale``. ``k_pe`` may be
    ``[T, 0]`` (a NoPE layer). ``kv_cache_format="fp8_ds_mla"``: ``kv_cache`` [num_blocks, block_size, 656]
    uint8 in vLLM's DeepSeek-V3.2 layout (``kv_c`` [T, 512], ``k_pe`` [T, 64], no ``k_scale``: a scale per
    128 values is stored in the row; ``mla_ops/ops/cache_formats.py``). Reads no device value on the host,
    so it is safe under CUDA graphs.
    """
    check_write(kv_c, k_pe, slot_mapping, kv_cache, k_scale, cache_format=kv_cache_format)
    write_checked(kv_c, k_pe, slot_mapping, kv_cache, k_scale, kv_cache_format)


def write_index_cache(
    k_index: torch.Tensor,
    slot_mapping: torch.Tensor,
    index_cache: torch.Tensor,
    k_scale_index: float | torch.Tensor | None = None,
    *,
    index_cache_format: str = "auto",
) -> None:
    """Write DSA's index key ``k_index[t]`` into ``index_cache`` at flat slot ``slot_mapping[t]``, in place.

    k_index [T, D_I] (rotated; float16/bfloat16/float32/float64), slot_mapping [T] int64/int32 (the
    latent cache's: both caches share the block table and block size; negative = padding, writes
    nothing), index_cache [num_blocks, block_size, D_I]: bf16/fp16/fp32, or float8_e4m3fn with
    ``k_scale_index`` (a float or a one-element float32 tensor; stores ``k_index / k_scale_index``,
    saturated). The latent cache's op and kernel with a rope part of width 0; safe under CUDA graphs.
    ``index_cache_format="fp8_per_token"``: ``index_cache`` [num_blocks, block_size, D_I + D_I/128*4] uint8 in
    vLLM's indexer layout (D_I a multiple of 128, one float32 scale per 128 values, block-major; no
    ``k_scale_index``).
    """
    check_write(k_index, None, slot_mapping, index_cache, k_scale_index, INDEX, index_cache_format)
    write_checked(k_index, k_index[:, :0], slot_mapping, index_cache, k_scale_index, index_cache_format)


def write_checked(kv_c, k_pe, slot_mapping, kv_cache, k_scale, cache_format: str = "auto") -> None:
    """``write_latent_cache`` after ``check_write`` (for callers that check everything first)."""
    if cache_format != "auto":
        _write_packed_cache_op(kv_c, k_pe, slot_mapping, kv_cache, cache_format)
        return
    _write_latent_cache_op(kv_c, k_pe, slot_mapping, k_scale_tensor(k_scale, kv_cache), kv_cache)
