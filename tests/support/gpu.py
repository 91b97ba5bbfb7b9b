"""What the GPU tests share: the skip mark, tolerances, and an absorbed-attention batch at
DeepSeek's dims checked on the GPU against the torch reference on CPU.

Every GPU test is marked ``@pytest.mark.cuda`` (``pytest -m cuda`` selects them) and
``@needs_cuda`` (skipped without a CUDA device or without triton).
"""

import importlib.util

import pytest
import torch

from mla_ops.ops.backends import REFERENCE
from tests.support.batches import context_batch, written_rows

DEVICE = "cuda"
TOL = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}

_WHY = ("needs a CUDA device" if not torch.cuda.is_available()
        else "needs triton" if importlib.util.find_spec("triton") is None else None)
needs_cuda = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


def absorbed_batch(dtype, fp8=False, nan_free=False, seed=3):
    """DeepSeek dims (N=16, L=512, R=64, page 64), zero contexts and queries, T = 1 and 130 per request,
    on the GPU: q / weight / a 16-32 bit cache in ``dtype`` (an fp8 cache and k_scale stay).

    Cache rows outside the contexts are NaN, so an unmasked load shows; ``nan_free`` zeroes them
    (FlashMLA computes whole pages and may multiply a masked NaN value by 0).
    """
    batch = context_batch([300, 0, 129, 40, 1, 700], [1, 17, 130, 0, 64, 5], block_size=64, N=16, L=512, R=64,
                          P=128, V=128, dtype=torch.float32, fp8_scale=0.05 if fp8 else None, seed=seed)
    if nan_free:
        batch.kv_cache = torch.nan_to_num(batch.kv_cache.float(), nan=0.0).to(batch.kv_cache.dtype)
    return batch.to(DEVICE, dtype)


def check_absorbed(batch, fn, dtype):
    """``fn`` (the absorbed op's contract) on the GPU against the torch reference on CPU in float32,
    same inputs."""
    out, lse = (t.to(DEVICE) for t in batch.sentinels(128, dtype=dtype))
    fn(*batch.absorbed_args(), out, lse)
    cpu = batch.to("cpu", torch.float32)
    want, want_lse = cpu.sentinels(128, dtype=torch.float32)
    REFERENCE.absorbed_context_attention(*cpu.absorbed_args(), want, want_lse)
    written = written_rows(cpu)
    out, lse = out.cpu().float(), lse.cpu()
    assert torch.isnan(out[~written]).all() and torch.isnan(lse[:, ~written]).all(), "zero-context rows touched"
    torch.testing.assert_close(out[written], want[written], atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse[:, written], want_lse[:, written], atol=2e-2, rtol=2e-3)
