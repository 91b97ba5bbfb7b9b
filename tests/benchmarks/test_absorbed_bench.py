"""benchmarks/absorbed_bench.py: FlashMLA timed as it is meant to be called, and the suggested threshold."""

import math

import pytest
import torch

from benchmarks import absorbed_bench
from benchmarks._lib.batches import paged_batch
from tests.support.flashmla import StandInFlashMLA

pytestmark = pytest.mark.bench


def test_suggested_threshold_is_the_last_query_length_of_an_unbroken_run_of_wins():
    sweep, contexts = [1, 8, 32], [64, 256]

    def rows(losses=(), names=("absorbed_torch_ms",)):  # absorbed wins except at (context, query) in losses
        return [dict(context_len=c, query_len=q, mha_ms=1.0, **{n: 2.0 if (c, q) in losses else 0.5 for n in names})
                for c in contexts for q in sweep]

    names = ["absorbed_torch_ms"]
    assert absorbed_bench.suggested_threshold(rows(), sweep, names) == 32
    assert absorbed_bench.suggested_threshold(rows({(256, 8)}), sweep, names) == 1  # 32 wins again: too late
    assert absorbed_bench.suggested_threshold(rows({(64, 1)}), sweep, names) == 0
    # The fastest absorbed implementation counts; the batch of mixed query lengths (query_len None) does not.
    two = ["absorbed_triton_ms", "absorbed_flashmla_ms"]
    mixed = rows(names=two)
    for r in mixed:
        r["absorbed_triton_ms"] = 3.0
    mixed.append(dict(context_len=64, query_len=None, mha_ms=0.1, absorbed_triton_ms=9.0, absorbed_flashmla_ms=9.0))
    assert absorbed_bench.suggested_threshold(mixed, sweep, two) == 32


def test_flashmla_is_timed_per_query_length_group_with_its_own_metadata(monkeypatch):
    """The benchmark's FlashMLA runner against a stand-in of flash_mla 1.0.0 (tests/support/flashmla.py)."""
    from mla_ops.ops import flashmla

    stand_in = StandInFlashMLA()
    monkeypatch.setattr(flashmla, "_import_flash_mla", lambda: (stand_in, ""))
    assert absorbed_bench.query_len_groups([4, 1, 0, 4, 2, 3], [9, 9, 9, 9, 9, 0]) == [(1, [1]), (2, [4]), (4, [0, 3])]

    context_lens, query_lens = [70, 5, 0, 130, 64], [2, 1, 3, 2, 4]
    x = paged_batch(context_lens, query_lens, absorbed_bench.DIMS, absorbed_bench.BLOCK_SIZE, "cpu", torch.float16)
    lens = x["context_lens"]
    run = absorbed_bench.flashmla_runner(x, lens, query_lens)
    results = []
    for _ in range(3):  # the first call fills each group's metadata, the others reuse it
        out = torch.full((sum(query_lens), absorbed_bench.HEADS, absorbed_bench.VALUE), math.nan, dtype=torch.float16)
        lse = torch.full((absorbed_bench.HEADS, sum(query_lens)), math.nan)
        run(out, lse)
        results.append((out, lse))
    assert sorted((c["b"], c["s_q"]) for c in stand_in.calls[:3]) == [(1, 1), (1, 4), (2, 2)]  # no call for ctx 0
    assert len(stand_in.calls) == 9 and len({id(c["metadata"]) for c in stand_in.calls}) == 3, "metadata per group"

    want = torch.full_like(results[0][0], math.nan, dtype=torch.float32)
    want_lse = torch.full_like(results[0][1], math.nan)
    torch.ops.mla_ops.absorbed_context_attention(x["q"].float(), x["kv_cache"].float(), x["block_table"],
                                                 x["query_start_loc"], lens, x["kv_b_proj_weight"].float(),
                                                 absorbed_bench.NOPE ** -0.5, None, want, want_lse)
    written = torch.repeat_interleave(lens > 0, torch.tensor(query_lens))
    out, lse = results[-1]
    assert torch.isnan(out[~written]).all()  # the request without context stays untouched
    torch.testing.assert_close(out[written].float(), want[written], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse[:, written], want_lse[:, written], atol=2e-3, rtol=2e-3)
