"""gather_context: latent rows of a paged cache into a workspace, from any start, fp8 dequantized;
opcheck. (Its Triton kernel on a GPU: tests/ops/test_up_projection.py, with the up-projection.)

kv_cache [num_blocks, block_size, D]   block_table [B, max_blocks] int32   cu_seq_lens [B+1]
starts [B]   -> workspace [W, D], rows past cu_seq_lens[-1] untouched
"""

import pytest
import torch

import mla_ops  # noqa: F401  (registers torch.ops.mla_ops)
from tests.support.batches import paged_block_table

ops = torch.ops.mla_ops
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def make_cache(block_size, num_blocks=24, width=6, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, block_size, width, generator=g).to(dtype)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_gather_rows_from_any_start(block_size):
    cache = make_cache(block_size, num_blocks=64)
    g = torch.Generator().manual_seed(block_size)
    _, table = paged_block_table([16] * 4, g, spare_blocks=0)  # a shuffled [4, 16] table of 64 blocks
    starts = torch.tensor([3, 0, 0, 5], dtype=torch.int32)
    seq_lens = [6, 1, 0, 9]
    cu = torch.tensor([0, 6, 7, 7, 16], dtype=torch.int32)
    workspace = torch.full((20, 6), float("nan"))
    ops.gather_context(cache, table, cu, starts, None, workspace)
    expect = [cache[table[i, p // block_size], p % block_size]
              for i in range(4) for p in range(int(starts[i]), int(starts[i]) + seq_lens[i])]
    assert torch.equal(workspace[:16], torch.stack(expect))
    assert torch.isnan(workspace[16:]).all(), "rows past cu_seq_lens[-1] must stay untouched"


def test_gather_dequantizes_fp8():
    cache = make_cache(4)
    k_scale = torch.tensor([0.25])
    fp8 = (cache / k_scale).to(torch.float8_e4m3fn)
    table = torch.arange(24, dtype=torch.int32).view(2, 12)
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    starts = torch.tensor([2, 0], dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        workspace = torch.empty(11, 6, dtype=dtype)
        ops.gather_context(fp8, table, cu, starts, k_scale, workspace)
        flat = fp8.view(-1, 6).float() * 0.25
        rows = torch.cat([torch.arange(2, 7), 48 + torch.arange(0, 6)])
        assert torch.equal(workspace, flat[rows].to(dtype))


def test_gather_opcheck():
    cache = make_cache(4)
    table = torch.arange(24, dtype=torch.int32).view(2, 12)
    args = (cache, table, torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([4, 0], dtype=torch.int32))
    torch.library.opcheck(ops.gather_context, args + (None, torch.zeros(10, 6)), test_utils=OPCHECK_UTILS)
    # SchemaCheckMode compares inputs with arithmetic that CPU float8 lacks: skip test_schema there.
    fp8 = cache.to(torch.float8_e4m3fn)
    torch.library.opcheck(ops.gather_context, (fp8,) + args[1:] + (torch.tensor([0.5]), torch.zeros(10, 6)),
                          test_utils=OPCHECK_UTILS[1:])
