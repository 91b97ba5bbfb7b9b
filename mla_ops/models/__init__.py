"""DeepSeek-V2/V3 on the mla_ops operators: config (``MLAConfig``; ``hf_config`` reads config.json),
rotary embeddings (YaRN), mixture of experts, checkpoints (``checkpoint_files``: the files;
``checkpoint_names``: names and checks; ``checkpoint``: loading) and the model itself (``deepseek``)."""

from .config import MLAConfig
from .decoder import MLAAttention, MLAForCausalLM, MLAModel

__all__ = ["MLAAttention", "MLAConfig", "MLAForCausalLM", "MLAModel"]
