"""The MLA family (DESIGN §11) on the mla_ops operators: config (``MLAConfig`` and its optional parts; ``hf_config``
reads config.json, ``families`` says what each model type means),
rotary embeddings (YaRN), mixture of experts, checkpoints (``checkpoint_files``: the files;
``checkpoint_names``: names and checks; ``checkpoint``: loading) and the model itself (``layer``: one decoder
layer and its attention; ``indexer``: DeepSeek Sparse Attention's lightning indexer; ``kv_caches``: the
caches a step takes; ``longcat``: LongCat-Flash's layer; ``decoder``: the model over its layers)."""

from .config import IndexerConfig, LayerKinds, MLAConfig, Scalings
from .decoder import MLAForCausalLM, MLAModel
from .kv_caches import KVCaches
from .layer import MLAAttention

__all__ = ["IndexerConfig", "KVCaches", "LayerKinds", "MLAAttention", "MLAConfig", "MLAForCausalLM", "MLAModel",
           "Scalings"]
