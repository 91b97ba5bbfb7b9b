"""merge_attn_states: two attention partials (out [T, N, V], lse [N, T]) into one, against a
concatenated softmax, empty-safe, opcheck; the Triton kernel on a GPU."""

import pytest
import torch

import mla_ops
from mla_ops.ops.backends import REFERENCE
from tests.support.gpu import DEVICE, needs_cuda

ops = torch.ops.mla_ops
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def test_merge_matches_concatenated_softmax():
    torch.manual_seed(0)
    q_lens, n, v = 5, 3, 4
    sa, sb = torch.randn(n, q_lens, 6, dtype=torch.float64), torch.randn(n, q_lens, 9, dtype=torch.float64)
    va, vb = torch.randn(6, n, v, dtype=torch.float64), torch.randn(9, n, v, dtype=torch.float64)
    part = lambda s, vals: (torch.einsum("nms,snv->mnv", s.softmax(-1), vals), s.logsumexp(-1))  # noqa: E731
    (oa, la), (ob, lb) = part(sa, va), part(sb, vb)
    out, lse = mla_ops.merge_attn_states(oa, la, ob, lb)
    expect_out, expect_lse = part(torch.cat([sa, sb], -1), torch.cat([va, vb]))
    torch.testing.assert_close(out, expect_out, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, expect_lse, rtol=0, atol=1e-13)


@pytest.mark.parametrize("empty_lse", [float("-inf"), float("inf")])
def test_merge_is_empty_safe(empty_lse):
    t, n, v = 4, 2, 3
    out_a = torch.randn(t, n, v)
    lse_a = torch.randn(n, t)
    empty_out = torch.full((t, n, v), 7.0)  # garbage in an empty partial must not leak
    empty_lse_t = torch.full((n, t), empty_lse)
    out, lse = mla_ops.merge_attn_states(out_a, lse_a, empty_out, empty_lse_t)
    torch.testing.assert_close(out, out_a)
    torch.testing.assert_close(lse, lse_a)
    out, lse = mla_ops.merge_attn_states(empty_out, empty_lse_t, empty_out, empty_lse_t)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.all(lse == float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_low_precision(dtype):
    torch.manual_seed(1)
    oa, ob = torch.randn(17, 4, 8), torch.randn(17, 4, 8)
    la, lb = torch.randn(4, 17) * 3, torch.randn(4, 17) * 3
    expect, expect_lse = mla_ops.merge_attn_states(oa.double(), la.double(), ob.double(), lb.double())
    out, lse = mla_ops.merge_attn_states(oa.to(dtype), la, ob.to(dtype), lb)
    assert out.dtype == dtype and lse.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expect, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), expect_lse, atol=1e-5, rtol=1e-5)


def test_merge_rejects_mismatched_layout():
    o = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match="prefix_lse"):
        mla_ops.merge_attn_states(o, torch.randn(3, 2), o, torch.randn(2, 3))


def test_merge_opcheck():
    o, l = torch.randn(5, 2, 4), torch.randn(2, 5)
    l[0, 1] = float("-inf")
    torch.library.opcheck(ops.merge_attn_states, (o, l, torch.randn(5, 2, 4), torch.randn(2, 5)),
                          test_utils=OPCHECK_UTILS)
    # Permuted-dense inputs (heads-first outputs, tokens-first LSEs seen as [N, T]): the fake's
    # contiguous strides must be what the real op returns.
    o_p, l_p = torch.randn(2, 5, 4).transpose(0, 1), torch.randn(5, 2).t()
    torch.library.opcheck(ops.merge_attn_states, (o_p, l_p, torch.randn(4, 5, 2).permute(1, 2, 0), l_p),
                          test_utils=OPCHECK_UTILS)


@pytest.mark.cuda
@needs_cuda
def test_merge_kernel():
    g = torch.Generator(device=DEVICE).manual_seed(2)
    a, b = (torch.randn(77, 16, 128, generator=g, device=DEVICE).bfloat16() for _ in range(2))
    la, lb = (torch.randn(16, 77, generator=g, device=DEVICE) * 4 for _ in range(2))
    la[3, :5], lb[3, 2:7] = float("inf"), float("-inf")  # empty partials, both conventions
    out, lse = torch.ops.mla_ops.merge_attn_states(a, la, b, lb)
    expect, expect_lse = REFERENCE.merge_attn_states(a, la, b, lb)
    torch.testing.assert_close(out.float(), expect.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, expect_lse)
    assert not out.isnan().any()
