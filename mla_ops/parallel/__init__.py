"""Context parallel (DESIGN §10): the latent cache sharded over a ``torch.distributed`` group.

config (``ContextParallel``, ``CostModel``) · layout (``shard_context``, ``slot_mapping``) · plan (each
rank's part of the step's plan) · collectives · run (the context partial across ranks) · tensor_parallel
(a model's weights over the same group).
"""

from .config import ContextParallel, CostModel
from .layout import local_context_lens, shard_context

__all__ = ["ContextParallel", "CostModel", "local_context_lens", "shard_context"]
