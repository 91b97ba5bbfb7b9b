"""up_project: the workspace's live latent rows times kv_b_proj_weight^T, rows past the chunk's
count untouched; with gather_context, their Triton kernels on a GPU. (Its opcheck is in
tests/planning/test_device_schedule.py, beside the device planner's.)

latent [W, L] (a view of the workspace)   weight [N*(P+V), L]   cu_seq_lens [B+1]   -> out [W, N*(P+V)]
"""

import pytest
import torch

import mla_ops  # noqa: F401  (registers torch.ops.mla_ops)
from mla_ops.ops.backends import REFERENCE
from tests.support.batches import paged_block_table
from tests.support.gpu import DEVICE, needs_cuda

NAN = float("nan")


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("lens", [[3, 0, 5], [0, 0], [9]])
def test_up_project_writes_the_live_rows_only(lens, dtype, tol):
    g = torch.Generator().manual_seed(len(lens))
    workspace = torch.randn(12, 10 + 4, generator=g).to(dtype)  # [W, L+R]: the latent is a strided view
    weight = torch.randn(2 * 7, 10, generator=g).to(dtype) / 3  # N=2, P+V=7
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.full((12, 2 * 7), NAN, dtype=dtype)
    torch.ops.mla_ops.up_project(workspace[:, :10], weight, cu, out)
    rows = int(cu[-1])
    expect = workspace[:rows, :10].double() @ weight.double().t()
    torch.testing.assert_close(out[:rows].double(), expect, atol=tol, rtol=tol)
    assert torch.isnan(out[rows:]).all(), "rows past cu_seq_lens[-1] are not computed"


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_gather_and_up_project_kernels(fp8):
    g = torch.Generator(device=DEVICE).manual_seed(1)
    cache = torch.randn(300, 64, 576, generator=g, device=DEVICE).to(torch.bfloat16)
    k_scale = None
    if fp8:
        k_scale = torch.tensor([0.05], device=DEVICE)
        cache = (cache.float() / 0.05).to(torch.float8_e4m3fn)
    _, table = paged_block_table([70] * 4, torch.Generator().manual_seed(1), spare_blocks=20)  # 300 blocks
    table = table.to(DEVICE)
    cu = torch.tensor([0, 1000, 1000, 3000, 3100], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([64, 0, 130, 0], dtype=torch.int32, device=DEVICE)
    weight = torch.randn(16 * 256, 512, generator=g, device=DEVICE).to(torch.bfloat16) / 20
    results = []
    for gather, up in ((torch.ops.mla_ops.gather_context, torch.ops.mla_ops.up_project),
                       (REFERENCE.gather_context, REFERENCE.up_project)):
        workspace = torch.full((4096, 576), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        kv = torch.full((4096, 16 * 256), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        gather(cache, table, cu, starts, k_scale, workspace)
        up(workspace[:, :512], weight, cu, kv)
        results.append((workspace, kv))
    assert torch.equal(results[0][0][:3100], results[1][0][:3100])
    assert torch.isnan(results[0][0][3100:]).all() and torch.isnan(results[0][1][3100:]).all()
    torch.testing.assert_close(results[0][1][:3100].float(), results[1][1][:3100].float(), atol=3e-2, rtol=3e-2)
