"""mla-ops: chunked-context Multi-head Latent Attention prefill as PyTorch 2 operators.

Importing registers the ``torch.ops.mla_ops`` operators; it changes no global configuration.
"""

from . import context_attention, gather, suffix_attention  # noqa: F401  (register the ops)
from .merge import merge_attn_states
from .prefill import mla_prefill
from .schedule import ContextChunk, ContextSchedule, plan_context_chunks

__all__ = [
    "ContextChunk",
    "ContextSchedule",
    "merge_attn_states",
    "mla_prefill",
    "plan_context_chunks",
]
