"""Batches shared by the compile and CUDA tests (importable without expecttest)."""

import torch

# Batches of one capacity bucket (<= 4 chunks of 16 rows): sizes, zero contexts first/middle/last,
# contexts longer than the workspace, no context at all.
BUCKET_4 = [
    ([5, 0, 13], [3, 2, 4]),
    ([7, 9, 0, 2, 11], [1, 2, 3, 4, 5]),
    ([0, 0], [3, 3]),
    ([20, 20, 9], [2, 5, 3]),
    ([0, 40, 0], [2, 6, 2]),
    ([63, 1], [4, 4]),
    ([1, 1, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2]),
    ([17, 0], [9, 2]),
    ([0, 3], [2, 2]),
    ([16, 16, 16, 16], [2, 3, 2, 3]),
    ([33, 2, 0, 0, 5, 8, 12], [3, 1, 2, 2, 3, 1, 4]),
    ([50, 0, 0, 14], [7, 3, 2, 5]),
]


def model_step(config, context_lens, query_lens, seed, num_blocks=64, block_size=4, max_blocks=20):
    """Inputs of one prefill step whose new tokens go right after each request's context."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    slots, used = [], 0
    for r, (c, q) in enumerate(zip(context_lens, query_lens)):
        n = -(-(c + q) // block_size)
        table[r, :n] = order[used : used + n]
        used += n
        slots += [int(table[r, p // block_size]) * block_size + p % block_size for p in range(c, c + q)]
    return (
        torch.randint(0, config.vocab_size, (sum(query_lens),), generator=g),
        torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)]),
        torch.tensor(slots),
        table,
        torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        torch.tensor(context_lens, dtype=torch.int32),
    )
