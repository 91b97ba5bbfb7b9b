"""The CUDA backends: vLLM's TRITON_MLA and FLASHMLA (their decode kernels, cache layouts and CUDA graphs
of decode-only batches) with the prefills on mla-ops' Triton kernels, the absorbed path on FlashMLA under
FLASHMLA. vLLM runs MLA attention as one opaque custom op outside its compiled graph pieces, and captures
full CUDA graphs of decode-only batches alone, so the host-form plan and the chunk loop run eagerly inside
that op. ``register`` points the two ``AttentionBackendEnum`` members here.

Written against every CUDA release in ``settings.RELEASES``; not yet run on a GPU (benchmarks/gpu_check.sh has
the step).
"""

from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend as _StockFlashMLABackend
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend as _StockTritonMLABackend

from .attention import with_mla_ops

TritonMLABackend = with_mla_ops(_StockTritonMLABackend, "triton")
FlashMLABackend = with_mla_ops(_StockFlashMLABackend, "flashmla")
