"""mla_prefill(backend="triton") on CPU through Triton's interpreter, against the dense reference."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (make test does)", allow_module_level=True)
pytest.importorskip("triton")

import mla_ops  # noqa: E402
from tests.support.batches import dense_reference, make_batch  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 1e-2}


def check(out, batch, dtype):
    ref = dense_reference(*batch.args(), k_scale=batch.k_scale)
    err = (out.double() - ref).abs().max().item()
    assert out.dtype == dtype and err <= TOL[dtype] * max(1.0, ref.abs().max().item()), f"max abs diff {err:.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("policy", ["packed", "whole_requests"])
def test_host_schedule(dtype, policy):
    batch = make_batch([0, 11, 0, 6, 3], [2, 3, 1, 4, 2], seed=1, block_size=4, dtype=dtype)
    out = batch.run(backend="triton", workspace_size=5, policy=policy)
    check(out, batch, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_device_schedule_with_spare_chunks(dtype):
    batch = make_batch([7, 0, 9], [3, 2, 2], seed=2, block_size=4, dtype=dtype)
    out = batch.run(backend="triton", workspace_size=6, max_chunks=4)  # 3 needed, 1 empty
    check(out, batch, dtype)


def test_fp8_cache():
    batch = make_batch([5, 9], [2, 3], seed=3, block_size=4, dtype=torch.float32, fp8_scale=0.5,
                       k_scale_as_tensor=True)
    check(batch.run(backend="triton", workspace_size=8), batch, torch.float32)


def test_triton_matches_torch_backend_exactly_where_it_should():
    batch = make_batch([4, 0, 10], [3, 1, 2], seed=4, block_size=2, dtype=torch.float32)
    torch.testing.assert_close(batch.run(backend="triton", workspace_size=4),
                               batch.run(backend="torch", workspace_size=4), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("absorb", [2, 64])  # some requests absorbed, all absorbed
def test_routed_between_absorbed_and_chunked_kernels(absorb):
    batch = make_batch([0, 9, 4, 0, 13], [2, 1, 5, 3, 2], seed=5, block_size=4, dtype=torch.float32)
    out = batch.run(backend="triton", workspace_size=6, absorb_max_query_len=absorb)
    check(out, batch, torch.float32)
    check(batch.run(backend="triton", workspace_size=6, absorb_max_query_len=absorb, max_chunks=5,
                    max_absorbed_tokens=16), batch, torch.float32)


@pytest.mark.parametrize("capacity", [0, 1, 4, None])  # none, the first, the first two routed requests; default
def test_device_path_absorbed_capacity(capacity):
    # Routed requests past the capacity run on the chunked kernels instead; the absorbed scratch
    # shares the chunk loop's buffer.
    batch = make_batch([0, 9, 4, 0, 13], [2, 1, 5, 3, 2], seed=6, block_size=4, dtype=torch.float32)
    check(batch.run(backend="triton", workspace_size=6, absorb_max_query_len=64, max_chunks=5,
                    max_absorbed_tokens=capacity), batch, torch.float32)
