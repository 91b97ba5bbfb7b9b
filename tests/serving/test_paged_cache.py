"""The paged cache's block bookkeeping with prefix caching (mla_ops/serving/paged_cache.py): block
names chained over their prefix, sharing, reference counts, eviction, growth."""

import pytest

from mla_ops.serving.paged_cache import BlockManager, block_hashes, chain_hash


def test_block_names_chain_their_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # the partial third block has no name
    assert a == block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)[1] != a[1]  # same tokens after another prefix
    assert block_hashes([5, 6, 7, 8], 4)[0] != a[1]  # same tokens at another place
    assert chain_hash(None, [1, 23]) != chain_hash(None, [12, 3])  # token boundaries count


def test_shared_blocks_are_reference_counted_and_cached_after_release():
    m = BlockManager(4, block_size=2)
    names = block_hashes([1, 2, 3, 4], 2)
    a, b = m.allocate(), m.allocate()
    m.register(a, names[0])
    m.register(b, names[1])
    assert m.match(names) == [a, b] and m.match([names[0], b"other", names[1]]) == [a] and m.num_cached == 2
    for block in (a, b):
        m.acquire(block)  # a second sequence shares the prefix
    for block in (b, a, b, a):
        m.release(block)
    assert m.num_available == 4 and m.match(names) == [a, b]  # unused, still cached
    fresh = [m.allocate(), m.allocate()]
    assert set(fresh).isdisjoint({a, b})  # free blocks go first
    assert m.allocate() == b and m.match(names) == [a]  # then the least recently released cached one
    with pytest.raises(RuntimeError, match="full"):
        m.allocate(), m.allocate()


def test_an_unregistered_release_frees_at_once_and_duplicates_stay_private():
    m = BlockManager(3, block_size=2)
    name = block_hashes([7, 7], 2)[0]
    a, b = m.allocate(), m.allocate()
    m.register(a, name)
    m.register(b, name)  # same content computed twice: the second copy is not indexed
    assert m.match([name]) == [a]
    m.release(b)
    assert m.num_available == 2 and m.num_cached == 1
    with pytest.raises(RuntimeError, match="released more often"):
        m.release(b)


def test_grow_and_clear():
    m = BlockManager(1, block_size=4, prefix_caching=True)
    a = m.allocate()
    m.register(a, b"x")
    m.grow(2)
    assert m.num_blocks == 3 and m.num_available == 2
    m.clear_cache()
    assert m.match([b"x"]) == [] and m.num_available == 2  # a is still held
    m.release(a)
    assert m.num_available == 3
    off = BlockManager(2, block_size=4, prefix_caching=False)
    block = off.allocate()
    off.register(block, b"y")
    assert off.match([b"y"]) == [] and off.num_cached == 0


def test_block_ids_and_sizes_fit_int32():
    """A block id lives in an int32 block table: a cache of 2**31 blocks is refused by name, before any
    allocation (its free list alone would be 2**31 ints)."""
    with pytest.raises(ValueError, match=r"num_blocks must be at most 2\*\*31 - 1"):
        BlockManager(2**31, block_size=16)
    with pytest.raises(ValueError, match=r"block_size must be at most 2\*\*31 - 1"):
        BlockManager(4, block_size=2**31)
