"""The host check of the block ids a step's contexts use (``_checks.check_block_ids``): against a
direct reading of every used id, on small (list) and large (array) batches, dense and sparse tables."""

import numpy as np
import pytest

from mla_ops import _checks


def used_ids(table, blocks):
    return np.concatenate([table[r, :n] for r, n in enumerate(blocks)] + [np.empty(0, np.int32)])


@pytest.mark.parametrize("batch", [1, 2, 7, 500])
@pytest.mark.parametrize("layout", ["dense", "equal", "one long context", "headline", "strided"])
def test_block_ids_match_a_direct_reading(batch, layout):
    rng = np.random.default_rng(batch)
    width = 40
    blocks = rng.integers(0, width + 1, batch)
    if layout == "one long context":
        blocks[:] = rng.integers(0, 2, batch)
        blocks[batch // 2] = width
    elif layout == "headline":  # every row one block, one row all of them (vLLM PR #50613's batch)
        blocks[:] = 1
        blocks[0] = width
    elif layout == "equal":
        blocks[:] = width // 2
    table = rng.integers(0, 1000, (batch, 2 * width if layout == "strided" else width), dtype=np.int32)
    if layout == "strided":
        table = table[:, ::2]  # a column stride of 2: not contiguous
    table[blocks == 0] = -1  # unused rows may hold anything
    for as_list in (True, False):
        given = blocks.tolist() if as_list else blocks
        ids = used_ids(table, blocks)
        assert _checks.check_block_ids(table, given) == (int(ids.max()) if ids.size else -1)
        rows = np.flatnonzero(blocks)
        if rows.size:  # one negative id among the used ones is named
            r = int(rows[-1])
            col = int(blocks[r]) - 1
            bad = table.copy()
            bad[r, col] = -7
            with pytest.raises(ValueError, match=rf"block_table\[{r}, {col}\] is -7"):
                _checks.check_block_ids(bad, given)
            bad[r, col] = -(2**31)  # the most negative int32: its bits as uint32 are 2**31
            with pytest.raises(ValueError, match="block ids must be >= 0"):
                _checks.check_block_ids(bad, given)
