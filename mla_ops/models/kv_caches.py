"""The paged caches of a model step: a dense MLA model's latent caches, or a sparse (DSA) model's ``DSACaches``.

dense   kv_caches        cache_layers x [num_blocks, block_size, L+R]     one latent row per token and layer
sparse  DSACaches.latent cache_layers x [num_blocks, block_size, L+R]     the same
        DSACaches.index  index_layers x [num_blocks, block_size, D_I]     one index key per token and full layer

Each is a list of one tensor per layer, as engines that bind a cache to each attention layer keep them. Every
layer's cache then has the same metadata, which lets ``torch.compile`` reuse its work on one layer for the
next (a stacked tensor's layers differ in storage offset: docs/compile-and-graphs.md). A stacked tensor
``[layers, num_blocks, block_size, width]`` is taken in eager code (as its layers' views) and refused by name
under ``torch.compile``, whose writes into views of one buffer need a lowering torch lacks (pytorch#198068).

A sparse model's index cache lives beside its latent cache (DESIGN §12): the same blocks, block size and block
table, so one block id names a token's rows in both, and the block manager's prefix sharing and eviction
(``mla_ops.serving``) cover both at once. Only the layers with an indexer of their own have an index cache
(``MLAConfig.num_index_layers``: GLM-5's "shared" layers reuse another layer's top-k and allocate none).
``DSACaches`` is a NamedTuple, so torch.compile and pytrees take it as its tensors.

The helpers below let the serving code treat every form alike: its tensors, its geometry, growing it.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence, Union

import torch

from .. import _checks
from .._mla import DS_MLA_LATENT, DS_MLA_ROPE, DS_MLA_ROW_BYTES
from ..ops.cache_formats import INDEX_FORMATS, LATENT_FORMATS
from . import regions

LayerCaches = Sequence[torch.Tensor]  # one [num_blocks, block_size, W] per layer (eager code: or stacked)


class DSACaches(NamedTuple):
    latent: LayerCaches  # [cache_layers, num_blocks, block_size, L+R]
    index: LayerCaches  # [index_layers, num_blocks, block_size, D_I]

    @property
    def dtype(self) -> torch.dtype:
        return cache_tensors(self)[0].dtype

    @property
    def device(self) -> torch.device:
        return cache_tensors(self)[0].device

    @property
    def num_blocks(self) -> int:
        return cache_tensors(self)[0].shape[-3]


Caches = Union[LayerCaches, DSACaches]


def cache_tensors(caches: Caches) -> tuple[torch.Tensor, ...]:
    """The tensors of a step's caches (the blocks are dim -3 of each, stacked or not)."""
    parts = caches if isinstance(caches, DSACaches) else (caches,)
    return tuple(t for part in parts for t in ((part,) if isinstance(part, torch.Tensor) else part))


def grown(caches: Caches, bigger: Caches) -> Caches:
    """``bigger`` (``allocate_kv_caches`` with more blocks) holding ``caches``' rows in its first blocks:
    block ids, and the rows cached under them, stay valid."""
    for old, new in zip(cache_tensors(caches), cache_tensors(bigger)):
        new.narrow(-3, 0, old.shape[-3]).copy_(old)
    return bigger


def cache_widths(config, kv_cache_format: str, index_cache_format: str) -> tuple[int, int]:
    """``(latent row width, index row width)`` of a model's caches in these formats (DESIGN §12): L+R and D_I (0
    for a dense model), or vLLM's packed 656 bytes (DeepSeek-V3.2's dims only) and D_I + D_I/32 bytes."""
    c = config
    for name, value, choices in (("kv_cache_format", kv_cache_format, LATENT_FORMATS),
                                 ("index_cache_format", index_cache_format, INDEX_FORMATS)):
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    latent = c.kv_lora_rank + c.qk_rope_head_dim
    if kv_cache_format == "fp8_ds_mla":
        nope_layers = c.layer_kinds.no_rope_layers is not None
        if (c.kv_lora_rank, c.qk_rope_head_dim) != (DS_MLA_LATENT, DS_MLA_ROPE) or nope_layers:
            raise ValueError(f"kv_cache_format='fp8_ds_mla' holds kv_lora_rank {DS_MLA_LATENT} and qk_rope_head_dim "
                             f"{DS_MLA_ROPE} in every layer (DeepSeek-V3.2's), but the model has "
                             f"{c.kv_lora_rank} and {c.qk_rope_head_dim}{' with NoPE layers' if nope_layers else ''}")
        latent = DS_MLA_ROW_BYTES
    if not c.is_sparse:
        if index_cache_format != "auto":
            raise ValueError(f"index_cache_format={index_cache_format!r} is for a sparse (index_topk) model's index "
                             "caches")
        return latent, 0  # no index cache
    width = c.indexer.index_head_dim
    if index_cache_format == "fp8_per_token" and width % 128:
        raise ValueError(f"index_cache_format='fp8_per_token' needs index_head_dim a multiple of 128, got {width}")
    return latent, width + (width // 32 if index_cache_format == "fp8_per_token" else 0)  # a float32 per 128


def allocate(layers: int, num_blocks: int, block_size: int, width: int, dtype, device) -> LayerCaches:
    """Zeroed caches of ``layers`` layers: a list of one tensor per layer."""
    return [torch.zeros(num_blocks, block_size, width, dtype=dtype, device=device) for _ in range(layers)]


def _check_layer_caches(caches, name: str, layers: int, width: int) -> tuple[torch.Tensor, ...]:
    """``caches``: a list (or tuple) of ``layers`` tensors ``[num_blocks, block_size, width]`` of one shape, dtype
    and device (in eager code also one stacked ``[layers, num_blocks, block_size, width]``). Returns the list."""
    form = f"a list of {layers} [num_blocks, block_size, {width}]"
    if isinstance(caches, torch.Tensor):
        if caches.dim() != 4 or caches.shape[0] != layers or caches.shape[3] != width:
            raise ValueError(f"{name} must be {form}, got shape {tuple(caches.shape)} (see allocate_kv_caches)")
        return regions.unstacked(caches, name, form)
    if not isinstance(caches, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in caches):
        raise TypeError(f"{name} must be {form}, got {type(caches).__name__} (see allocate_kv_caches)")
    if len(caches) != layers:
        raise ValueError(f"{name} must be {form}, got a list of {len(caches)}")
    first = caches[0] if caches else None
    for i, t in enumerate(caches):
        if t.dim() != 3 or t.shape[2] != width or t.shape != first.shape or t.dtype != first.dtype \
                or t.device != first.device:
            raise ValueError(f"{name}[{i}] must be [num_blocks, block_size, {width}] like {name}[0] "
                             f"({tuple(first.shape)} {first.dtype} on {first.device}), got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    return tuple(caches)


def check_caches(caches, num_cache_layers: int, width: int, index: tuple[int, int] | None = None,
                 model: tuple[torch.dtype, torch.device] | None = None,
                 packed: tuple[bool, bool] = (False, False)) -> Caches:
    """A model's caches (``allocate_kv_caches``), returned as tuples of per-layer tensors: rows ``width`` (L+R)
    wide; ``index`` None for a dense model (its latent caches), else (index layers, D_I) of a ``DSACaches``
    whose two parts share the block geometry and device. ``model``: the model's (dtype, device), which every
    cache must have (float8_e4m3fn also: its scale is checked with the step). No two cache layers may share
    memory. All of it is checked here, across every cache layer, before any layer runs: a refused step writes
    nothing. (Checking the widths here also keeps them static under ``torch.compile(dynamic=True)``, where a
    layer's region would meet them symbolic.) ``packed``: the latent and index caches are in vLLM's packed
    formats (uint8, ``cache_widths``) rather than the model's dtype."""
    if index is None:
        if isinstance(caches, DSACaches):
            raise TypeError("kv_caches is a DSACaches, but this dense model takes its latent caches alone")
        latent = _check_layer_caches(caches, "kv_caches", num_cache_layers, width)
        parts = (("kv_caches", latent),)
    else:
        if not isinstance(caches, DSACaches):
            raise TypeError(f"kv_caches must be a DSACaches (latent, index) for a sparse (index_topk) model, got "
                            f"{type(caches).__name__} (see allocate_kv_caches)")
        latent = _check_layer_caches(caches.latent, "kv_caches.latent", num_cache_layers, width)
        index_caches = _check_layer_caches(caches.index, "kv_caches.index", *index)
        if latent and index_caches and (index_caches[0].shape[:2] != latent[0].shape[:2]
                                        or index_caches[0].device != latent[0].device):
            raise ValueError(f"kv_caches.index must have the latent cache's blocks {tuple(latent[0].shape[:2])} "
                             f"on {latent[0].device}, got {tuple(index_caches[0].shape[:2])} on "
                             f"{index_caches[0].device}")
        parts = (("kv_caches.latent", latent), ("kv_caches.index", index_caches))
    if model is not None:
        for (name, part), is_packed in zip(parts, packed):
            _check_model_dtype(part, name, torch.uint8 if is_packed else model[0], model[1])
    _check_no_shared_memory(parts)
    return latent if index is None else DSACaches(latent, index_caches)


def _check_model_dtype(caches: tuple[torch.Tensor, ...], name: str, dtype: torch.dtype, device: torch.device) -> None:
    """Every layer's cache has the model's dtype (or float8_e4m3fn) and device (their layers agree already)."""
    if not caches:
        return
    first = caches[0]
    if first.dtype not in (dtype, torch.float8_e4m3fn):
        _checks.raise_type_error(f"{name} must have the model's dtype ({dtype}) or float8_e4m3fn, got "
                                 f"{first.dtype} (allocate_kv_caches allocates the model's)")
    if first.device != device:
        _checks.raise_value_error(f"{name} must be on the model's device ({device}), got {first.device}")


def _check_no_shared_memory(parts) -> None:
    """No two cache layers alias: each layer's writes would land in the other's rows. In eager code, tensors
    whose memory spans overlap in one storage are refused (the views of one stacked tensor are disjoint);
    under torch.compile, whose fake tensors have no addresses, the same tensor twice."""
    named = [(f"{name}[{i}]", t) for name, part in parts for i, t in enumerate(part)]
    if regions.checked_distinct_when_traced(named):
        return
    spans = []  # (where, first byte, end byte, name): addresses on a device, or offsets in a storage without any
    for name, t in named:
        if t.numel():
            extent = (sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1) * t.element_size()
            if type(t) is torch.Tensor and t.device.type != "meta":  # memory with addresses (two storages may alias)
                where, start = str(t.device), t.data_ptr()
            else:  # meta or fake: the storage object, the offset in it
                where, start = f"storage {t.untyped_storage()._cdata}", t.storage_offset() * t.element_size()
            spans.append((where, start, start + extent, name))
    spans.sort()
    for (where, _, end, other), (next_where, next_start, _, name) in zip(spans, spans[1:]):
        if where == next_where and next_start < end:
            raise ValueError(f"{name} shares memory with {other}: every cache layer needs memory of its own "
                             "(allocate_kv_caches allocates one tensor per layer)")
