"""context_attention (a chunk's keys, continuing earlier chunks) and suffix_attention (causal over
the new tokens) against a float64 softmax per request, opcheck; their Triton kernels on a GPU, and
the chunk loop's kernels (gather, up-projection, attention) over every chunk of a device schedule.

q [T, N, P+R]   k_nope [S, N, P]   k_pe [S, R]   v [S, N, V]   cu_seq_lens [B+1]   -> out [T, N, V], lse [N, T]
"""

import pytest
import torch

import mla_ops  # noqa: F401  (registers torch.ops.mla_ops)
from mla_ops.ops import attention
from mla_ops.ops.backends import REFERENCE
from mla_ops.planning.device_schedule import device_plan_tensors
from tests.support.batches import dense_attention, paged_block_table, random_varlen
from tests.support.gpu import DEVICE, TOL, needs_cuda

ops = torch.ops.mla_ops
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.fixture(params=["op", "oracle"])
def impl(request):
    """``(context_attention, suffix_attention)``: the ops (on CPU the engine of ops/cpu_attention.py,
    whose branches tests/ops/test_cpu_attention.py forces) and the torch oracles."""
    if request.param == "op":
        return ops.context_attention, ops.suffix_attention
    return attention.context_attention_reference, attention.suffix_attention_reference


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_context_attention_writes_and_continues(dtype, tol, impl):
    # T=1 and 17, a request with no rows (left untouched), one without queries
    q_lens, k_lens = [1, 17, 0, 4], [5, 0, 3, 11]
    cu_q, _, _, _, make = random_varlen(q_lens, dtype=dtype)
    cu_k, k_nope, k_pe, v, _ = random_varlen(k_lens, dtype=dtype, seed=1)
    q = make(sum(q_lens), 2, 12)
    scale = 0.3
    starts = torch.tensor([7, 0, 0, 0], dtype=torch.int32)  # request 0 continues an earlier chunk
    # What an earlier chunk left for request 0: its partial over 5 other keys.
    _, prev_nope, prev_pe, prev_v, _ = random_varlen([5], dtype=dtype, seed=2)
    prev_out, prev_lse = dense_attention(q[:1], prev_nope, prev_pe, prev_v, scale, False)
    out = torch.full((sum(q_lens), 2, 8), float("nan"), dtype=dtype)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    lse = torch.full((2, sum(q_lens)), float("nan"), dtype=lse_dtype)
    out[:1], lse[:, :1] = prev_out.to(dtype), prev_lse.to(lse_dtype)
    impl[0](q, k_nope, k_pe, v, cu_q, cu_k, starts, scale, out, lse)

    for i in range(4):
        t0, t1, s0, s1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if i == 0:  # merged: equal to attending over both key sets at once
            keys = (torch.cat([prev_nope, k_nope[s0:s1]]), torch.cat([prev_pe, k_pe[s0:s1]]),
                    torch.cat([prev_v, v[s0:s1]]))
        else:
            keys = (k_nope[s0:s1], k_pe[s0:s1], v[s0:s1])
        if s1 == s0:  # no rows in this chunk: left untouched
            assert torch.isnan(out[t0:t1]).all() and torch.isnan(lse[:, t0:t1]).all()
            continue
        expect, expect_lse = dense_attention(q[t0:t1], *keys, scale, False)
        torch.testing.assert_close(out[t0:t1].double(), expect, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[:, t0:t1].double(), expect_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("lens", [[1, 17, 3], [1, 1, 1, 1]])  # the second: a decode step, one key each
@pytest.mark.parametrize("num_heads,value", [(1, 8), (16, 8), (2, 16)])  # V below and above P+R = 12
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.float16, 1e-2)])
def test_suffix_attention_is_causal_per_request(lens, num_heads, value, dtype, tol, impl):
    cu, k_nope, k_pe, v, make = random_varlen(lens, num_heads=num_heads, value=value, dtype=dtype)
    q = make(sum(lens), num_heads, 12)
    out = torch.empty(sum(lens), num_heads, value, dtype=dtype)
    lse = torch.empty(num_heads, sum(lens))
    impl[1](q, k_nope, k_pe, v, cu, 0.25, out, lse)
    for t0, t1 in zip(cu[:-1].tolist(), cu[1:].tolist()):
        expect, expect_lse = dense_attention(q[t0:t1], k_nope[t0:t1], k_pe[t0:t1], v[t0:t1], 0.25, True)
        torch.testing.assert_close(out[t0:t1].double(), expect, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[:, t0:t1].double(), expect_lse, atol=1e-5, rtol=1e-5)


def test_attention_opcheck():
    cu_q, _, _, _, make = random_varlen([3, 2], dtype=torch.float32)
    cu_k, k_nope, k_pe, v, _ = random_varlen([4, 0], dtype=torch.float32, seed=3)
    q = make(5, 2, 12)
    starts = torch.tensor([2, 0], dtype=torch.int32)
    out, lse = torch.randn(5, 2, 8), torch.randn(2, 5)
    torch.library.opcheck(ops.context_attention, (q, k_nope, k_pe, v, cu_q, cu_k, starts, 0.5, out, lse),
                          test_utils=OPCHECK_UTILS)
    cu, k_nope, k_pe, v, make = random_varlen([3, 2], dtype=torch.float32)
    torch.library.opcheck(ops.suffix_attention,
                          (make(5, 2, 12), k_nope, k_pe, v, cu, 0.5, torch.empty(5, 2, 8), torch.empty(2, 5)),
                          test_utils=OPCHECK_UTILS)


# ---- GPU: the Triton kernels against the torch references -------------------------------------


def random_chunk(dtype, heads=16, latent=512, nope=128, rope=64, value=128, q_lens=(1, 17, 130, 0, 64),
                 k_lens=(300, 0, 129, 40, 1), seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=g, device=DEVICE, dtype=torch.float32).to(dtype)  # noqa: E731
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    kv = randn(sum(k_lens), heads, nope + value)
    workspace = randn(sum(k_lens) + 5, latent + rope)
    return dict(q=randn(sum(q_lens), heads, nope + rope), k_nope=kv[..., :nope], k_pe=workspace[: sum(k_lens), latent:],
                v=kv[..., nope:], cu_q=cu_q, cu_k=cu_k)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_context_attention_kernel(dtype):
    c = random_chunk(dtype)
    starts = torch.tensor([5, 0, 0, 0, 0], dtype=torch.int32, device=DEVICE)  # request 0 continues
    outs = []
    for fn in (torch.ops.mla_ops.context_attention, REFERENCE.context_attention):
        out = torch.full((c["q"].shape[0], 16, 128), 0.5, device=DEVICE, dtype=dtype)
        lse = torch.full((16, c["q"].shape[0]), 1.0, device=DEVICE)
        fn(c["q"], c["k_nope"], c["k_pe"], c["v"], c["cu_q"], c["cu_k"], starts, 0.07, out, lse)
        outs.append((out.float(), lse))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-3, rtol=1e-3)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_suffix_attention_kernel(dtype):
    c = random_chunk(dtype, q_lens=(1, 17, 300, 64), k_lens=(1, 17, 300, 64))
    outs = []
    for fn in (torch.ops.mla_ops.suffix_attention, REFERENCE.suffix_attention):
        out = torch.empty(c["q"].shape[0], 16, 128, device=DEVICE, dtype=dtype)
        lse = torch.empty(16, c["q"].shape[0], device=DEVICE)
        fn(c["q"], c["k_nope"], c["k_pe"], c["v"], c["cu_q"], 0.07, out, lse)
        outs.append((out.float(), lse))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-3, rtol=1e-3)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("num_programs", [3, None])  # forced tiny grids (long stride loops), then the SM count
def test_persistent_kernels_over_every_chunk_of_a_device_schedule(num_programs, monkeypatch):
    """Gather, up-projection and context attention on each chunk, the empty ones past the count included."""
    from mla_ops.triton import _common

    monkeypatch.setattr(_common, "PROGRAMS_OVERRIDE", num_programs)
    g = torch.Generator(device=DEVICE).manual_seed(4)
    context_lens = torch.tensor([0, 700, 3000, 0, 90, 0], dtype=torch.int32)
    capacity, max_chunks, heads = 1024, 6, 8
    starts_k, _, cu_k, num_chunks = (t.to(DEVICE) for t in device_plan_tensors(context_lens, capacity, max_chunks))
    assert int(num_chunks) < max_chunks
    cache = torch.randn(400, 16, 576, generator=g, device=DEVICE).to(torch.bfloat16)
    blocks = [-(-c // 16) for c in context_lens.tolist()]  # 238 blocks of 16 rows: 188 columns
    _, table = paged_block_table(blocks, torch.Generator().manual_seed(4), spare_blocks=400 - sum(blocks))
    table = table.to(DEVICE)
    weight = torch.randn(heads * 256, 512, generator=g, device=DEVICE).to(torch.bfloat16) / 20
    q_lens = torch.tensor([3, 100, 1, 70, 5, 2])
    cu_q = torch.tensor([0, *q_lens.cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(q_lens.sum()), heads, 192, generator=g, device=DEVICE).to(torch.bfloat16)
    base_out = torch.randn(q.shape[0], heads, 128, generator=g, device=DEVICE).to(torch.bfloat16)
    base_lse = torch.randn(heads, q.shape[0], generator=g, device=DEVICE)
    for k in range(max_chunks):
        cu, starts, rows = cu_k[k], starts_k[k], int(cu_k[k, -1])
        results = []
        for ops in (torch.ops.mla_ops, REFERENCE):
            workspace = torch.full((capacity, 576), float("nan"), device=DEVICE, dtype=torch.bfloat16)
            kv = torch.full((capacity, heads, 256), float("nan"), device=DEVICE, dtype=torch.bfloat16)
            out, lse = base_out.clone(), base_lse.clone()
            ops.gather_context(cache, table, cu, starts, None, workspace)
            ops.up_project(workspace[:, :512], weight, cu, kv.view(capacity, -1))
            # Stale rows past the count are NaN: attention must read only the live ones.
            ops.context_attention(q, kv[..., :128], workspace[:, 512:], kv[..., 128:], cu_q, cu, starts, 0.07, out, lse)
            results.append((workspace, kv, out.float(), lse))
        (ws, kv, out, lse), (want_ws, want_kv, want_out, want_lse) = results
        assert torch.equal(ws[:rows], want_ws[:rows]) and ws[rows:].isnan().all(), f"chunk {k}"
        assert kv[rows:].isnan().all(), f"chunk {k}"
        torch.testing.assert_close(kv[:rows].float(), want_kv[:rows].float(), atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(out, want_out, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)
