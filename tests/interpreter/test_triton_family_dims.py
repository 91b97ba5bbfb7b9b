"""The Triton path at each MLA family's dims (DESIGN §11), under Triton's interpreter.

The released models' (L, P, R, V), scaled by 1/8 so the interpreter stays fast, keep their ratios: a
no-RoPE part wider than the value head (GLM), a latent of 256 (Mistral Small 4, MiniCPM3), no RoPE
at all (NoPE layers, R = 0). Every kernel of a step runs: the gather, the up-projection, the context
and suffix attentions, the absorbed path and the merge, on host and device plans.
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (make test does)", allow_module_level=True)
pytest.importorskip("triton")

import mla_ops  # noqa: E402
from tests.support.batches import dense_reference, make_batch  # noqa: E402

# family: released (L, P, R, V) // 8
FAMILY_DIMS = {
    "deepseek_v3": dict(L=64, P=16, R=8, V=16),  # 512, 128, 64, 128 (Kimi K2.x, LongCat-Flash too)
    "glm4_moe_lite": dict(L=64, P=24, R=8, V=32),  # 512, 192, 64, 256
    "mistral4": dict(L=32, P=8, R=8, V=16),  # 256, 64, 64, 128
    "minicpm3": dict(L=32, P=8, R=4, V=8),  # 256, 64, 32, 64
    "nope_layer": dict(L=64, P=16, R=0, V=16),  # Mistral Large 4's layers without RoPE
}
PLANS = {
    "host, chunked": dict(absorb_max_query_len=0),
    "host, routed": dict(absorb_max_query_len=2),
    "device, chunked": dict(absorb_max_query_len=0, max_chunks=6),
    "device, routed": dict(absorb_max_query_len=2, max_chunks=6, max_absorbed_tokens=8),
}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("family", list(FAMILY_DIMS))
def test_a_step_at_the_familys_dims(family, plan):
    """Outputs and LSEs (``return_lse=True``) against the dense float64 reference."""
    batch = make_batch([0, 9, 4, 0, 13], [2, 1, 5, 3, 2], seed=5, block_size=4, dtype=torch.float32, N=3,
                       **FAMILY_DIMS[family])
    step = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, 4, 6, **PLANS[plan])
    out, lse = mla_ops.run_prefill(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.kv_b_proj_weight,
                                   batch.softmax_scale, step, backend="triton", return_lse=True)
    expect, expect_lse = dense_reference(*batch.args(), return_lse=True)
    torch.testing.assert_close(out.double(), expect, rtol=0, atol=1e-4)
    torch.testing.assert_close(lse.double(), expect_lse, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["glm4_moe_lite", "nope_layer"])
def test_float16_at_the_familys_dims(family):
    batch = make_batch([7, 0, 10], [3, 2, 1], seed=6, block_size=4, dtype=torch.float16, **FAMILY_DIMS[family])
    out = batch.run(backend="triton", workspace_size=5, absorb_max_query_len=1, max_chunks=4)
    torch.testing.assert_close(out.double(), dense_reference(*batch.args()), rtol=0, atol=1e-2)
