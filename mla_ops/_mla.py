"""MLA's dimensions and the shape helpers every layer of the package shares (DESIGN §1, §2).

N query heads   L latent rank (kv_lora_rank)   P no-RoPE head dim   R RoPE head dim   V value head dim
kv_b_proj_weight [N*(P+V), L] viewed [N, P+V, L]: W_UK = [:, :P] [N, P, L], W_UV = [:, P:] [N, V, L]
"""

from __future__ import annotations

from typing import NamedTuple

import torch


# vLLM's fp8_ds_mla latent cache (DeepSeek-V3.2, mla_ops/ops/cache_formats.py): fixed dims, uint8 rows
DS_MLA_LATENT, DS_MLA_ROPE, DS_MLA_TILE = 512, 64, 128
DS_MLA_ROW_BYTES = DS_MLA_LATENT + 4 * (DS_MLA_LATENT // DS_MLA_TILE) + 2 * DS_MLA_ROPE  # 656
INDEX_TILE = 128  # fp8_per_token index keys: values per float32 scale (vLLM's indexer quant_block_size)

# A ``topk_indices`` entry (DSA): the indexer's scores of this token were not finite (a NaN or inf in its
# index query, weights or a candidate's key), so no selection exists; the token's attention output is NaN.
NO_FINITE_SELECTION = -2


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """LSEs are float32, or float64 when the attention itself runs in float64 (exact oracle)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class MLADims(NamedTuple):
    num_heads: int  # N
    latent: int  # L
    nope: int  # P
    rope: int  # R
    value: int  # V

    @classmethod
    def from_shapes(cls, q: torch.Tensor, kv_cache: torch.Tensor, kv_b_proj_weight: torch.Tensor) -> MLADims:
        """Read from q [T, N, P+R], kv_cache [..., L+R] (or fp8_ds_mla's uint8 rows: R = 64) and
        kv_b_proj_weight [N*(P+V), L]."""
        num_heads, latent = q.shape[1], kv_b_proj_weight.shape[1]
        rope = DS_MLA_ROPE if kv_cache.dtype == torch.uint8 else kv_cache.shape[-1] - latent
        nope = q.shape[2] - rope
        return cls(num_heads, latent, nope, rope, kv_b_proj_weight.shape[0] // max(num_heads, 1) - nope)

    def split_kv(self, kv: torch.Tensor):
        """[S, N*(P+V)] up-projected rows -> k_nope [S, N, P], v [S, N, V] (views)."""
        return kv.view(-1, self.num_heads, self.nope + self.value).split([self.nope, self.value], dim=-1)


def split_kv_b_proj(kv_b_proj_weight: torch.Tensor, num_heads: int, nope: int):
    """``(W_UK [N, P, L], W_UV [N, V, L])``, views of ``kv_b_proj_weight [N*(P+V), L]``."""
    w = kv_b_proj_weight.view(num_heads, -1, kv_b_proj_weight.shape[1])  # [N, P+V, L]
    return w[:, :nope], w[:, nope:]


def fold_queries(q: torch.Tensor, w_uk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q_lat [N, T, L] = q_nope [T, N, P] @ W_UK [N, P, L], one batched matmul in ``dtype``."""
    q_nope = q[..., : w_uk.shape[1]].transpose(0, 1)  # [N, T, P]
    return torch.bmm(q_nope.to(dtype), w_uk.to(dtype))


def unfold_outputs(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """out [N, T, V] = o_lat [N, T, L] @ W_UV^T [N, L, V], one batched matmul in o_lat's dtype."""
    return torch.bmm(o_lat, w_uv.to(o_lat.dtype).transpose(1, 2))


def token_requests(query_start_loc: torch.Tensor, num_tokens: int):
    """Per query token, on the device (no host read): ``(request, position, valid)``, each [T].

    ``request`` (int64, clamped into [0, B)) owns the token, ``position`` (int64) is its index in
    the request's queries, ``valid`` is False for tokens past ``query_start_loc[-1]``.
    """
    tokens = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    request = torch.searchsorted(query_start_loc, tokens, right=True) - 1
    request = request.clamp(0, max(query_start_loc.shape[0] - 2, 0))
    position = tokens.long() - query_start_loc.long()[request]
    return request, position, tokens < query_start_loc[-1]


def absorbed_token_loc(query_start_loc: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """[B+1] int32: request r's tokens at rows ``loc[r] .. loc[r+1]`` of a buffer that packs the
    tokens of the requests with context only (device code, no host read)."""
    lens = torch.where(context_lens > 0, query_start_loc[1:] - query_start_loc[:-1], 0)
    return torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0, dtype=torch.int32)]).to(torch.int32)
