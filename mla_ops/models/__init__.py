"""DeepSeek-V2/V3 on the mla_ops operators: config, rotary embeddings (YaRN), mixture of experts,
checkpoint loading and the model itself (``deepseek``)."""

from .config import MLAConfig
from .deepseek import MLAAttention, MLAForCausalLM, MLAModel

__all__ = ["MLAAttention", "MLAConfig", "MLAForCausalLM", "MLAModel"]
