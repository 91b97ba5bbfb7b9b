"""Benchmark inputs: MLA dims from the library's model presets, paged batches, model-step inputs.

    paged_batch(context_lens, query_lens, dims, block_size, device, dtype)  ->  mla_prefill's tensors:
        q [T, N, P+R], kv_c [T, L], k_pe [T, R], kv_cache [num_blocks, block_size, L+R],
        block_table [B, max_blocks], query_start_loc [B+1], context_lens [B], kv_b_proj_weight [N*(P+V), L]
    model_step(config, context_lens, query_lens, block_size, device)  ->  a model's step inputs
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from mla_ops import MLAConfig


class Dims(NamedTuple):
    """MLA attention dims: N heads, L latent (kv_lora_rank), P no-RoPE, R RoPE, V value head dims."""

    heads: int
    latent: int
    nope: int
    rope: int
    value: int

    @classmethod
    def of(cls, config: MLAConfig | str) -> Dims:
        """The dims of an ``MLAConfig`` or of one of its presets by name (``MLAConfig.from_name``)."""
        c = MLAConfig.from_name(config) if isinstance(config, str) else config
        return cls(c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim)

    def header(self) -> dict:
        """The dims as the GPU reports record them: ``{"N": .., "L": .., "P": .., "R": .., "V": ..}``."""
        return dict(N=self.heads, L=self.latent, P=self.nope, R=self.rope, V=self.value)


V2_LITE = Dims.of("deepseek-v2-lite")  # N=16, L=512, P=128, R=64, V=128
V3 = Dims.of("deepseek-v3")  # N=128, same head dims


def block_table(context_lens, block_size: int, num_blocks: int, generator: torch.Generator) -> torch.Tensor:
    """[B, max_blocks] int32 (CPU): each request's blocks at shuffled places among ``num_blocks``."""
    blocks = [-(-c // block_size) for c in context_lens]
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    table = torch.zeros(len(blocks), max(max(blocks, default=0), 1), dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks):
        table[r, :n] = order[used : used + n]
        used += n
    return table


def paged_batch(context_lens, query_lens, dims: Dims, block_size: int, device: torch.device | str,
                dtype: torch.dtype, seed: int = 0, spare_blocks: int = 1) -> dict:
    """Random inputs of one prefill step (module doc), named as ``mla_prefill``'s arguments.

    Values are drawn in float32 on ``device`` and cast to ``dtype``; the cache has
    ``spare_blocks`` blocks no request uses, and the blocks of each request sit at shuffled places.
    """
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    N, L, P, R, V = dims
    randn = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.float32).to(dtype)  # noqa: E731
    num_blocks = sum(-(-c // block_size) for c in context_lens) + spare_blocks
    tokens = sum(query_lens)
    return dict(
        q=randn(tokens, N, P + R),
        kv_c=randn(tokens, L),
        k_pe=randn(tokens, R),
        kv_cache=randn(num_blocks, block_size, L + R),
        block_table=block_table(context_lens, block_size, num_blocks, torch.Generator().manual_seed(seed)).to(device),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32,
                                     device=device),
        context_lens=torch.tensor(list(context_lens), dtype=torch.int32, device=device),
        kv_b_proj_weight=randn(N * (P + V), L) / math.sqrt(L),
    )


def model_step(config: MLAConfig, context_lens, query_lens, block_size: int, device: torch.device | str,
               seed: int = 0) -> dict:
    """One step's model inputs, the new tokens right after each context, and the cache blocks it uses:
    ``input_ids``, ``positions``, ``slot_mapping``, ``block_table`` (on ``device``), ``query_start_loc``,
    ``context_lens`` (CPU) and ``num_blocks``."""
    g = torch.Generator().manual_seed(seed)
    blocks = [math.ceil((c + q) / block_size) for c, q in zip(context_lens, query_lens)]
    table = block_table([c + q for c, q in zip(context_lens, query_lens)], block_size, sum(blocks), g)
    slots = []
    for r, (c, q) in enumerate(zip(context_lens, query_lens)):
        pos = torch.arange(c, c + q)
        slots.append(table[r, pos // block_size].long() * block_size + pos % block_size)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)])
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.randint(0, config.vocab_size, (sum(query_lens),), generator=g)
    return dict(input_ids=ids.to(device), positions=positions.to(device), slot_mapping=torch.cat(slots).to(device),
                block_table=table.to(device), query_start_loc=qsl,
                context_lens=torch.tensor(list(context_lens), dtype=torch.int32), num_blocks=sum(blocks))
