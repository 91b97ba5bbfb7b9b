"""mla-ops: chunked-context Multi-head Latent Attention prefill as PyTorch 2 operators.

Importing registers the ``torch.ops.mla_ops`` operators; it changes no global configuration.
``mla_ops.enable()`` switches on the Inductor integration (see ``enable``).
"""

from ._source_tree import alias_lowering

alias_lowering(__path__)

from . import absorbed, backends, context_attention, gather, suffix_attention, up_projection  # noqa: F401  (ops)
from .cache import write_latent_cache
from .context_parallel import ContextParallel, shard_context
from .device_schedule import DeviceSchedule, plan_context_chunks_device
from .graphs import PrefillGraphs
from .generation import Generator, generate
from .layer import MLAAttention, MLAConfig, MLAForCausalLM, MLAModel
from .merge import merge_attn_states
from .plan import PrefillPlan, plan_prefill
from .prefill import mla_prefill, run_prefill
from . import routing
from .routing import route_context
from .schedule import ContextChunk, ContextSchedule, plan_context_chunks
from .validation import set_debug


def enable() -> dict:
    """Let Inductor fuse ``merge_attn_states`` and the device planner into its own kernels.

    Registers their decompositions in Inductor's table and installs a no-op post-grad pass
    (``torch._inductor.config.post_grad_custom_post_pass``, wrapping any pass already set) whose
    uuid hashes the lowering sources, so a changed lowering never reuses stale cached code.
    Idempotent; call it before ``torch.compile``. Returns what it registered.
    """
    from . import lowering

    return lowering.enable()


__all__ = [
    "enable",
    "ContextChunk",
    "ContextParallel",
    "ContextSchedule",
    "DeviceSchedule",
    "MLAAttention",
    "MLAConfig",
    "MLAForCausalLM",
    "MLAModel",
    "Generator",
    "generate",
    "merge_attn_states",
    "mla_prefill",
    "plan_context_chunks",
    "plan_context_chunks_device",
    "plan_prefill",
    "PrefillGraphs",
    "PrefillPlan",
    "route_context",
    "run_prefill",
    "set_debug",
    "shard_context",
    "write_latent_cache",
]
