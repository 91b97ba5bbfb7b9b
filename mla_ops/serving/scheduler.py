"""The block bookkeeping of generation steps over one ``BlockManager``: which requests run in a step,
their blocks, the block table and the slots; no model, no tensors.

A call's requests reuse the full prompt blocks the prefix cache holds (by content hash), and a
prompt whose next block another prompt of the same step is computing waits one step and then
reuses it. Before a call writes anything, ``blocks_needed`` + ``check_capacity`` tell whether it
fits and ``growth`` by how many blocks the cache grows; ``reserve`` then pins every cached prefix the
call reuses (no allocation of the call can evict it) and grows the manager by that much.

Across ranks (context parallel, DESIGN §10) a block id names ``block_size * D`` global tokens, so
every rank makes the same bookkeeping from the global lengths; only the slots differ per rank
(``parallel.layout.slot_mapping``: -1 for the tokens other ranks own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..parallel.layout import slot_mapping, tokens_per_block
from .paged_cache import BlockManager, block_hashes, chain_hash


@dataclass
class Request:
    """One prompt of a call and the tokens generated for it so far."""

    tokens: list[int]
    prompt_len: int
    hashes: list[bytes]  # names of the full blocks (the prompt's, then each one as it fills)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose rows are in the cache
    num_registered: int = 0  # leading full blocks registered in the prefix cache
    max_hits: int = 0  # cached blocks it may reuse: the last prompt token is always computed
    admitted: bool = False
    done: bool = False


class StepInputs(NamedTuple):
    """Host arrays of one step, every scheduled request's tokens past its cached rows."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: np.ndarray  # this rank's cache slots; -1 for the tokens other ranks own
    block_table: np.ndarray  # [B, table_width] int32
    query_start_loc: list[int]  # [B+1]
    context_lens: list[int]  # [B]


class Scheduler:
    """Block bookkeeping of generate calls. ``layout``: (rank, world_size, interleave) of a model
    across ranks, (0, 1, 1) on one device. ``num_blocks`` fixed: the manager never grows and a call
    that does not fit is refused; None: it grows as calls need."""

    def __init__(self, manager: BlockManager, layout: tuple[int, int, int] = (0, 1, 1),
                 num_blocks: int | None = None):
        self.manager = manager
        self.layout = layout
        self.fixed_num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block(manager.block_size, *layout[1:])  # global tokens per block id

    def requests(self, prompts: list[list[int]]) -> list[Request]:
        return [Request(list(p), len(p), block_hashes(p, self.tokens_per_block)) for p in prompts]

    # ---- before a call writes anything (read only) ----------------------------------------------

    def blocks_needed(self, requests: list[Request], max_new_tokens: int, stale: bool):
        """Each prompt's cached prefix blocks (none if the index is ``stale``), the new blocks the call
        needs beyond them, and the blocks available once those prefixes are pinned."""
        bs = self.tokens_per_block
        seen: set[bytes] = set()
        need, matches = 0, []
        for request in requests:
            request.max_hits = (request.prompt_len - 1) // bs
            blocks = [] if stale else self.manager.match(request.hashes[: request.max_hits])
            matches.append(blocks)
            shared = len(blocks)  # plus the blocks an earlier prompt of this call computes first
            while self.manager.prefix_caching and shared < request.max_hits and request.hashes[shared] in seen:
                shared += 1
            seen.update(request.hashes)
            # The last new token is returned, never fed back: its row is never written.
            need += math.ceil((request.prompt_len + max_new_tokens - 1) / bs) - shared
        pinned = {block for blocks in matches for block in blocks if self.manager.ref_count(block) == 0}
        return matches, need, self.manager.num_available - len(pinned)

    def growth(self, need: int, available: int) -> int:
        """The blocks ``reserve`` will add to the manager for a call needing ``need`` blocks with
        ``available`` ones (``blocks_needed``'s): at least half again, so that growing stays rare."""
        if need <= available:
            return 0
        self.check_capacity(need, available)
        return max(need - available, self.manager.num_blocks // 2)

    def check_capacity(self, need: int, available: int) -> None:
        if self.fixed_num_blocks is not None and need > available:
            raise ValueError(
                f"num_blocks={self.fixed_num_blocks} is too small: this call needs {need} more blocks of "
                f"{self.tokens_per_block} tokens, {available} are available"
            )

    # ---- a call ---------------------------------------------------------------------------------

    def reserve(self, requests: list[Request], matches: list[list[int]], need: int) -> int:
        """Pin every prompt's cached prefix, then make room for the rest of the call; returns the
        blocks the manager grew by (0: the cache tensor keeps its size)."""
        for request, blocks in zip(requests, matches):
            request.blocks = list(blocks)
            for block in blocks:
                self.manager.acquire(block)
        extra = self.growth(need, self.manager.num_available)
        self.manager.grow(extra)
        return extra

    def next_batch(self, requests: list[Request]) -> tuple[list[int], int]:
        """The requests that run this step (indices into ``requests``) and the prompt tokens newly
        found in the cache (by the requests admitted now)."""
        pending: set[bytes] = set()
        order, cached = [], 0
        for i, request in enumerate(requests):
            if request.done:
                continue
            if not request.admitted:
                if not self._admit(request, pending):
                    continue
                cached += request.num_computed
            order.append(i)
        return order, cached

    def _admit(self, request: Request, pending: set[bytes]) -> bool:
        """Take what the cache holds now; wait a step if another prompt is computing the next block."""
        more = self.manager.match(request.hashes[: request.max_hits])[len(request.blocks) :]
        for block in more:
            self.manager.acquire(block)
        request.blocks += more
        hits = len(request.blocks)
        if self.manager.prefix_caching and hits < request.max_hits and request.hashes[hits] in pending:
            return False
        pending.update(request.hashes[hits:])
        request.num_registered, request.num_computed = hits, hits * self.tokens_per_block
        request.admitted = True
        return True

    def step_inputs(self, batch: list[Request], table_width: int) -> StepInputs:
        """The step's inputs; allocates the blocks its new tokens need."""
        ids, positions, qsl, ctx = [], [], [0], []
        table = np.zeros((len(batch), table_width), np.int32)
        for r, request in enumerate(batch):
            while len(request.blocks) * self.tokens_per_block < len(request.tokens):
                request.blocks.append(self.manager.allocate())
            table[r, : len(request.blocks)] = request.blocks
            start, end = request.num_computed, len(request.tokens)
            ids += request.tokens[start:end]
            positions += range(start, end)
            qsl.append(qsl[-1] + end - start)
            ctx.append(start)
        rows = table[np.repeat(np.arange(len(batch)), np.diff(qsl))]  # each token's block-table row
        slots = slot_mapping(positions, rows, self.manager.block_size, *self.layout)
        return StepInputs(ids, positions, slots, table, qsl, ctx)

    def append(self, request: Request, token: int, done: bool) -> None:
        """The step computed every scheduled token of ``request`` and produced ``token``; ``done``
        releases its blocks."""
        request.num_computed = len(request.tokens)
        request.tokens.append(token)
        self._register_full_blocks(request)
        if done:
            request.done = True
            self.release(request)

    def _register_full_blocks(self, request: Request) -> None:
        bs = self.tokens_per_block
        parent = request.hashes[request.num_registered - 1] if request.num_registered else None
        for j in range(request.num_registered, request.num_computed // bs):
            parent = chain_hash(parent, request.tokens[j * bs : (j + 1) * bs])
            if j >= len(request.hashes):
                request.hashes.append(parent)
            self.manager.register(request.blocks[j], parent)
        request.num_registered = max(request.num_registered, request.num_computed // bs)

    def release(self, request: Request) -> None:
        for block in reversed(request.blocks):  # the tail is evicted first, the shared prefix last
            self.manager.release(block)
        request.blocks = []
