"""The MLA family (DESIGN §11) on the mla_ops operators. At the bottom, data: config (``MLAConfig`` and its optional
parts) on the scaling records of its fields (``scalings``). Above it the readers of config.json (``hf_config``;
``families`` says what each model type means, with the family files ``mistral4``, ``mistral_large4``,
``dots3_note``;
``wrappers``) and the model's parts: ``parts`` (small shared ones), rotary embeddings (``rope``), query scales
(``query_scale``), mixture of experts (``moe``), checkpoints (``checkpoint_files``: the files;
``checkpoint_names``: names and checks; ``checkpoint``: loading) and the model itself (``layer``: one decoder
layer and its attention; ``indexer``: DeepSeek Sparse Attention's lightning indexer; ``kv_caches``: the
caches a step takes; ``longcat``: LongCat-Flash's layer; ``decoder``: the model over its layers)."""

from .config import IndexerConfig, LayerKinds, MLAConfig, Scalings, SlidingAttention
from .decoder import MLAForCausalLM, MLAModel
from .kv_caches import KVCaches
from .layer import MLAAttention

__all__ = ["IndexerConfig", "KVCaches", "LayerKinds", "MLAAttention", "MLAConfig", "MLAForCausalLM", "MLAModel",
           "Scalings", "SlidingAttention"]
