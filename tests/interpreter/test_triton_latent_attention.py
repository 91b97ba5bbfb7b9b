"""The latent attention launcher (context parallel's local attention, mla_ops/ops/absorbed.py) on
the absorbed Triton kernel, against its torch oracle under Triton's CPU interpreter.

q [T, H, L+R] folded queries   kv_cache [num_blocks, block_size, L+R]
-> out [T, H, L] float32 (the partials context parallel sends), lse [H, T]; rows of requests
without context stay untouched (NaN sentinels).
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 set before import", allow_module_level=True)
pytest.importorskip("triton")

import torch  # noqa: E402

from mla_ops.ops.absorbed import latent_attention_reference  # noqa: E402
from mla_ops.triton.absorbed import latent_context_attention as latent_attention_triton  # noqa: E402
from tests.support.batches import context_batch, written_rows  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 1e-2}
SMALL = dict(N=3, L=32, R=8, P=8, V=8)


@pytest.mark.parametrize("dtype,fp8_scale,softmax_scale", [(torch.float32, None, None), (torch.float16, None, None),
                                                         (torch.float32, 0.5, None), (torch.float16, 0.5, None),
                                                         (torch.float32, None, 0.0), (torch.float32, None, -0.7)])
def test_matches_reference(dtype, fp8_scale, softmax_scale):
    batch = context_batch([5, 0, 19, 3, 40, 1], [1, 3, 17, 0, 2, 1], block_size=4, dtype=dtype, fp8_scale=fp8_scale,
                          **dict(SMALL, N=5))
    if softmax_scale is not None:  # 0: uniform weights; < 0: masked keys must stay out
        batch.softmax_scale = softmax_scale
    tokens, heads, latent = batch.q.shape[0], 5, SMALL["L"]
    g = torch.Generator().manual_seed(1)
    q_abs = torch.randn(tokens, heads, latent + SMALL["R"], generator=g).to(dtype)  # [T, H, L+R]
    args = (q_abs, batch.kv_cache, batch.block_table, batch.query_start_loc, batch.context_lens, batch.softmax_scale,
            batch.k_scale)
    got = torch.full((tokens, heads, latent), float("nan"))
    got_lse = torch.full((heads, tokens), float("nan"))
    want, want_lse = torch.full_like(got, float("nan")), torch.full_like(got_lse, float("nan"))
    latent_attention_triton(*args, got, got_lse)
    latent_attention_reference(*args, want, want_lse)
    written = written_rows(batch)
    assert torch.isnan(got[~written]).all() and torch.isnan(got_lse[:, ~written]).all(), "zero-context rows touched"
    err = (got[written] - want[written]).abs().max().item()
    lse_err = (got_lse[:, written] - want_lse[:, written]).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, want[written].abs().max().item()) and lse_err <= TOL[dtype] * 4, \
        f"max abs diff out {err:.3e}, lse {lse_err:.3e}"
