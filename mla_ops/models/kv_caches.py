"""The paged caches of a model step, as one record: ``KVCaches``.

latent  cache_layers x [num_blocks, block_size, L+R]   one latent row per token and attention (each layer at its
                                                      own L + R where its kind's differ: dots3_note's sliding layers)
index   index_layers x [num_blocks, block_size, D_I]   a sparse (DSA) model's index keys, one per full layer

Each part is a list of one tensor per layer, as engines that bind a cache to each attention layer keep them.
Every layer's cache then has the same metadata, which lets ``torch.compile`` reuse its work on one layer for the
next (a stacked tensor's layers differ in storage offset: docs/compile-and-graphs.md). A stacked tensor
``[layers, num_blocks, block_size, width]`` is taken in eager code (as its layers' views) and refused by name
under ``torch.compile``, whose writes into views of one buffer need a lowering torch lacks (pytorch#198068), but
by a model with stacked layers, which scans it and writes each run of layers into it whole
(``mla_ops.models.stacking``).

A sparse model's index cache lives beside its latent cache (DESIGN §12): the same blocks, block size and block
table, so one block id names a token's rows in both, and the block manager's prefix sharing and eviction
(``mla_ops.serving``) cover both at once. Only the layers with an indexer of their own have an index cache
(``MLAConfig.num_index_layers``: GLM-5's "shared" layers reuse another layer's top-k and allocate none).

How the caches are stored travels with them: their formats (``"auto"``, or vLLM's packed layouts) and the
scales of float8 caches, one for every layer or one per layer (as vLLM keeps them).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence, Union

import torch
from torch.utils import _pytree as pytree

from .. import _checks
from .._mla import DS_MLA_LATENT, DS_MLA_ROPE, DS_MLA_ROW_BYTES
from ..ops.cache_formats import INDEX_FORMATS, LATENT_FORMATS
from . import regions

Scale = Union[float, torch.Tensor]  # a float8 cache's dequantization scale: a float or a one-element float32 tensor


@dataclass(frozen=True)
class KVCaches:
    """A model's caches (``allocate_kv_caches``, or an engine's own tensors): ``latent`` one tensor per cache
    layer, ``index`` one per indexer layer (None: a dense model). ``kv_cache_format`` / ``index_cache_format``:
    ``"auto"`` (the model's dtype, or float8_e4m3fn with a scale) or vLLM's packed ``"fp8_ds_mla"`` /
    ``"fp8_per_token"`` (which store their own scales). ``k_scale`` / ``k_scale_index``: a float8 cache's
    scale (dequantized = stored * scale): None, one for every layer, or a list of one per layer."""

    latent: Sequence[torch.Tensor]
    index: Sequence[torch.Tensor] | None = None
    kv_cache_format: str = "auto"
    index_cache_format: str = "auto"
    k_scale: Scale | Sequence[Scale] | None = None
    k_scale_index: Scale | Sequence[Scale] | None = None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every cache tensor, latent then index (the blocks are dim -3 of each, stacked or not)."""
        parts = (self.latent,) if self.index is None else (self.latent, self.index)
        return tuple(t for part in parts for t in ((part,) if isinstance(part, torch.Tensor) else part))

    @property
    def num_blocks(self) -> int:
        return self.tensors[0].shape[-3]

    def __repr__(self) -> str:
        def part(tensors):
            if tensors is None or isinstance(tensors, torch.Tensor):
                return "None" if tensors is None else f"stacked {list(tensors.shape)} {tensors.dtype}"
            first = f" x {list(tensors[0].shape)} {tensors[0].dtype} on {tensors[0].device}" if tensors else ""
            return f"{len(tensors)}{first}"

        return (f"KVCaches(latent={part(self.latent)}, index={part(self.index)}, kv_cache_format="
                f"{self.kv_cache_format!r}, index_cache_format={self.index_cache_format!r}, k_scale={self.k_scale!r}, "
                f"k_scale_index={self.k_scale_index!r})")


_FORMATS = ("kv_cache_format", "index_cache_format")  # strings: the pytree's context, constants to torch.compile
_PARTS = tuple(f.name for f in fields(KVCaches) if f.name not in _FORMATS)
pytree.register_pytree_node(
    KVCaches,
    lambda c: ([getattr(c, n) for n in _PARTS], tuple(getattr(c, n) for n in _FORMATS)),
    lambda values, formats: KVCaches(**dict(zip(_PARTS, values)), **dict(zip(_FORMATS, formats))),
    serialized_type_name="mla_ops.KVCaches")


def as_kv_caches(caches) -> KVCaches:
    """``caches`` as a record: a plain list of tensors (or one stacked tensor) is ``KVCaches(latent=caches)``."""
    return caches if isinstance(caches, KVCaches) else KVCaches(latent=caches)


def grown(caches: KVCaches, bigger: KVCaches) -> KVCaches:
    """``bigger`` (``allocate_kv_caches`` with more blocks) holding ``caches``' rows in its first blocks:
    block ids, and the rows cached under them, stay valid."""
    for old, new in zip(caches.tensors, bigger.tensors):
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
        if c.sliding_attention is not None:
            raise ValueError("kv_cache_format='fp8_ds_mla' holds DeepSeek-V3.2's dims in every layer, but the model's "
                             "sliding layers (sliding_attention) have a geometry of their own")
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


def latent_widths(config, num_cache_layers: int, width: int) -> tuple[int, ...]:
    """Each cache layer's row width: ``width`` (``cache_widths``') for all, or each layer's own L + R in a model with
    sliding layers of another geometry (``MLAConfig.attention_dims``; their format is "auto")."""
    if config.sliding_attention is None:
        return (width,) * num_cache_layers
    return tuple(config.attention_dims(i).cache_width for i in config.latent_layers)


def allocate(config, num_cache_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype, device, *,
             kv_cache_format: str = "auto", index_cache_format: str = "auto", k_scale=None,
             k_scale_index=None, stacked: bool = False) -> KVCaches:
    """Zeroed caches of a model: one tensor per cache layer (and per index layer of a sparse model), uint8 in
    the packed formats; ``stacked``: the latent caches as one tensor ``[layers, num_blocks, block_size, width]``
    (one width). The scales are kept as given; the model checks them with the caches. ``num_blocks`` and
    ``block_size`` are ints in 1 .. 2**31 - 1 (block ids and slots meet int32 tensors), checked before anything is
    allocated."""
    num_blocks = _checks.check_int32_size(num_blocks, "num_blocks")
    block_size = _checks.check_int32_size(block_size, "block_size")
    if not isinstance(stacked, bool):
        raise TypeError(f"stacked must be a bool, got {type(stacked).__name__}")
    latent_width, index_width = cache_widths(config, kv_cache_format, index_cache_format)
    widths = latent_widths(config, num_cache_layers, latent_width)
    if stacked and len(set(widths)) > 1:
        raise ValueError(f"stacked=True needs one latent width for every cache layer, but this model's differ "
                         f"({sorted(set(widths))}): allocate one tensor per layer")

    def zeros(layers: int, width: int, packed: bool) -> list[torch.Tensor]:
        return [torch.zeros(num_blocks, block_size, width, dtype=torch.uint8 if packed else dtype, device=device)
                for _ in range(layers)]

    latent = [t for width in widths for t in zeros(1, width, kv_cache_format != "auto")]
    if stacked:
        latent = torch.stack(latent)
    index = zeros(config.num_index_layers, index_width, index_cache_format != "auto") if config.is_sparse else None
    return KVCaches(latent, index, kv_cache_format, index_cache_format, k_scale, k_scale_index)


def _check_layer_caches(caches, name: str, layers: int, width: int | tuple[int, ...],
                        scanned: bool = False) -> tuple[torch.Tensor, ...]:
    """``caches``: a list (or tuple) of ``layers`` tensors ``[num_blocks, block_size, width]`` of one block shape,
    dtype and device, ``width`` one for all or one per layer (in eager code, with one width, also one stacked
    ``[layers, num_blocks, block_size, width]``; under ``torch.compile`` where ``scanned``: a stacked model writes
    it whole, ``regions.run_stacked``). Returns the list."""
    widths = width if isinstance(width, tuple) else (width,) * layers
    width = widths[0] if widths and len(set(widths)) == 1 else "width"
    form = f"a list of {layers} [num_blocks, block_size, {width}]" + ("" if width != "width" else
                                                                      f" (widths {list(widths)})")
    if isinstance(caches, torch.Tensor):
        if caches.dim() != 4 or caches.shape[0] != layers or caches.shape[3] != width:
            raise ValueError(f"{name} must be {form}, got shape {tuple(caches.shape)} (see allocate_kv_caches)")
        return tuple(caches.unbind()) if scanned else regions.unstacked(caches, name, form)
    if not isinstance(caches, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in caches):
        raise TypeError(f"{name} must be {form}, got {type(caches).__name__} (see allocate_kv_caches)")
    if len(caches) != layers:
        raise ValueError(f"{name} must be {form}, got a list of {len(caches)}")
    first = caches[0] if caches else None
    for i, t in enumerate(caches):
        if t.dim() != 3 or t.shape[2] != widths[i] or t.shape[:2] != first.shape[:2] or t.dtype != first.dtype \
                or t.device != first.device:
            raise ValueError(f"{name}[{i}] must be [num_blocks, block_size, {widths[i]}] like {name}[0] "
                             f"({tuple(first.shape)} {first.dtype} on {first.device}), got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    _checks.check_own_memory(tuple(f"{name}[{i}]" for i in range(len(caches))), tuple(caches))
    return tuple(caches)


def check_caches(caches, config, num_cache_layers: int, model: tuple[torch.dtype, torch.device],
                 scanned: bool = False) -> KVCaches:
    """A model's caches, checked across every cache layer before any layer runs (a refused step writes
    nothing), returned as a record of tuples with one scale per layer (a float8 cache's as a tensor, else None):
    widths and formats the model holds (``cache_widths``), the model's dtype (or float8_e4m3fn, or uint8 in a
    packed format) and device, index caches on the latent caches' blocks, no two cache layers sharing memory, and
    the scales. (Checking the widths here also keeps them static under ``torch.compile(dynamic=True)``, where a
    layer's region would meet them symbolic.)"""
    if not isinstance(caches, (KVCaches, list, tuple, torch.Tensor)):
        raise TypeError(f"kv_caches must be a mla_ops.KVCaches (or a list of one tensor per cache layer), got "
                        f"{type(caches).__name__} (see allocate_kv_caches)")
    caches = as_kv_caches(caches)
    formats = (caches.kv_cache_format, caches.index_cache_format)
    latent_width, index_width = cache_widths(config, *formats)
    latent = _check_layer_caches(caches.latent, "kv_caches.latent", num_cache_layers,
                                 latent_widths(config, num_cache_layers, latent_width), scanned)
    parts = [("kv_caches.latent", latent, formats[0], caches.k_scale, "k_scale")]
    if config.is_sparse:
        if caches.index is None:
            raise ValueError("kv_caches.index is None, but a sparse (index_topk) model keeps index caches beside its "
                             "latent caches (see allocate_kv_caches)")
        index = _check_layer_caches(caches.index, "kv_caches.index", config.num_index_layers, index_width)
        if latent and index and (index[0].shape[:2] != latent[0].shape[:2] or index[0].device != latent[0].device):
            raise ValueError(f"kv_caches.index must have the latent cache's blocks {tuple(latent[0].shape[:2])} "
                             f"on {latent[0].device}, got {tuple(index[0].shape[:2])} on {index[0].device}")
        parts.append(("kv_caches.index", index, formats[1], caches.k_scale_index, "k_scale_index"))
    elif caches.index is not None or caches.k_scale_index is not None:
        raise ValueError("kv_caches.index and k_scale_index are a sparse (index_topk) model's; this model is dense")
    scales = []
    for name, part, fmt, scale, scale_name in parts:
        _check_model_dtype(part, name, torch.uint8 if fmt != "auto" else model[0], model[1])
        scales.append(_layer_scales(scale, scale_name, part, fmt))
    _check_no_shared_memory([(name, part) for name, part, *_ in parts])
    index, index_scales = (parts[1][1], scales[1]) if config.is_sparse else (None, None)
    return KVCaches(latent, index, *formats, scales[0], index_scales)


def _layer_scales(scale, name: str, caches: tuple[torch.Tensor, ...], fmt: str) -> tuple:
    """One checked scale per cache layer, as the kernels take it (a float8 cache's one-element tensor, else None):
    ``scale`` None, one value for every layer, or a list of one per layer."""
    per_layer = isinstance(scale, (list, tuple))
    if per_layer and len(scale) != len(caches):
        raise ValueError(f"{name} must be None, one scale, or a list of one per cache layer ({len(caches)}), got a "
                         f"list of {len(scale)}")
    if fmt != "auto":
        if scale is not None:
            raise ValueError(f"{name} is for a per-tensor float8_e4m3fn cache: the {fmt} format stores its own scales "
                             "(pass None)")
        return (None,) * len(caches)
    out = []
    for i, cache in enumerate(caches):
        value, label = (scale[i], f"{name}[{i}]") if per_layer else (scale, name)
        if value is None and cache.dtype == torch.float8_e4m3fn:
            raise ValueError(f"{label} is required for a float8_e4m3fn cache (dequantized = stored * {name})")
        if value is not None:
            _checks.check_scale(value, label, cache.device)
        out.append(_checks.k_scale_tensor(value, cache))
    return tuple(out)


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
    """No two cache layers alias: each layer's writes would land in the other's rows. Memory spans are compared, in
    eager code and under torch.compile alike (``_checks.check_disjoint_memory``); the views of one stacked tensor
    are disjoint."""
    named = [(f"{name}[{i}]", t) for name, part in parts for i, t in enumerate(part)]
    _checks.check_disjoint_memory(tuple(name for name, _ in named), tuple(t for _, t in named),
                                  "every cache layer needs memory of its own (allocate_kv_caches allocates one tensor "
                                  "per layer)")
