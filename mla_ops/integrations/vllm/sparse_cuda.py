"""DeepSeek Sparse Attention on CUDA: vLLM's ``FLASHMLA_SPARSE`` (its cache layout, bf16 or ``fp8_ds_mla``, its
indexer and its FlashMLA sparse decode kernel) with the prefills on mla-ops' sparse path, reading vLLM's top-k
buffer. ``register`` points ``AttentionBackendEnum.FLASHMLA_SPARSE`` here on CUDA (``plugin.SPARSE_BACKENDS``).

What ``DeepseekV32Attention`` (vLLM's CUDA model) needs, and gets from vLLM unchanged: its indexer writes each
step's top-k into the model's one buffer ``[max_num_batched_tokens, index_topk]`` int32, as positions in each
request (the convention of ``mla_ops.index_topk``), before the layer's attention; the sparse layers' impls hold
that buffer (``topk_indices_buffer``), GLM-5's shared layers included. The twin's builder plans each step's
prefills once (``plan_prefill(..., index_topk=)``, host form, from the CPU copies of the lengths) and marks
them for vLLM's MHA route (``prefill.use_dense_mha``), so vLLM hands the prefill tokens to ``forward_mha``:
``PrefillStep.attend`` with the buffer's rows of those tokens (sparse requests over their selected keys, read
in place, fp8_ds_mla dequantized as read; dense-routed ones exact). Decodes stay on FlashMLA sparse.

Written against every CUDA release in ``settings.RELEASES`` and contract-checked (``contract.SPARSE``); not yet
run on a GPU.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.quantization.utils.quant_utils import get_and_maybe_dequant_weights
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend as _StockFlashMLASparseBackend

import mla_ops

from . import settings


class SparsePlannedBuilder:
    """Mixed in before ``FlashMLASparseMetadataBuilder``: after vLLM's build, the step's prefills (requests
    ``num_decodes ..``) are planned with ``index_topk`` and begun against the group's cache, and routed to
    ``forward_mha``."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        self.mla_ops_layer = vllm_config.compilation_config.static_forward_context[layer_names[0]]
        self.mla_ops_format = "fp8_ds_mla" if vllm_config.cache_config.cache_dtype == "fp8_ds_mla" else "auto"
        self.mla_ops_options = mla_ops.PlanOptions(
            block_size=kv_cache_spec.block_size, index_topk=vllm_config.model_config.hf_text_config.index_topk,
            workspace_size=settings.workspace_size(self.chunked_prefill_workspace_size))

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if metadata.prefill is not None:
            m, first = common_attn_metadata, metadata.num_decodes
            starts = m.query_start_loc_cpu[first : m.num_reqs + 1]
            query_start_loc = (starts - starts[0]).to(torch.int32)
            context_lens = (m.seq_lens_cpu_upper_bound[first : m.num_reqs] - query_start_loc.diff()).to(torch.int32)
            plan = mla_ops.plan_prefill(query_start_loc, context_lens, m.block_table_tensor[first : m.num_reqs],
                                        options=self.mla_ops_options)
            metadata.prefill.mla_ops_step = mla_ops.begin_step(plan, self.mla_ops_layer.kv_cache,
                                                               kv_cache_format=self.mla_ops_format)
            metadata.prefill.use_dense_mha = True  # vLLM's MHA route: the prefill tokens go to forward_mha
        return metadata


class SparsePrefillImpl:
    """Mixed in before ``FlashMLASparseImpl``: ``forward_mha`` (the step's prefill tokens, after its decodes)
    attends over vLLM's top-k buffer rows of those tokens; ``forward_mqa`` (decodes) stays FlashMLA sparse."""

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        super().process_weights_after_loading(act_dtype)
        self.mla_ops_kv_b_proj = get_and_maybe_dequant_weights(self.kv_b_proj, out_dtype=act_dtype)

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                    output_scale=None) -> None:
        first = attn_metadata.num_decode_tokens  # the buffer holds the step's tokens, decodes first
        attn_metadata.prefill.mla_ops_step.attend(
            q, kv_c_normed, k_pe.squeeze(1), kv_c_and_k_pe_cache, self.mla_ops_kv_b_proj, self.scale,
            topk_indices=self.topk_indices_buffer[first : first + q.shape[0]],
            out=output.view(-1, self.num_heads, self.v_head_dim))


def sparse_cuda_twin(backend: type) -> type:
    """The mla-ops twin of vLLM's FLASHMLA_SPARSE: same name, layouts and decode kernel; prefills on mla-ops."""
    here = {"__module__": __name__}
    builder = type(f"MLAOps{backend.get_builder_cls().__name__}", (SparsePlannedBuilder, backend.get_builder_cls()),
                   here)
    impl = type(f"MLAOps{backend.get_impl_cls().__name__}", (SparsePrefillImpl, backend.get_impl_cls()), here)
    return type(f"MLAOps{backend.__name__}", (backend,), {
        **here, "get_builder_cls": staticmethod(lambda: builder), "get_impl_cls": staticmethod(lambda: impl)})


FlashMLASparseBackend = sparse_cuda_twin(_StockFlashMLASparseBackend)
