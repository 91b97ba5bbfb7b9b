"""End-to-end correctness of ``mla_ops.mla_prefill`` against a dense, unchunked reference.

Written from DESIGN.md (§1 math, §2 conventions, §4 API, §6 testing), independently of the
library code (the batches, the reference and their shapes: tests/support/batches.py; every dim is
read from tensor shapes by the library).

Request r's queries see its c_r context keys (non-causal) and, causally, its own new keys.
"""

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla_ops
from tests.support.batches import (FP8, TOL, absorbed_reference, assert_close_to_reference, dense_reference,
                                   make_batch, random_lens, sdpa_reference)
from tests.support.gpu import DEVICE, needs_cuda


# --------------------------------------------------------------------------------------------
# Self-checks of the reference (no library involved)
# --------------------------------------------------------------------------------------------


def test_reference_single_token_is_its_own_value():
    # One request, no context, one token: the only key is its own, so out = v = kv_c @ W_UV^T.
    b = make_batch([0], [1], seed=0, N=3)
    N, P, V = 3, 8, 8
    ref = b.reference()
    v = (b.kv_c.double() @ b.kv_b_proj_weight.double().T).view(1, N, P + V)[..., P:]
    torch.testing.assert_close(ref, v, rtol=0, atol=1e-12)


def test_reference_hand_computed_two_keys():
    # N = 1, P = R = V = L = 1, block_size 1; one context key and one new token.
    # key_j = [w_k * lat_j | pe_j], v_j = w_v * lat_j, score_j = q . key_j * scale.
    q = torch.tensor([[[0.5, -1.0]]], dtype=torch.float64)  # [1, 1, 2]
    kv_c, k_pe = torch.tensor([[2.0]], dtype=torch.float64), torch.tensor([[0.25]],
                                                                            dtype=torch.float64)
    cache = torch.tensor([[[-1.0, 3.0]]], dtype=torch.float64)  # one block, one slot
    w = torch.tensor([[1.5], [0.5]], dtype=torch.float64)  # [N*(P+V), L] = [2, 1]
    scale = 0.7
    s_ctx = (0.5 * 1.5 * -1.0 + -1.0 * 3.0) * scale
    s_new = (0.5 * 1.5 * 2.0 + -1.0 * 0.25) * scale
    p_ctx = math.exp(s_ctx) / (math.exp(s_ctx) + math.exp(s_new))
    expect = p_ctx * (0.5 * -1.0) + (1 - p_ctx) * (0.5 * 2.0)
    ref = dense_reference(q, kv_c, k_pe, cache, torch.tensor([[0]], dtype=torch.int32),
                          torch.tensor([0, 1], dtype=torch.int32),
                          torch.tensor([1], dtype=torch.int32), w, scale)
    assert abs(ref.item() - expect) < 1e-14


@pytest.mark.parametrize("block_size", [1, 16])
def test_reference_matches_sdpa_and_absorbed_forms(block_size):
    g = torch.Generator().manual_seed(1)
    ctx, ql = random_lens(g, 5, 40, 6, zero_at=(0, 2))
    b = make_batch(ctx, ql, seed=2, block_size=block_size, N=3, noncontig="slice")
    ref = b.reference()
    torch.testing.assert_close(ref, sdpa_reference(*b.args()), rtol=0, atol=1e-12)
    torch.testing.assert_close(ref, absorbed_reference(*b.args()), rtol=0, atol=1e-12)


def test_reference_fp8_dequantizes():
    b = make_batch([9, 0, 4], [2, 3, 1], seed=3, block_size=4, dtype=torch.float32,
                   fp8_scale=0.05)
    deq = replace(b, kv_cache=b.kv_cache.double() * 0.05, k_scale=None)
    torch.testing.assert_close(b.reference(), deq.reference(), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# mla_prefill vs the reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=["f64", "f32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_random_batches(policy, block_size, dtype):
    torch.manual_seed(10)
    g = torch.Generator().manual_seed(100 + block_size)
    # Zero-context requests first, in the middle and last; some contexts > the workspace.
    ctx, ql = random_lens(g, 7, 90, 5, zero_at=(0, 3, 6))
    ctx[1], ctx[4] = 77, 33  # longer than the workspace (24)
    noncontig = {1: "slice", 16: "step", 64: "colmajor"}[block_size]
    for nc in (None, noncontig):
        b = make_batch(ctx, ql, seed=block_size, block_size=block_size, dtype=dtype,
                       noncontig=nc)
        out = b.run(workspace_size=24, policy=policy)
        assert_close_to_reference(out, b.reference(), dtype,
                                  f"policy={policy} bs={block_size} noncontig={nc}")


@pytest.mark.parametrize("workspace_size", [1, 3, 7, 16])
@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_tiny_workspaces(policy, workspace_size):
    torch.manual_seed(11)
    # Contexts that straddle many chunks, and zero-context requests between them.
    ctx, ql = [0, 23, 5, 0, 0, 16, 1, 40, 0], [2, 3, 1, 4, 1, 2, 5, 1, 3]
    b = make_batch(ctx, ql, seed=11, block_size=4, noncontig="slice")
    out = b.run(workspace_size=workspace_size, policy=policy)
    assert_close_to_reference(out, b.reference(), torch.float64, f"ws={workspace_size}")


@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_default_workspace_and_long_contexts(policy):
    # One chunk holds everything, including a context of several thousand rows.
    torch.manual_seed(12)
    b = make_batch([300, 0, 4500, 130], [3, 2, 3, 70], seed=12, block_size=64,
                   dtype=torch.float32)
    out = b.run(policy=policy)  # workspace_size=65536
    assert_close_to_reference(out, b.reference(), torch.float32)


@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_no_request_has_context(policy):
    torch.manual_seed(13)
    b = make_batch([0, 0, 0, 0], [1, 5, 3, 2], seed=13, block_size=16, garbage_blocks=2)
    for ws in (1, 65536):
        out = b.run(workspace_size=ws, policy=policy)
        assert_close_to_reference(out, b.reference(), torch.float64, f"ws={ws}")


@pytest.mark.parametrize("ctx,ql", [(0, 1), (0, 9), (1, 1), (50, 1), (50, 7)])
@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_single_request(policy, ctx, ql):
    torch.manual_seed(14)
    b = make_batch([ctx], [ql], seed=14 + ctx + ql, block_size=16, N=1)
    out = b.run(workspace_size=16, policy=policy)
    assert_close_to_reference(out, b.reference(), torch.float64)


@pytest.mark.parametrize("N", [1, 4])
def test_head_counts(N):
    torch.manual_seed(15)
    b = make_batch([20, 0, 7], [3, 2, 4], seed=15, N=N, block_size=16)
    out = b.run(workspace_size=8)
    assert_close_to_reference(out, b.reference(), torch.float64, f"N={N}")


@pytest.mark.parametrize("scale_as_tensor", [False, True], ids=["float", "tensor"])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_fp8_cache(policy, q_dtype, scale_as_tensor):
    torch.manual_seed(16)
    for fp8_scale in (0.0625, 0.05):
        b = make_batch([0, 37, 0, 12, 64], [2, 3, 1, 4, 2], seed=16, block_size=16,
                       dtype=q_dtype, fp8_scale=fp8_scale, k_scale_as_tensor=scale_as_tensor,
                       noncontig="slice")
        assert b.kv_cache.dtype == FP8
        out = b.run(workspace_size=20, policy=policy)
        assert_close_to_reference(out, b.reference(), q_dtype, f"k_scale={fp8_scale}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_packed_and_whole_requests_agree(dtype):
    torch.manual_seed(17)
    g = torch.Generator().manual_seed(17)
    ctx, ql = random_lens(g, 8, 60, 4, zero_at=(0, 4, 7))
    b = make_batch(ctx, ql, seed=17, block_size=16, dtype=dtype)
    for ws in (5, 32):
        a = b.run(workspace_size=ws, policy="packed")
        w = b.run(workspace_size=ws, policy="whole_requests")
        err = (a.double() - w.double()).abs().max().item()
        assert err <= TOL[dtype], f"ws={ws}: packed vs whole_requests differ by {err:.3e}"


def test_large_scores_are_stable():
    # Scores in the hundreds: a softmax without max subtraction overflows in float32.
    torch.manual_seed(18)
    b = make_batch([30, 0, 45], [3, 2, 4], seed=18, block_size=16, dtype=torch.float32,
                   q_mult=40.0)
    ref = b.reference()
    out = b.run(workspace_size=8)
    # Near-one-hot softmax: compare relative to the output scale with a float32 tolerance.
    assert_close_to_reference(out, ref, torch.float32)


def test_valid_call_leaves_inputs_untouched():
    torch.manual_seed(19)
    b = make_batch([0, 37, 0, 12], [2, 3, 1, 4], seed=19, block_size=16, dtype=torch.float32,
                   fp8_scale=0.05, k_scale_as_tensor=True)
    before = {k: v.clone() for k, v in b.tensors().items()}
    b.run(workspace_size=7)
    for k, v in b.tensors().items():
        a, c = (v.view(torch.uint8), before[k].view(torch.uint8)) if v.dtype == FP8 else (
            v, before[k])
        assert torch.equal(a, c), f"mla_prefill modified {k}"


def test_backend_auto_on_cpu():
    torch.manual_seed(20)
    b = make_batch([0, 19, 3], [2, 3, 1], seed=20, block_size=16)
    out = b.run(workspace_size=8, backend="auto")
    assert_close_to_reference(out, b.reference(), torch.float64)


@st.composite
def batches(draw):
    B = draw(st.integers(1, 5))
    ctx = draw(st.lists(st.integers(0, 40), min_size=B, max_size=B))
    ql = draw(st.lists(st.integers(1, 6), min_size=B, max_size=B))
    dims = dict(N=draw(st.integers(1, 3)), L=draw(st.sampled_from([4, 8])),
                P=draw(st.sampled_from([2, 4])), R=draw(st.sampled_from([1, 2])),
                V=draw(st.sampled_from([2, 4, 6])))
    return dict(ctx=ctx, ql=ql, dims=dims,
                block_size=draw(st.sampled_from([1, 2, 5, 16])),
                workspace_size=draw(st.integers(1, 48)),
                policy=draw(st.sampled_from(["packed", "whole_requests"])),
                noncontig=draw(st.sampled_from([None, "slice", "step", "colmajor"])),
                seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_hypothesis_random_batches(case):
    torch.manual_seed(21)
    b = make_batch(case["ctx"], case["ql"], seed=case["seed"], block_size=case["block_size"],
                   noncontig=case["noncontig"], **case["dims"])
    out = b.run(workspace_size=case["workspace_size"], policy=case["policy"])
    assert_close_to_reference(out, b.reference(), torch.float64, str(case))


# --------------------------------------------------------------------------------------------
# Edge cases the contract implies
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", [False, True], ids=["f32", "fp8"])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_unused_cache_slots_are_never_read(policy, block_size, fp8):
    # Tails of partial blocks and unreferenced blocks may hold anything, NaN included.
    torch.manual_seed(22)
    b = make_batch([0, 37, 0, 12, 64, 0], [2, 3, 1, 4, 2, 1], seed=22, block_size=block_size,
                   dtype=torch.float32, fp8_scale=0.05 if fp8 else None, nan_fill=True)  # NaN in every unused slot
    assert b.kv_cache.float().isnan().any()
    ref = b.reference()
    assert torch.isfinite(ref).all()
    assert_close_to_reference(b.run(workspace_size=20, policy=policy), ref, torch.float32)


@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_requests_without_queries(policy):
    # query_start_loc is non-decreasing: a request may have context but no new tokens.
    torch.manual_seed(23)
    for ctx, ql in (([5, 20, 7], [2, 0, 3]), ([5, 20, 7, 0], [0, 2, 0, 1])):
        b = make_batch(ctx, ql, seed=23, block_size=4)
        out = b.run(workspace_size=6, policy=policy)
        assert_close_to_reference(out, b.reference(), torch.float64, f"ctx={ctx} ql={ql}")
    b = make_batch([5, 20], [0, 0], seed=23, block_size=4)  # T = 0
    assert b.run(workspace_size=6, policy=policy).shape == (0, 2, 8)


def test_float16():
    torch.manual_seed(24)
    b = make_batch([5, 20, 0, 40], [2, 3, 1, 2], seed=24, block_size=16, dtype=torch.float16)
    out = b.run(workspace_size=6)
    assert out.dtype == torch.float16
    err = (out.double() - b.reference()).abs().max().item()
    assert err <= 1e-2 * max(1.0, b.reference().abs().max().item()), f"max abs diff {err:.3e}"


def test_k_scale_zero_dim_tensor_and_int_softmax_scale():
    torch.manual_seed(25)
    b = make_batch([5, 20, 7], [2, 1, 3], seed=25, block_size=4, dtype=torch.float32,
                   fp8_scale=0.05)
    b = replace(b, k_scale=torch.tensor(0.05, dtype=torch.float32))
    assert_close_to_reference(b.run(workspace_size=6), b.reference(), torch.float32)
    b = replace(make_batch([5, 20, 7], [2, 1, 3], seed=25, block_size=4), softmax_scale=1)
    assert_close_to_reference(b.run(workspace_size=6), b.reference(), torch.float64)


@pytest.mark.parametrize("path", [{}, {"max_chunks": 16}, {"policy": "whole_requests"}, {"absorb_max_query_len": 64}],
                         ids=["host_plan", "device_plan", "whole_requests", "absorbed"])
@pytest.mark.parametrize("softmax_scale", [0.0, -0.7])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_zero_and_negative_softmax_scales_are_exact(path, softmax_scale, dtype):
    # 0: every visible key weighs the same; < 0: the lowest score wins. A finite scale never gives NaN
    # (ATen's fused CPU attention masks before it scales: -inf * 0).
    b = replace(make_batch([5, 0, 37, 1], [3, 2, 4, 1], seed=28, block_size=4, dtype=dtype),
                softmax_scale=softmax_scale)
    assert_close_to_reference(b.run(workspace_size=6, **path), b.reference(), dtype, str(path))


def test_noncontiguous_cache_and_weight():
    torch.manual_seed(26)
    b = make_batch([5, 20, 0, 7], [2, 1, 2, 3], seed=26, block_size=4, noncontig="step")
    wide = torch.cat([b.kv_cache, b.kv_cache], dim=-1)
    b = replace(b, kv_cache=wide[..., 3:3 + b.kv_cache.shape[-1]],
                kv_b_proj_weight=b.kv_b_proj_weight.t().contiguous().t())
    assert not b.kv_cache.is_contiguous() and not b.kv_b_proj_weight.is_contiguous()
    assert_close_to_reference(b.run(workspace_size=6), b.reference(), torch.float64)


def test_deepseek_v2_lite_dims():
    # N = 16, L = 512, P = 128, R = 64, V = 128: nothing may depend on the toy sizes above.
    torch.manual_seed(27)
    b = make_batch([300, 0, 129], [3, 2, 5], seed=27, block_size=64, N=16, L=512, P=128, R=64,
                   V=128, dtype=torch.float32)
    assert_close_to_reference(b.run(workspace_size=128), b.reference(), torch.float32)


# --------------------------------------------------------------------------------------------
# GPU: the Triton kernels at DeepSeek's dims
# --------------------------------------------------------------------------------------------


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("max_chunks", [None, 6])
def test_mla_prefill_triton_against_dense_reference(max_chunks):
    batch = make_batch([0, 700, 0, 90, 1500, 3], [20, 33, 5, 130, 1, 64], seed=5, block_size=64, N=16, L=512,
                       P=128, R=64, V=128, dtype=torch.bfloat16)
    args = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in batch.args()]
    out = mla_ops.mla_prefill(*args, workspace_size=512, backend="triton", max_chunks=max_chunks)
    ref = dense_reference(*batch.args())
    err = (out.cpu().double() - ref).abs().max().item()
    assert err <= 3e-2 * max(1.0, ref.abs().max().item()), f"max abs diff {err:.3e}"
