"""Writing the new tokens' latent rows into the paged latent cache (vLLM's ``concat_and_cache_mla``).

kv_c          [T, L]        latent rows of the new tokens (after ``kv_a_layernorm``)
k_pe          [T, R]        rotated rope keys of the new tokens, dtype of kv_c
slot_mapping  [T] int64 or int32   flat cache slot of each token: block * block_size + offset;
                            a negative slot marks a padding token, which writes nothing
k_scale       [1] float32 or None   float8_e4m3fn caches store ``row / k_scale`` (saturated)
kv_cache      [num_blocks, block_size, L+R]   slot s is ``kv_cache[s // block_size, s % block_size]``
                            and receives ``[kv_c | k_pe]`` cast to the cache dtype (out=)

Two real tokens must not share a slot (which of them lands is then unspecified, as in vLLM);
slots past the end of the cache are rejected where the slots are readable (CPU), not on a GPU
(that would read device values).

Implementations: on CPU the torch reference below (the oracle); on CUDA the Triton kernel of
``mla_ops/triton/cache.py`` (one launch, slot arithmetic and fp8 quantization in the kernel),
falling back to the reference where Triton is not installed or for float64, which it doesn't take.
"""

from __future__ import annotations

import torch

from .._checks import FLOAT_DTYPES, check_k_scale, check_tensor, k_scale_tensor, values_readable
from .._env import triton_available

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

    # Padding tokens (slot < 0) are skipped without a host sync or a boolean-mask index: each one
    # repeats the write of the first real token (same slot, same row), so every slot that is
    # written more than once receives identical bytes and the unordered scatter is exact. In a
    # batch with no real token, every write goes to slot 0 and puts back the row it already holds.
    num_tokens = slot_mapping.shape[0]
    block_size = kv_cache.shape[1]
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


def check_write(kv_c, k_pe, slot_mapping, kv_cache, k_scale) -> None:
    """Every check of a ``write_latent_cache`` call; slots by value where readable (CPU)."""
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache must be a torch.Tensor [num_blocks, block_size, L+R], got {type(kv_cache).__name__}")
    device = kv_cache.device
    check_tensor(kv_cache, "kv_cache", 3, "[num_blocks, block_size, L+R]", device, "kv_cache")
    check_tensor(kv_c, "kv_c", 2, "[T, L]", device, "kv_cache")
    check_tensor(k_pe, "k_pe", 2, "[T, R]", device, "kv_cache")
    check_tensor(slot_mapping, "slot_mapping", 1, "[T]", device, "kv_cache")
    if kv_cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"kv_cache must be float16, bfloat16, float32, float64 or float8_e4m3fn, got {kv_cache.dtype}")
    if kv_c.dtype not in FLOAT_DTYPES:
        raise TypeError(f"kv_c must be float16, bfloat16, float32 or float64, got {kv_c.dtype}")
    if k_pe.dtype != kv_c.dtype:
        raise TypeError(f"k_pe must have the dtype of kv_c ({kv_c.dtype}), got {k_pe.dtype}")
    if slot_mapping.dtype not in _SLOT_DTYPES:
        raise TypeError(f"slot_mapping must be int64 or int32, got {slot_mapping.dtype}")
    num_tokens = kv_c.shape[0]
    if k_pe.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"kv_c, k_pe and slot_mapping must have one row per new token: kv_c has {num_tokens}, "
            f"k_pe {k_pe.shape[0]}, slot_mapping {slot_mapping.shape[0]}"
        )
    width = kv_c.shape[1] + k_pe.shape[1]
    if kv_cache.shape[2] != width:
        raise ValueError(
            f"kv_cache rows must be L+R = {kv_c.shape[1]}+{k_pe.shape[1]} = {width} wide "
            f"(kv_c and k_pe widths), got {kv_cache.shape[2]}"
        )
    check_k_scale(k_scale, kv_cache, device)
    check_slot_mapping(slot_mapping, kv_cache)


def check_slot_mapping(slot_mapping, kv_cache) -> None:
    """``slot_mapping`` [T] int64/int32 on the cache's device, its slots inside ``kv_cache``
    (``[..., num_blocks, block_size, L+R]``) by value where readable (CPU)."""
    check_tensor(slot_mapping, "slot_mapping", 1, "[T]", kv_cache.device, "kv_cache")
    if slot_mapping.dtype not in _SLOT_DTYPES:
        raise TypeError(f"slot_mapping must be int64 or int32, got {slot_mapping.dtype}")
    num_slots = kv_cache.shape[-3] * kv_cache.shape[-2]
    if slot_mapping.shape[0] and num_slots == 0:
        raise ValueError(f"kv_cache has no slots (shape {tuple(kv_cache.shape)}) to write "
                         f"{slot_mapping.shape[0]} tokens into")
    if slot_mapping.shape[0] and values_readable(slot_mapping):
        last = int(slot_mapping.max())
        if last >= num_slots:
            raise ValueError(f"slot_mapping holds slot {last}, past the {num_slots} slots of kv_cache")


def write_latent_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    k_scale: float | torch.Tensor | None = None,
) -> None:
    """Write ``[kv_c | k_pe]`` of token t into ``kv_cache`` at flat slot ``slot_mapping[t]``, in place.

    Tokens with a negative slot (padding) write nothing. A float8_e4m3fn cache needs ``k_scale``
    (a float or a one-element float32 tensor) and stores ``row / k_scale``, saturated to the fp8
    range; other caches store the row cast to their dtype and ignore ``k_scale``. Reads no device
    value on the host, so it is safe under CUDA graphs.
    """
    check_write(kv_c, k_pe, slot_mapping, kv_cache, k_scale)
    write_checked(kv_c, k_pe, slot_mapping, kv_cache, k_scale)


def write_checked(kv_c, k_pe, slot_mapping, kv_cache, k_scale) -> None:
    """``write_latent_cache`` after ``check_write`` (for callers that check everything first)."""
    _write_latent_cache_op(kv_c, k_pe, slot_mapping, k_scale_tensor(k_scale, kv_cache), kv_cache)
