"""How a model's layers are wired to its caches and to one another: decided once, from the config, when the model
is built (``MLAModel.wiring``), so a step only follows it.

Per layer (``LayerWiring``): the cache layers its attentions attend (its own, one per attention, or a KV-sharing
layer's source's), the row width it reads there (its kind's L + R; L for a NoPE layer), its attention kind (the step
it runs on: dots3_note's sliding layers have their own), its index cache (a layer with an indexer of
its own), whether it selects a top-k or reuses the last full layer's (GLM-5's "shared" layers), and whose new
latent rows it attends or keeps for a later layer (Mistral Large 4's KV sharing).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .config import MLAConfig
from .kv_caches import KVCaches
from .layer import AttentionCaches, Carry, LayerCaches, NewRows


class Passed(NamedTuple):
    """What a step's layers have made so far that later layers take."""

    topk: torch.Tensor | None = None  # the last full DSA layer's selection
    rows: dict = {}  # layer -> the new (kv_c, k_pe) of a layer whose cache a later layer attends


class LayerWiring(NamedTuple):
    layer: int
    latent: tuple[int, ...]  # the cache layers its attentions attend (own, or its KV source's)
    width: int  # the latent row width it reads: L + R (L for a NoPE layer)
    index: int | None  # its index cache (a layer with an indexer of its own), or None
    source: int | None  # a KV-sharing layer: the layer whose new rows it attends; None: its own
    reuses_topk: bool  # a shared DSA layer: it attends the last full layer's top-k
    keeps_rows: bool  # a later layer attends its cache: its new rows are passed on
    kind: int = 0  # its attention kind (MLAConfig.attention_dims): the step it runs on

    def caches(self, kv_caches: KVCaches) -> LayerCaches:
        """This layer's view of the step's checked caches (``kv_caches.check_caches``: one scale per layer)."""
        index = None if self.index is None else kv_caches.index[self.index]
        index_scale = None if self.index is None else kv_caches.k_scale_index[self.index]
        return tuple(AttentionCaches(_narrowed(kv_caches.latent[i], self.width), kv_caches.k_scale[i], index,
                                     index_scale) for i in self.latent)

    def carry(self, passed: Passed) -> Carry:
        """What this layer is handed: only what it takes (a region's inputs then match across layers)."""
        return Carry(passed.topk if self.reuses_topk else None, passed.rows.get(self.source))

    def passed_on(self, passed: Passed, made: NewRows) -> Passed:
        """``passed`` with what this layer made that later layers take."""
        topk = passed.topk if made.topk is None else made.topk
        return Passed(topk, {**passed.rows, self.layer: made.latent[0]} if self.keeps_rows else passed.rows)


def _narrowed(cache: torch.Tensor, width: int) -> torch.Tensor:
    """A NoPE layer reads the first L columns of its L+R rows (a packed uint8 cache never holds a NoPE layer)."""
    return cache if cache.shape[-1] == width or cache.dtype == torch.uint8 else cache.narrow(-1, 0, width)


def wire_layers(config: MLAConfig, kv_caches_per_layer: list[int]) -> tuple[LayerWiring, ...]:
    """Every layer's wiring; ``kv_caches_per_layer``: the latent caches each layer owns (one per attention, 0 for
    a KV-sharing layer)."""
    c = config
    sources = c.layer_kinds.kv_source_layers or ()
    own, first, index = {}, 0, 0
    wiring = []
    for i, n in enumerate(kv_caches_per_layer):
        own[i] = tuple(range(first, first + n))
        first += n
        source = c.kv_source(i)
        dims = c.attention_dims(i)
        wiring.append(LayerWiring(
            layer=i, latent=own[source][:1] if source != i else own[i],
            width=dims.kv_lora_rank + dims.qk_rope_head_dim, index=index if c.has_indexer(i) else None,
            source=None if source == i else source, reuses_topk=c.reuses_topk(i),
            keeps_rows=i in sources[i + 1:], kind=dims.kind))
        index += c.has_indexer(i)
    return tuple(wiring)
