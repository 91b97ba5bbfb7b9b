"""An MLA attention layer and a small DeepSeek-V2-style model on top of the mla_ops operators.

T new tokens (all requests, concatenated)   H hidden_size        N num_attention_heads
L kv_lora_rank   P qk_nope_head_dim   R qk_rope_head_dim   V v_head_dim   B requests
kv_cache  [num_blocks, block_size, L+R]   one latent row [kv_c | k_pe] per token, k_pe rotated

Module and parameter names follow DeepSeek's (``q_a_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``,
``input_layernorm``, ...), so a checkpoint's tensors map by name. Two things differ from a
checkpoint and are left to a loader: DeepSeek's RoPE parts use the interleaved pair layout while
``apply_rotary_emb`` rotates halves (NeoX), so the R rows of each head in the q projection and the
R k_pe rows of ``kv_a_proj_with_mqa`` must be permuted (evens first, then odds) at load time; and
DeepSeek-V2 uses MoE feed-forwards after its first layer, where every block here has the dense
gated MLP of ``intermediate_size``.

The cache tensors, slot mapping, block table and the step's ``PrefillPlan`` (``mla_ops.plan_prefill``,
made once per step) are passed in on every call; nothing is stored in the modules. Every layer
runs the same plan: with a device plan (``max_chunks=K``) the whole step reads no device value
and compiles to one graph, the planner running once however many layers there are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .cache import check_write, write_checked
from .plan import PrefillPlan
from .prefill import check_run, launch


@dataclass
class MLAConfig:
    hidden_size: int
    num_attention_heads: int
    q_lora_rank: Optional[int]  # None: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rms_norm_eps: float
    intermediate_size: int
    num_hidden_layers: int
    vocab_size: int
    initializer_range: float = 0.02

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_name(cls, name: str) -> MLAConfig:
        if name not in mla_configs:
            raise ValueError(f"unknown MLAConfig name {name!r}; known: {sorted(mla_configs)}")
        return cls(**mla_configs[name])


mla_configs = {
    "deepseek-v2-lite": dict(
        hidden_size=2048, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0,
        rms_norm_eps=1e-6, intermediate_size=10944, num_hidden_layers=27, vocab_size=102400,
    ),
    "tiny": dict(  # for tests
        hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_theta=10000.0,
        rms_norm_eps=1e-6, intermediate_size=128, num_hidden_layers=2, vocab_size=256,
    ),
}


def _linear(in_features: int, out_features: int, std: float) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False)
    nn.init.normal_(layer.weight, std=std)
    return layer


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(_acc_dtype(x.dtype))
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def rotary_cos_sin(
    positions: torch.Tensor, rope_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, R] for token positions [T] (NeoX layout: each frequency twice, halves)."""
    acc = _acc_dtype(dtype)
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, device=positions.device, dtype=acc) / rope_dim)  # [R/2]
    freqs = positions.to(acc)[:, None] * inv_freq[None, :]  # [T, R/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, R]
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE of x [..., R]; cos, sin broadcast to x. Not DeepSeek's interleaved
    pair layout: checkpoints are permuted at load time (see the module docstring)."""
    y = x.to(cos.dtype)
    return (y * cos + rotate_half(y) * sin).to(x.dtype)


class MLAAttention(nn.Module):
    def __init__(self, config: MLAConfig):
        super().__init__()
        c, std = config, config.initializer_range
        self.num_heads = c.num_attention_heads
        self.kv_lora_rank = c.kv_lora_rank
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        self.rope_theta = c.rope_theta
        # DeepSeek's YaRN mscale (long-context checkpoints) is the caller's concern: multiply it
        # into softmax_scale after construction.
        self.softmax_scale = c.qk_head_dim ** -0.5

        self.q_lora_rank = c.q_lora_rank
        if c.q_lora_rank is None:
            self.q_proj = _linear(c.hidden_size, c.num_attention_heads * c.qk_head_dim, std)
        else:
            self.q_a_proj = _linear(c.hidden_size, c.q_lora_rank, std)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = _linear(c.q_lora_rank, c.num_attention_heads * c.qk_head_dim, std)
        self.kv_a_proj_with_mqa = _linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, std)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = _linear(c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), std)
        self.o_proj = _linear(c.num_attention_heads * c.v_head_dim, c.hidden_size, std)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, L+R]
        slot_mapping: torch.Tensor,  # [T] int64/int32, negative = padding (not written)
        block_table: torch.Tensor,  # [B, max_blocks] int32: the plan's
        plan: PrefillPlan,
        *,
        k_scale: float | torch.Tensor | None = None,
        backend: str = "auto",
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        N, L, P, R, V = self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim

        if self.q_lora_rank is None:
            q = self.q_proj(hidden)  # [T, N*(P+R)]
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))  # [T, q_lora_rank] -> [T, N*(P+R)]
        q_nope, q_pe = q.view(num_tokens, N, P + R).split([P, R], dim=-1)  # [T, N, P], [T, N, R]
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split([L, R], dim=-1)  # [T, L], [T, R]
        kv_c = self.kv_a_layernorm(kv_c)

        cos, sin = rotary_cos_sin(positions, R, self.rope_theta, q.dtype)  # [T, R] each
        q_pe = apply_rotary_emb(q_pe, cos[:, None, :], sin[:, None, :])
        k_pe = apply_rotary_emb(k_pe, cos, sin)
        q = torch.cat([q_nope, q_pe], dim=-1)  # [T, N, P+R]

        # Everything is checked before the cache is written: a rejected call writes nothing.
        check_plan_block_table(block_table, plan)
        weight = self.kv_b_proj.weight
        dims = check_run(q, kv_c, k_pe, kv_cache, weight, self.softmax_scale, plan, k_scale, backend, None)
        check_write(kv_c, k_pe, slot_mapping, kv_cache, k_scale)
        write_checked(kv_c, k_pe, slot_mapping, kv_cache, k_scale)
        out = launch(q, kv_c, k_pe, kv_cache, weight, self.softmax_scale, plan, k_scale, backend, dims)  # [T, N, V]
        return self.o_proj(out.reshape(num_tokens, N * V))  # [T, H]


def check_plan_block_table(block_table: torch.Tensor, plan: PrefillPlan) -> None:
    """The layers read ``plan.block_table``; the ``block_table`` argument must be that table."""
    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan must be a PrefillPlan (mla_ops.plan_prefill), got {type(plan).__name__}")
    if not isinstance(block_table, torch.Tensor) or block_table.shape != plan.block_table.shape \
            or block_table.device != plan.block_table.device:
        raise ValueError(
            f"block_table does not fit plan: shape {tuple(getattr(block_table, 'shape', ()))}, the plan's "
            f"block table is {tuple(plan.block_table.shape)} on {plan.block_table.device}"
        )


class FeedForward(nn.Module):
    def __init__(self, config: MLAConfig):
        super().__init__()
        std = config.initializer_range
        self.gate_proj = _linear(config.hidden_size, config.intermediate_size, std)
        self.up_proj = _linear(config.hidden_size, config.intermediate_size, std)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [T, I] -> [T, H]


class DecoderLayer(nn.Module):
    def __init__(self, config: MLAConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = FeedForward(config)

    def forward(self, x, positions, kv_cache, slot_mapping, block_table, plan, *, k_scale, backend) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, slot_mapping, block_table, plan,
                               k_scale=k_scale, backend=backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class MLAModel(nn.Module):
    def __init__(self, config: MLAConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        nn.init.normal_(self.embed_tokens.weight, std=config.initializer_range)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def allocate_kv_caches(
        self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None, device=None
    ) -> torch.Tensor:
        """Zeroed caches [num_hidden_layers, num_blocks, block_size, L+R]; dtype and device default
        to the model's (a float8_e4m3fn cache then needs ``k_scale`` in ``forward``)."""
        c = self.config
        weight = self.embed_tokens.weight
        return torch.zeros(
            c.num_hidden_layers, num_blocks, block_size, c.kv_lora_rank + c.qk_rope_head_dim,
            dtype=dtype or weight.dtype, device=device or weight.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: torch.Tensor,  # [num_hidden_layers, num_blocks, block_size, L+R]
        slot_mapping: torch.Tensor,  # [T]
        block_table: torch.Tensor,  # [B, max_blocks] int32, shared by all layers: the plan's
        plan: PrefillPlan,  # one plan per step (mla_ops.plan_prefill), shared by all layers
        *,
        k_scale: float | torch.Tensor | None = None,
        backend: str = "auto",
    ) -> torch.Tensor:
        if kv_caches.dim() != 4 or kv_caches.shape[0] != len(self.layers):
            raise ValueError(
                f"kv_caches must be [num_hidden_layers={len(self.layers)}, num_blocks, block_size, L+R], "
                f"got shape {tuple(kv_caches.shape)} (see allocate_kv_caches)"
            )
        x = self.embed_tokens(input_ids)  # [T, H]
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, kv_caches[i], slot_mapping, block_table, plan, k_scale=k_scale, backend=backend)
        return self.norm(x)  # [T, H]
