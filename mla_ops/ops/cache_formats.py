"""The engine cache layouts mla-ops reads in place (DESIGN §12 "Production cache formats").

Latent cache, ``kv_cache_format``:

* ``"auto"``: ``[num_blocks, block_size, L+R]`` bf16/fp16/fp32, or float8_e4m3fn with one
  per-tensor ``k_scale`` (DESIGN §2).
* ``"fp8_ds_mla"``: vLLM's DeepSeek-V3.2 layout (FlashMLA's sparse layout), ``[num_blocks,
  block_size, 656]`` uint8, L = 512 and R = 64 fixed. A row's bytes: ``[0, 512)`` the float8_e4m3fn
  codes of ``kv_c``, ``[512, 528)`` four float32 scales (one per 128 values), ``[528, 656)`` the 64
  ``k_pe`` values in bf16. Value = code * its tile's scale; ``k_pe`` is exact.

Index cache, ``index_cache_format``:

* ``"auto"``: ``[num_blocks, block_size, D_I]`` bf16/fp16/fp32, or float8_e4m3fn with ``k_scale_index``.
* ``"fp8_per_token"``: vLLM's indexer layout, ``[num_blocks, block_size, D_I + D_I/128*4]`` uint8 (132 at
  V3.2's D_I = 128, 264 at 256) read as block-major bytes: a block's first ``block_size * D_I`` bytes are its
  tokens' float8_e4m3fn codes (token i at ``i * D_I``), the next ``block_size * D_I/128 * 4`` bytes their
  float32 scales, one per 128 values (vLLM's ``quant_block_size``; token i's tile j at
  ``block_size * D_I + 4 (i * D_I/128 + j)``). D_I must be a multiple of 128, as vLLM's indexer requires.

Writes quantize as vLLM's kernels do (csrc/cache_kernels.cu): ``concat_and_cache_ds_mla_kernel``:
per 128-value tile ``scale = max(amax / 448, FLT_MIN)`` (float32, stored as is); ``indexer_k_quant_and_cache``
with V3.2's ``scale_fmt="ue8m0"``, per 128-value tile: ``scale = exp2(ceil(log2(max(amax, 1e-4) / 448)))``; both store
``fp8(x / scale)``, float32 division then round-to-nearest-even saturated to +-448
(``__nv_cvt_float_to_fp8(.., __NV_SATFINITE, __NV_E4M3)``).

A uint8 cache is one of these formats (no plain cache is uint8), so the ops below the public calls
know the layout from the dtype; the public keywords declare it and are checked against the cache once.
"""

from __future__ import annotations

import torch

from .._checks import check_own_memory
from .._mla import DS_MLA_LATENT, DS_MLA_ROPE, DS_MLA_ROW_BYTES, DS_MLA_TILE, INDEX_TILE

LATENT_FORMATS = ("auto", "fp8_ds_mla")
INDEX_FORMATS = ("auto", "fp8_per_token")
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
_FLT_MIN = torch.finfo(torch.float32).tiny
_SCALE_BYTES = 4  # a float32 scale


def _fp8_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 codes of float8_e4m3fn(x / scale), float32 division, saturated (vLLM's scaled_convert)."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def ds_mla_rows(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """[T, 656] uint8 fp8_ds_mla rows of ``kv_c`` [T, 512] and ``k_pe`` [T, 64] (any float dtype)."""
    num_tokens = kv_c.shape[0]
    tiles = kv_c.float().view(num_tokens, -1, DS_MLA_TILE)  # [T, 4, 128]
    scale = (tiles.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(_FLT_MIN)  # [T, 4, 1]
    codes = _fp8_codes(tiles, scale).view(num_tokens, DS_MLA_LATENT)
    scale_bytes = scale.view(num_tokens, -1).contiguous().view(torch.uint8)  # [T, 16], native (little) endian
    rope_bytes = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)  # [T, 128]
    return torch.cat([codes, scale_bytes, rope_bytes], dim=1)


def ds_mla_values(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., 576] ``dtype``: the dequantized ``[kv_c | k_pe]`` of fp8_ds_mla rows [..., 656] uint8."""
    lead = rows.shape[:-1]
    rows = rows.reshape(-1, DS_MLA_ROW_BYTES)
    codes = rows[:, :DS_MLA_LATENT].view(torch.float8_e4m3fn).float().view(-1, DS_MLA_LATENT // DS_MLA_TILE,
                                                                          DS_MLA_TILE)
    scale_end = DS_MLA_LATENT + _SCALE_BYTES * (DS_MLA_LATENT // DS_MLA_TILE)
    scale = rows[:, DS_MLA_LATENT:scale_end].contiguous().view(torch.float32).unsqueeze(-1)  # [n, 4, 1]
    latent = (codes * scale).view(-1, DS_MLA_LATENT).to(dtype)  # the float32 product: every reader's value
    rope = rows[:, scale_end:].contiguous().view(torch.bfloat16).to(dtype)
    return torch.cat([latent, rope], dim=1).view(*lead, DS_MLA_LATENT + DS_MLA_ROPE)


def per_token_row_bytes(width: int) -> int:
    """Bytes a token takes in an fp8_per_token cache of D_I = ``width`` (a multiple of 128): its codes and
    its D_I/128 float32 scales."""
    return width + width // INDEX_TILE * _SCALE_BYTES


def per_token_width(row_bytes: int) -> int:
    """D_I of fp8_per_token rows of ``row_bytes`` (``per_token_row_bytes``' inverse; 0 for no such D_I)."""
    tile_bytes = INDEX_TILE + _SCALE_BYTES
    return row_bytes // tile_bytes * INDEX_TILE if row_bytes % tile_bytes == 0 else 0


def check_per_token_width(width: int, name: str) -> None:
    """D_I = ``width`` (``name`` says whose) a positive multiple of 128, the layout's tile (vLLM's indexer
    refuses the others)."""
    if width <= 0 or width % INDEX_TILE:
        raise ValueError(f"index_cache_format='fp8_per_token' stores one float32 scale per {INDEX_TILE} values "
                         f"(vLLM's indexer layout): it needs D_I a multiple of {INDEX_TILE}, but {name} is {width}")


def per_token_quantize(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [T, D] uint8, scale [T, D/128] float32)`` of index keys ``k`` [T, D]: one ue8m0 scale per
    128-value tile of a key."""
    x = k.float().unflatten(-1, (-1, INDEX_TILE))  # [T, D/128, 128]
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(-1, keepdim=True).clamp_min(1e-4) / FP8_MAX)))
    return _fp8_codes(x, scale).flatten(-2), scale.squeeze(-1)


def per_token_views(index_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of an fp8_per_token ``index_cache`` [num_blocks, block_size, D + D/128*4] uint8: ``(codes
    [num_blocks, block_size, D] uint8, scale_bytes [num_blocks, block_size, D/128*4] uint8)``, block-major."""
    num_blocks, block_size, stride = index_cache.shape
    width = per_token_width(stride)
    scale_width = stride - width
    flat = index_cache.flatten(1, 2)  # [num_blocks, block_size * stride]: a block's bytes, in order
    codes = flat.narrow(1, 0, block_size * width).unflatten(1, (block_size, width))
    scale_bytes = flat.narrow(1, block_size * width, block_size * scale_width).unflatten(1, (block_size,
                                                                                             scale_width))
    return codes, scale_bytes


def per_token_rows(index_cache: torch.Tensor, block: torch.Tensor, offset: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """[n, D] ``dtype``: dequantized keys at cache ``(block, offset)`` [n] of an fp8_per_token cache."""
    codes, scale_bytes = per_token_views(index_cache)
    keys = codes[block, offset].view(torch.float8_e4m3fn).float().unflatten(-1, (-1, INDEX_TILE))  # [n, D/128, 128]
    scale = scale_bytes[block, offset].contiguous().view(torch.float32).unsqueeze(-1)  # [n, D/128, 1]
    return (keys * scale).flatten(-2).to(dtype)


def latent_rows(kv_cache: torch.Tensor, block: torch.Tensor, offset: torch.Tensor, k_scale: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """[..., L+R] ``dtype``: the latent cache's rows at ``(block, offset)``, dequantized, in any format."""
    if kv_cache.dtype == torch.uint8:
        return ds_mla_values(kv_cache[block, offset], dtype)
    if kv_cache.dtype == torch.float8_e4m3fn:  # move bytes: float8 indexing kernels vary by device/version
        rows = kv_cache.view(torch.uint8)[block, offset].view(torch.float8_e4m3fn)
        return rows.to(dtype) * k_scale.to(dtype)
    return kv_cache[block, offset].to(dtype)


def index_rows(index_cache: torch.Tensor, block: torch.Tensor, offset: torch.Tensor, k_scale: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    """[n, D_I] ``dtype``: the index cache's keys at ``(block, offset)`` [n], dequantized, in any format."""
    if index_cache.dtype == torch.uint8:
        return per_token_rows(index_cache, block, offset, dtype)
    return latent_rows(index_cache, block, offset, k_scale, dtype)


def latent_width(kv_cache: torch.Tensor) -> int:
    """L+R of a latent cache: its row width, or 576 for fp8_ds_mla's 656 bytes."""
    return DS_MLA_LATENT + DS_MLA_ROPE if kv_cache.dtype == torch.uint8 else kv_cache.shape[-1]


def index_width(index_cache: torch.Tensor) -> int:
    """D_I of an index cache: its row width, less fp8_per_token's scale bytes (0: no D_I fits the width)."""
    return per_token_width(index_cache.shape[-1]) if index_cache.dtype == torch.uint8 else index_cache.shape[-1]


def check_latent_format(kv_cache_format, kv_cache: torch.Tensor, name: str = "kv_cache") -> str:
    """``kv_cache_format`` one of LATENT_FORMATS and ``kv_cache`` laid out as it says (dtype, width), each element
    in memory of its own (not ``expand``ed: a write would land in every block)."""
    if not isinstance(kv_cache_format, str) or kv_cache_format not in LATENT_FORMATS:
        raise ValueError(f"kv_cache_format must be one of {LATENT_FORMATS}, got {kv_cache_format!r}")
    check_own_memory((name,), (kv_cache,))
    if kv_cache_format == "fp8_ds_mla":
        if kv_cache.dtype != torch.uint8:
            raise TypeError(f"kv_cache_format='fp8_ds_mla' needs a uint8 {name} ([num_blocks, block_size, "
                            f"{DS_MLA_ROW_BYTES}] bytes), got {kv_cache.dtype}")
        if kv_cache.shape[-1] != DS_MLA_ROW_BYTES:
            raise ValueError(f"kv_cache_format='fp8_ds_mla' rows are {DS_MLA_ROW_BYTES} bytes (512 fp8 of kv_c, "
                             f"4 float32 scales, 64 bf16 of k_pe), but {name} rows are {kv_cache.shape[-1]} wide")
        if kv_cache.stride(-1) != 1:
            raise ValueError(f"kv_cache_format='fp8_ds_mla' needs {name}'s rows contiguous (stride 1 on the last "
                             f"dim), got strides {kv_cache.stride()}")
    elif kv_cache.dtype == torch.uint8:
        raise TypeError(f"a uint8 {name} is a packed format: pass kv_cache_format='fp8_ds_mla' (vLLM's "
                        "DeepSeek-V3.2 layout) or a bf16/fp16/fp32/float8_e4m3fn cache")
    return kv_cache_format


def check_index_format(index_cache_format, index_cache: torch.Tensor) -> str:
    """``index_cache_format`` one of INDEX_FORMATS and ``index_cache`` laid out as it says, each element in memory
    of its own."""
    if not isinstance(index_cache_format, str) or index_cache_format not in INDEX_FORMATS:
        raise ValueError(f"index_cache_format must be one of {INDEX_FORMATS}, got {index_cache_format!r}")
    check_own_memory(("index_cache",), (index_cache,))
    if index_cache_format == "fp8_per_token":
        if index_cache.dtype != torch.uint8:
            raise TypeError("index_cache_format='fp8_per_token' needs a uint8 index_cache ([num_blocks, "
                            f"block_size, D_I + D_I/128*4] bytes), got {index_cache.dtype}")
        if per_token_width(index_cache.shape[-1]) == 0:
            raise ValueError("index_cache_format='fp8_per_token' rows are D_I + D_I/128*4 bytes (D_I fp8 codes and "
                             f"a float32 scale per {INDEX_TILE} values, D_I a multiple of {INDEX_TILE}: 132 bytes "
                             f"at D_I = 128, 264 at 256), but index_cache rows are {index_cache.shape[-1]}")
        if index_cache.stride(-1) != 1 or index_cache.stride(-2) != index_cache.shape[-1]:
            raise ValueError("index_cache_format='fp8_per_token' is block-major: index_cache's blocks must be "
                             f"contiguous (strides [*, {index_cache.shape[-1]}, 1]), got {index_cache.stride()}")
    elif index_cache.dtype == torch.uint8:
        raise TypeError("a uint8 index_cache is a packed format: pass index_cache_format='fp8_per_token' "
                        "(vLLM's indexer layout) or a bf16/fp16/fp32/float8_e4m3fn cache")
    return index_cache_format
