"""mla-ops: chunked-context Multi-head Latent Attention prefill as PyTorch 2 operators.

Importing registers the ``torch.ops.mla_ops`` operators; it changes no global configuration.
``mla_ops.enable()`` switches on the Inductor integration (see ``enable``).
"""

from ._source_tree import alias_lowering

alias_lowering(__path__)

from . import ops  # noqa: E402,F401  (registers every op)
from ._checks import set_debug  # noqa: E402
from .models import KVCaches, MLAAttention, MLAConfig, MLAForCausalLM, MLAModel  # noqa: E402
from .ops.cache import write_index_cache, write_latent_cache  # noqa: E402
from .ops.indexer import index_topk  # noqa: E402
from .ops.merge import merge_attn_states  # noqa: E402
from .parallel import ContextParallel, CostModel, shard_context  # noqa: E402
from .planning import routing  # noqa: E402,F401
from .planning.device_schedule import DeviceSchedule, plan_context_chunks_device  # noqa: E402
from .planning.options import PlanOptions  # noqa: E402
from .planning.plan import PrefillPlan  # noqa: E402
from .planning.routing import route_context  # noqa: E402
from .planning.schedule import ContextChunk, ContextSchedule, plan_context_chunks  # noqa: E402
from .prefill import mla_prefill, plan_prefill, run_prefill  # noqa: E402
from .serving import Generator, PrefillGraphs, generate  # noqa: E402
from .step import PrefillStep, begin_step  # noqa: E402


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
    "begin_step",
    "enable",
    "ContextChunk",
    "ContextParallel",
    "ContextSchedule",
    "CostModel",
    "DeviceSchedule",
    "KVCaches",
    "MLAAttention",
    "MLAConfig",
    "MLAForCausalLM",
    "MLAModel",
    "Generator",
    "generate",
    "index_topk",
    "merge_attn_states",
    "mla_prefill",
    "plan_context_chunks",
    "plan_context_chunks_device",
    "plan_prefill",
    "PlanOptions",
    "PrefillGraphs",
    "PrefillPlan",
    "PrefillStep",
    "route_context",
    "run_prefill",
    "set_debug",
    "shard_context",
    "write_index_cache",
    "write_latent_cache",
]
