"""Which implementation runs each operator: the ``backend=`` argument of ``run_prefill``.

Each op has one schema (``torch.ops.mla_ops.*``) and implementations with identical layouts:

* CPU: the torch reference (the oracle), or Triton under ``TRITON_INTERPRET=1`` when asked for;
* CUDA: Triton (registered here as the op's CUDA kernel, imported on first use), falling back to
  the torch reference where Triton is not installed or for float64, which the kernels don't take.

``backend="auto"`` and ``"triton"`` call the ops, so ``torch.compile`` sees them; ``"torch"`` on
a GPU calls the reference functions directly (eager checking; it reads lengths on the host);
``"flashmla"`` runs the absorbed path through the FlashMLA adapter (eager, SM90) and the rest as
``"auto"``. The table is selected once per call; nothing downstream infers a backend.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from .._env import interpreting, triton_available
from .absorbed import absorbed_reference, latent_attention_reference
from .attention import context_attention_reference, suffix_attention_reference
from .gather import gather_reference
from .merge import merge_states_reference
from .sparse import sparse_reference
from .up_projection import up_project_reference

BACKENDS = ("auto", "torch", "triton", "flashmla")


class Kernels(NamedTuple):
    """One implementation of every op (the reference, the op, or a Triton launcher)."""

    gather_context: Callable
    up_project: Callable
    context_attention: Callable
    suffix_attention: Callable
    merge_attn_states: Callable
    absorbed_context_attention: Callable
    latent_context_attention: Callable
    sparse_attention: Callable


REFERENCE = Kernels(
    gather_context=gather_reference,
    up_project=up_project_reference,
    context_attention=context_attention_reference,
    suffix_attention=suffix_attention_reference,
    merge_attn_states=merge_states_reference,
    absorbed_context_attention=absorbed_reference,
    latent_context_attention=latent_attention_reference,
    sparse_attention=sparse_reference,
)
OPS = Kernels(**{name: getattr(torch.ops.mla_ops, name).default for name in Kernels._fields})


@functools.cache
def triton_kernels() -> Kernels:
    from ..triton import absorbed, attention, gather, merge, rows_gemm, sparse

    return Kernels(
        gather_context=gather.gather_context,
        up_project=rows_gemm.up_project,
        context_attention=attention.context_attention,
        suffix_attention=attention.suffix_attention,
        merge_attn_states=merge.merge_attn_states,
        absorbed_context_attention=absorbed.absorbed_context_attention,
        latent_context_attention=absorbed.latent_context_attention,
        sparse_attention=sparse.sparse_attention,
    )


def select(backend: str, device: torch.device, absorbed_query_bound: int = 0) -> Kernels:
    """The kernels a step calls for ``backend`` on ``device`` (validated names only): chosen once per
    step (``step.begin_step``), with whatever the kernels schedule once per step.

    For ``"flashmla"``: ``absorbed_query_bound`` is the longest query of an absorbed request (FlashMLA's
    static ``s_q``: the plan's bound); the step's scheduler metadata is made here, filled by the first
    layer's call and reused by every later layer of the step.
    """
    if backend == "flashmla":
        from . import flashmla

        ok, reason = flashmla.available()
        if not ok:
            raise ValueError(f"backend='flashmla' is unavailable: {reason}")
        if torch.compiler.is_compiling():
            raise ValueError("backend='flashmla' runs eagerly; under torch.compile use 'auto' (Triton)")
        return select("auto", device)._replace(absorbed_context_attention=FlashMLAStep(absorbed_query_bound))
    if backend == "triton" and not triton_available():
        raise ValueError("backend='triton' needs the triton package (pip install 'mla-ops[triton]')")
    if device.type == "cpu":
        if backend != "triton":
            return OPS
        if not interpreting():
            raise ValueError(
                "backend='triton' on CPU tensors runs Triton's interpreter: set TRITON_INTERPRET=1 "
                "before importing mla_ops (or use backend='torch')"
            )
        return triton_kernels()
    if backend == "torch":
        if torch.compiler.is_compiling():
            raise ValueError("backend='torch' on a GPU is for eager checking; under torch.compile use 'auto'")
        return REFERENCE
    return OPS


class FlashMLAStep:
    """FlashMLA's absorbed partial for one step: its scheduler metadata is made here, filled by the first
    layer's call and reused by every later layer, so it is valid for one head count (``check_heads``)
    and one static ``s_q`` (the plan's ``absorbed_query_bound``; 0: T). Eager only, as FlashMLA is."""

    def __init__(self, absorbed_query_bound: int):
        from . import flashmla

        self.max_query_len = absorbed_query_bound or None
        self.metadata = flashmla.new_metadata()
        self.num_heads: int | None = None

    def check_heads(self, num_heads: int) -> None:
        if self.num_heads is None:
            self.num_heads = num_heads
        elif self.num_heads != num_heads:
            raise ValueError(f"q has {num_heads} heads, but the step's first layer had {self.num_heads}: a "
                             "backend='flashmla' step serves layers of one head count")

    def __call__(self, *args) -> None:
        from . import flashmla

        flashmla.absorbed_context_attention(*args, max_query_len=self.max_query_len, metadata=self.metadata)


def _cuda_kernel(name: str, reference: Callable) -> Callable:
    def kernel(*args):
        if not triton_available() or any(
            isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args
        ):
            return reference(*args)
        return getattr(triton_kernels(), name)(*args)

    kernel.__name__ = f"{name}_cuda"
    return kernel


for _name, _reference in REFERENCE._asdict().items():
    torch.library.register_kernel(f"mla_ops::{_name}", "cuda", _cuda_kernel(_name, _reference))
