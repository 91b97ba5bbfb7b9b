"""DeepSeek-V2/V3 on the mla_ops operators: config (``MLAConfig``; ``hf_config`` reads config.json),
rotary embeddings (YaRN), mixture of experts, checkpoints (``checkpoint_files``: the files;
``checkpoint_names``: names and checks; ``checkpoint``: loading) and the model itself (``decoder``; LongCat-Flash's
layer: ``longcat``, imported here so that ``MLAModel`` knows it)."""

from .config import MLAConfig
from .decoder import MLAAttention, MLAForCausalLM, MLAModel
from . import longcat  # noqa: F401  (adds its layer to MLAModel.layer_classes)

__all__ = ["MLAAttention", "MLAConfig", "MLAForCausalLM", "MLAModel"]
