"""Block bookkeeping of a paged KV cache, with prefix caching by content hash (vLLM's scheme, small).

A block holds ``block_size`` consecutive tokens of one sequence. A *full* block is named by the hash
of its tokens chained with the hash of the block before it (so equal tokens at different places, or
after different prefixes, never share a block). Full blocks are registered under that hash once
their rows are written; a later sequence whose prompt starts with the same blocks reuses them
instead of recomputing (``match``). Blocks are reference-counted: a released block that is
registered stays cached ("evictable") until a new allocation needs the space, least recently
released first; an unregistered one is free at once.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import NamedTuple, Sequence

from .. import _checks as checks


def chain_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The name of a full block: sha256 over its parent's name and its token ids."""
    h = hashlib.sha256(parent or b"")
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


def block_hashes(tokens: Sequence[int], block_size: int, parent: bytes | None = None) -> list[bytes]:
    """Names of the full blocks of ``tokens``, in order."""
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_hash(parent, tokens[start : start + block_size])
        out.append(parent)
    return out


class CacheUsage(NamedTuple):
    """Where a paged cache's blocks are: ``in_use + cached + free == total``."""

    total: int
    in_use: int  # held by a running sequence
    cached: int  # a registered prefix nobody uses now: reused by a later prompt, or evicted when needed
    free: int  # holding nothing


def _entry_digest(block_hash: bytes, block: int) -> int:
    return int.from_bytes(hashlib.sha256(block_hash + block.to_bytes(8, "little")).digest()[:8], "little")


class BlockManager:
    """Blocks 0 .. num_blocks-1 of a cache: allocation, reference counts, the prefix-cache index."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        num_blocks = checks.check_int32_size(num_blocks, "num_blocks")  # block ids are int32 in a block table
        self.block_size = checks.check_int32_size(block_size, "block_size")
        self.prefix_caching = checks.check_bool(prefix_caching, "prefix_caching")
        self.num_blocks = 0
        self._free: deque[int] = deque()
        self._refs: list[int] = []
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, registered; oldest first
        self._index_digest = 0  # XOR of the index's (hash, block) entries: O(1) per change
        self.grow(num_blocks)

    def grow(self, extra: int) -> None:
        """Add ``extra`` blocks (ids continue after the current ones; a cache tensor grows the same way)."""
        extra = checks.check_nonnegative_int(extra, "extra")
        self._free.extend(range(self.num_blocks, self.num_blocks + extra))
        self._refs.extend([0] * extra)
        self.num_blocks += extra

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free ones and cached ones nobody uses."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def usage(self) -> CacheUsage:
        free, cached = len(self._free), len(self._evictable)
        return CacheUsage(self.num_blocks, self.num_blocks - free - cached, cached, free)

    def fingerprint(self) -> tuple[int, ...]:
        """A cheap digest of the state that decides what a call reuses and allocates: the block count,
        the free and evictable blocks and the prefix index (ranks of one model must hold equal ones)."""
        return self.num_blocks, len(self._free), len(self._evictable), self._index_digest

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (not yet acquired)."""
        blocks = []
        if self.prefix_caching:
            for h in hashes:
                block = self._block_of.get(h)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def ref_count(self, block: int) -> int:
        """Sequences using ``block`` now (0: free, or cached and evictable)."""
        self._check_block(block)
        return self._refs[block]

    def _check_block(self, block: int) -> None:
        # A negative id would silently index from the end of the Python lists.
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block} is outside the cache's blocks 0..{self.num_blocks - 1}")

    def acquire(self, block: int) -> None:
        self._check_block(block)
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
        self._refs[block] += 1

    def allocate(self) -> int:
        """A block for new rows, reference count 1: a free one, else the least recently released cached one."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            block_hash = self._hash_of.pop(block)
            del self._block_of[block_hash]
            self._index_digest ^= _entry_digest(block_hash, block)
        else:
            raise RuntimeError(f"paged cache is full: all {self.num_blocks} blocks are in use")
        self._refs[block] = 1
        return block

    def release(self, block: int) -> None:
        self._check_block(block)
        if self._refs[block] <= 0:
            raise RuntimeError(f"block {block} released more often than acquired")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def register(self, block: int, block_hash: bytes) -> None:
        """Name a full, written block. If another block already has that name, this one stays private."""
        self._check_block(block)
        if self.prefix_caching and block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash
            self._index_digest ^= _entry_digest(block_hash, block)

    def clear_cache(self) -> None:
        """Forget every registered block (e.g. the weights changed); blocks in use stay allocated."""
        for block in list(self._evictable):
            self._free.append(block)
        self._evictable.clear()
        self._block_of.clear()
        self._hash_of.clear()
        self._index_digest = 0
