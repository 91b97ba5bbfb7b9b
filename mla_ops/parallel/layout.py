"""The interleaved layout of a sharded context (DESIGN §10): context token ``p`` of a request lives
on rank ``(p // I) % D`` at local position ``(p // (I*D)) * I + p % I``."""

from __future__ import annotations

import numpy as np
import torch

from .. import _checks


def local_context_lens(context_lens, rank, world_size: int, interleave: int = 1):
    """Context rows of each request held by ``rank``: ``(c // (I*D)) * I + clamp(c % (I*D) - rank*I, 0, I)``.

    Tensors (``rank`` may be a tensor that broadcasts) or numpy arrays.
    """
    stripe = interleave * world_size
    rest = context_lens % stripe - rank * interleave
    rest = rest.clamp(0, interleave) if isinstance(rest, torch.Tensor) else np.clip(rest, 0, interleave)
    return (context_lens // stripe) * interleave + rest


def tokens_per_block(block_size: int, world_size: int = 1, interleave: int = 1) -> int:
    """Global tokens that one block id covers across the group: ``block_size * D``.

    With ``block_size % interleave == 0``, local block j of every rank holds exactly the global positions
    ``[j * block_size * D, (j+1) * block_size * D)``, so one block id (the same on every rank) names a
    whole slice of the sequence: the ranks' block tables, allocation and prefix-cache hashes agree."""
    if block_size % interleave:
        raise ValueError(f"context_parallel: block_size ({block_size}) must be a multiple of the interleave "
                         f"({interleave}), so that a cache block holds whole stripes")
    return block_size * world_size


def slot_mapping(positions, blocks, block_size: int, rank: int = 0, world_size: int = 1,
                 interleave: int = 1) -> np.ndarray:
    """Cache slots on ``rank`` of tokens at global ``positions``: the token's local position
    ``(p // (I*D)) * I + p % I`` in its request's block-table row where ``rank`` owns it
    (``(p // I) % D == rank``), -1 (write nothing) elsewhere. ``blocks``: one row for every token (a
    request's), or ``[T, W]``, each token's row (a step's tokens at once). One device: D = 1, rank 0."""
    p = np.asarray(positions, dtype=np.int64)
    if not p.size:
        return p
    local = (p // (interleave * world_size)) * interleave + p % interleave
    blocks, index = np.asarray(blocks, dtype=np.int64), local // block_size
    block = blocks[index] if blocks.ndim == 1 else np.take_along_axis(blocks, index[:, None], 1)[:, 0]
    return np.where((p // interleave) % world_size == rank, block * block_size + local % block_size, -1)


def shard_context(kv_cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor, *, rank: int,
                  world_size: int, interleave: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard of a single-device paged cache: ``(local_cache, local_block_table)``.

    kv_cache [num_blocks, block_size, L+R], block_table [B, max_blocks] int32, context_lens [B] int32
    (host-readable) -> local_cache [n, block_size, L+R] (same dtype; the rank's rows, request after
    request, in fresh blocks) and local_block_table [B, m] int32: context token p of request r
    (with ``(p // I) % D == rank``) sits at local position ``(p // (I*D)) * I + p % I``.
    """
    _checks.check_tensor(kv_cache, "kv_cache", 3, "[num_blocks, block_size, L+R]")
    _checks.check_int32(block_table, "block_table", 2, "[B, max_blocks]")
    _checks.check_int32(context_lens, "context_lens", 1, "[B]")
    world_size = _checks.check_positive_int(world_size, "world_size")
    interleave = _checks.check_positive_int(interleave, "interleave")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
    ctx = context_lens.cpu().numpy().astype(np.int64)
    block_size = kv_cache.shape[1]
    if block_table.shape[0] < ctx.size:
        raise ValueError(f"block_table must have a row per request (B={ctx.size}), got {block_table.shape[0]} rows")
    _checks.check_lengths(np.zeros(1, np.int64), ctx, block_table.cpu().numpy(), block_size)  # the table fits
    local = local_context_lens(ctx, rank, world_size, interleave)
    blocks = -(-local // block_size)
    first_block = np.concatenate([[0], np.cumsum(blocks)])
    stored = kv_cache.view(torch.uint8) if kv_cache.dtype == torch.float8_e4m3fn else kv_cache  # bytes copy
    local_cache = stored.new_zeros(max(int(first_block[-1]), 1), block_size, kv_cache.shape[2])
    local_table = torch.zeros(ctx.size, max(int(blocks.max(initial=0)), 1), dtype=torch.int32)
    stripe, table, device = interleave * world_size, block_table.cpu().long(), kv_cache.device
    for r in range(ctx.size):
        if local[r] == 0:
            continue
        j = torch.arange(int(local[r]))
        p = (j // interleave) * stripe + rank * interleave + j % interleave  # global positions, local order
        ids = torch.arange(int(first_block[r]), int(first_block[r + 1]), dtype=torch.int32)
        local_table[r, : ids.numel()] = ids
        rows = stored[table[r, p // block_size].to(device), (p % block_size).to(device)]
        local_cache[ids.long()[j // block_size].to(device), (j % block_size).to(device)] = rows
    if kv_cache.dtype == torch.float8_e4m3fn:
        local_cache = local_cache.view(torch.float8_e4m3fn)
    return local_cache, local_table.to(block_table.device)
