"""The vLLM plugin's switches and refusals that need no vLLM (mla_ops/integrations/vllm/settings.py); the
plugin in the real engine is tests/integrations/vllm (``make test-vllm``)."""

import pytest

from mla_ops.integrations.vllm import settings

DEEPSEEK = dict(model="tiny", use_mla=True, kv_lora_rank=512, qk_rope_head_dim=64, index_topk=None,
                kv_cache_dtype="auto")


@pytest.mark.parametrize("value, on", [(None, False), ("", False), ("0", False), ("1", True)])
def test_enabled_only_by_one(value, on):
    assert settings.enabled({} if value is None else {"MLA_OPS_VLLM": value}) is on


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1"])
def test_enabled_refuses_other_values(value):
    with pytest.raises(ValueError, match="MLA_OPS_VLLM must be 1"):
        settings.enabled({"MLA_OPS_VLLM": value})


def test_workspace_defaults_to_vllms_and_is_overridden():
    assert settings.workspace_size(65536, {}) == 65536
    assert settings.workspace_size(65536, {"MLA_OPS_VLLM_WORKSPACE": "64"}) == 64


@pytest.mark.parametrize("value", ["0", "-16", "1e3", "64 rows", "abc"])
def test_workspace_refuses_malformed(value):
    with pytest.raises(ValueError, match="MLA_OPS_VLLM_WORKSPACE must be a positive number"):
        settings.workspace_size(65536, {"MLA_OPS_VLLM_WORKSPACE": value})


def test_version_pinned_per_platform():
    settings.check_version("0.32.0", "cpu")
    settings.check_version("0.32.0+cu130", "cuda")  # a local build label is the same release
    with pytest.raises(RuntimeError, match=r"vLLM 0\.32\.0's private MLA classes on cpu, and this is vLLM 0\.31\.2"):
        settings.check_version("0.31.2", "cpu")
    with pytest.raises(RuntimeError, match="not on vLLM's 'RocmPlatform' platform"):
        settings.check_version("0.32.0", "RocmPlatform")


def test_deepseek_rows_served():
    settings.check_model("cpu", **DEEPSEEK)
    settings.check_model("cuda", **{**DEEPSEEK, "kv_cache_dtype": "fp8"})


@pytest.mark.parametrize("change, match", [
    (dict(use_mla=False), "has no MLA attention"),
    (dict(index_topk=2048), r"DeepSeek Sparse Attention \(DSA\) model \(index_topk=2048\)"),
    (dict(kv_lora_rank=256), "= 320; on cpu the plugin serves 576"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8'; on cpu the plugin serves auto"),
    (dict(decode_context_parallel_size=2), "decode_context_parallel_size=2"),
    (dict(prefill_query_quantization=True), "use_prefill_query_quantization"),
])
def test_model_refused_by_name(change, match):
    with pytest.raises(ValueError, match=match):
        settings.check_model("cpu", **{**DEEPSEEK, **change})
