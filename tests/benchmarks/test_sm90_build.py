"""benchmarks/sm90_build.py builds kernels for sm_90 without a GPU (Triton's own ptxas and cuobjdump)."""

import os

import pytest

triton = pytest.importorskip("triton")
if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
    pytest.skip("this Triton wheel ships no CUDA tools", allow_module_level=True)

from benchmarks import sm90_build  # noqa: E402
from mla_ops.triton import rows_gemm  # noqa: E402

pytestmark = pytest.mark.bench


def test_rows_gemm_builds_pipelined_on_tensor_cores_without_spills():
    rows = sm90_build.main(["--only", "up_projection", "absorbed_fold", "absorbed_unfold", "--models", "deepseek_v3"])
    assert [r["kernel"] for r in rows] == ["up_projection", "absorbed_fold", "absorbed_unfold"]
    for r in rows:
        assert r["wgmma"] and r["async_copies"] and r["stack"] == 0 and r["local"] == 0, r
        # PROGRAMS_PER_SM of them fit an H200 SM's 228 KB of shared memory, as the persistent grid assumes
        assert r["shared_bytes"] * rows_gemm.PROGRAMS_PER_SM <= 228 * 1024, r
