"""The block bookkeeping of generation steps (mla_ops/serving/scheduler.py), without a model: which
requests run, their blocks, block tables and slots, prefix reuse and capacity."""

import numpy as np
import pytest

from mla_ops.serving.paged_cache import BlockManager
from mla_ops.serving.scheduler import Scheduler


def reserve(scheduler, requests, max_new_tokens):
    matches, need, _ = scheduler.blocks_needed(requests, max_new_tokens, stale=False)
    scheduler.reserve(requests, matches, need)


def run_step(scheduler, requests, table_width=4, token=0):
    """One step: the scheduled requests, their inputs, and one new token each (none finishing)."""
    order, cached = scheduler.next_batch(requests)
    batch = [requests[i] for i in order]
    inputs = scheduler.step_inputs(batch, table_width)
    for request in batch:
        scheduler.append(request, token, done=False)
    return order, cached, inputs


def test_a_first_step_runs_every_prompt_and_then_one_token_each():
    scheduler = Scheduler(BlockManager(8, 4))
    requests = scheduler.requests([[1, 2, 3, 4, 5], [6, 7]])
    matches, need, available = scheduler.blocks_needed(requests, 3, stale=False)
    # ceil((5+3-1)/4) + ceil((2+3-1)/4): the last new token's row is never written
    assert matches == [[], []] and need == 2 + 1 and available == 8
    assert scheduler.reserve(requests, matches, need) == 0
    order, cached, inputs = run_step(scheduler, requests, token=9)
    assert order == [0, 1] and cached == 0
    assert inputs.input_ids == [1, 2, 3, 4, 5, 6, 7] and inputs.positions == [0, 1, 2, 3, 4, 0, 1]
    assert inputs.query_start_loc == [0, 5, 7] and inputs.context_lens == [0, 0]
    table = inputs.block_table
    assert table.dtype == np.int32 and table.shape == (2, 4)
    first, second = requests[0].blocks, requests[1].blocks
    assert len(first) == 2 and len(second) == 1 and not set(first) & set(second)
    assert list(table[0, :2]) == first and table[1, 0] == second[0]
    expect = [first[p // 4] * 4 + p % 4 for p in range(5)] + [second[0] * 4 + p for p in range(2)]
    assert inputs.slot_mapping.tolist() == expect
    assert requests[0].num_registered == 1  # its first block is full: registered in the prefix index

    order, cached, inputs = run_step(scheduler, requests)  # the decode step: the token each one made
    assert inputs.input_ids == [9, 9] and inputs.positions == [5, 2] and inputs.context_lens == [5, 2]
    assert inputs.query_start_loc == [0, 1, 2]


def test_a_prompt_waits_a_step_for_the_block_another_is_computing_then_reuses_it():
    scheduler = Scheduler(BlockManager(16, 4))
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    requests = scheduler.requests([shared + [9], shared + [10, 11]])
    matches, need, _ = scheduler.blocks_needed(requests, 2, stale=False)
    assert need == 3 + 3 - 2  # the second reuses the first's 2 full blocks
    scheduler.reserve(requests, matches, need)
    order, cached, _ = run_step(scheduler, requests)
    assert order == [0] and cached == 0  # the second waits: its first block is being computed
    order, cached, inputs = run_step(scheduler, requests)
    assert order == [0, 1] and cached == 8  # now it finds both blocks in the cache
    assert requests[1].blocks[:2] == requests[0].blocks[:2]
    assert inputs.context_lens == [9, 8] and inputs.input_ids[1:] == [10, 11]


def test_without_prefix_caching_nothing_is_shared_or_deferred():
    scheduler = Scheduler(BlockManager(16, 4, prefix_caching=False))
    requests = scheduler.requests([[1, 2, 3, 4, 5]] * 2)
    matches, need, _ = scheduler.blocks_needed(requests, 1, stale=False)
    assert need == 4
    scheduler.reserve(requests, matches, need)
    order, cached, _ = run_step(scheduler, requests)
    assert order == [0, 1] and cached == 0 and not set(requests[0].blocks) & set(requests[1].blocks)


def test_a_later_call_reuses_the_cached_prefix_unless_the_index_is_stale():
    scheduler = Scheduler(BlockManager(8, 4))
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    first = scheduler.requests([prompt])
    reserve(scheduler, first, 1)
    run_step(scheduler, first)
    scheduler.release(first[0])
    assert scheduler.manager.num_available == 8 and scheduler.manager.num_cached == 2

    again = scheduler.requests([prompt])
    matches, need, available = scheduler.blocks_needed(again, 1, stale=False)
    assert len(matches[0]) == 2 and need == 1 and available == 6  # the 2 cached blocks are pinned
    assert scheduler.blocks_needed(again, 1, stale=True)[:2] == ([[]], 3)
    scheduler.reserve(again, matches, need)
    order, cached, inputs = run_step(scheduler, again)
    assert cached == 8 and inputs.context_lens == [8] and inputs.input_ids == [9]


def test_a_fixed_cache_refuses_a_call_that_does_not_fit_and_a_growing_one_grows():
    fixed = Scheduler(BlockManager(3, 4), num_blocks=3)
    requests = fixed.requests([[1] * 9])
    matches, need, available = fixed.blocks_needed(requests, 5, stale=False)  # writes 9 + 4 rows
    with pytest.raises(ValueError, match="num_blocks=3 is too small: this call needs 4 more blocks of 4 tokens, "
                                         "3 are available"):
        fixed.check_capacity(need, available)
    assert fixed.manager.num_available == 3  # the check is read only

    growing = Scheduler(BlockManager(1, 4))
    requests = growing.requests([[1] * 9])
    matches, need, available = growing.blocks_needed(requests, 5, stale=False)
    growing.check_capacity(need, available)  # no limit
    assert growing.growth(need, available) == 3 and growing.manager.num_blocks == 1  # read only: the Generator
    assert growing.reserve(requests, matches, need) == 3 and growing.manager.num_blocks == 4  # allocates first


def test_finished_requests_leave_the_batch_and_free_their_blocks():
    scheduler = Scheduler(BlockManager(8, 4))
    requests = scheduler.requests([[1, 2], [3, 4, 5]])
    reserve(scheduler, requests, 2)
    order, _ = scheduler.next_batch(requests)
    scheduler.step_inputs([requests[i] for i in order], 2)
    scheduler.append(requests[0], 7, done=True)
    scheduler.append(requests[1], 8, done=False)
    assert requests[0].done and requests[0].blocks == [] and requests[0].tokens == [1, 2, 7]
    assert scheduler.next_batch(requests)[0] == [1]
    assert scheduler.manager.num_available == 8 - len(requests[1].blocks)


def test_across_ranks_a_block_id_names_block_size_times_d_tokens():
    """Rank 1 of 2, interleave 1: a block id covers 8 global tokens; this rank writes the odd ones."""
    scheduler = Scheduler(BlockManager(4, 4), layout=(1, 2, 1))
    assert scheduler.tokens_per_block == 8
    requests = scheduler.requests([list(range(10))])
    reserve(scheduler, requests, 1)
    _, _, inputs = run_step(scheduler, requests)
    blocks = requests[0].blocks
    assert len(blocks) == 2
    slots = inputs.slot_mapping.tolist()
    assert slots[0::2] == [-1] * 5  # the even positions live on rank 0
    assert slots[1::2] == [blocks[p // 8] * 4 + (p % 8) // 2 for p in range(1, 10, 2)]
