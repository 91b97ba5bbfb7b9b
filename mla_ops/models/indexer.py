"""The lightning indexer of DeepSeek Sparse Attention (DESIGN §12): one layer's index queries, head weights
and index keys, from which ``mla_ops.index_topk`` selects the ``index_topk`` keys each query's MLA may see.

T new tokens   H hidden_size   Q q_lora_rank   R qk_rope_head_dim   H_I index_n_heads   D_I index_head_dim
x        [T, H]         the layer's normed input (the attention's)
q_resid  [T, Q]         the attention's q-LoRA latent, ``q_a_layernorm(q_a_proj(x))``; Mistral Large 4
                        (``indexer_q_norm``, no q-LoRA): ``q_input_norm(x)`` [T, H] instead
-> q_index [T, H_I, D_I]   ``wq_b(q_resid)``, its first R dims of each head rotated (the last R: HY-V4's)
   weights [T, H_I]        ``weights_proj(x) * H_I^-0.5 * D_I^-0.5`` (float32, float64 for a float64 model)
   k_index [T, D_I]        ``k_norm(wk(x))`` (a LayerNorm with bias), its first R dims rotated

The score of key s for query t is ``sum_h weights[t, h] * relu(q_index[t, h] . k_index[s])``: transformers'
``softmax_scale`` (D_I^-0.5) and ``n_heads^-0.5`` folded into the weights, as ``relu(a y) = a relu(y)`` for a > 0.
The checkpoint names are transformers' and the releases' (``self_attn.indexer.wq_b`` / ``wk`` / ``k_norm`` /
``weights_proj``). The RoPE is the main attention's frequencies (YaRN included) over the first R dims, rotating
halves: DeepSeek-V3.2's indexer rotates halves as stored; GLM-5's interleaves pairs
(``MLAConfig.indexer_rope_interleave``), whose rows (of ``wq_b`` per head, of ``wk`` and ``k_norm``) the loader
permutes to halves once (``convert_interleaved``), which changes no score: q and k are permuted alike and the
LayerNorm is permuted with its weight and bias. ``weights_proj`` stays float32 in half-precision models, as
transformers keeps it.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from .config import MLAConfig
from .parts import acc_dtype, linear
from .query_scale import LogPositionScale
from .rope import apply_rotary_emb, deinterleave_index

K_NORM_EPS = 1e-6  # transformers' and DeepSeek's indexer LayerNorm


class Indexer(nn.Module):
    def __init__(self, config: MLAConfig, layer_idx: int = 0):
        super().__init__()
        c, std = config, config.initializer_range
        # A NoPE layer's indexer (Mistral Large 4's no_rope_layers) rotates nothing either
        rope_dim = c.qk_rope_head_dim if c.uses_rope(layer_idx) else 0
        heads, width, q_norm = c.indexer.index_n_heads, c.indexer.index_head_dim, c.indexer.indexer_q_norm
        self.n_heads, self.head_dim, self.rope_dim = heads, width, rope_dim
        # Mistral Large 4 (indexer_q_norm): no q-LoRA latent; the queries read a LayerNorm of the layer input
        self.q_input_norm = nn.LayerNorm(c.hidden_size, eps=K_NORM_EPS) if q_norm else None
        self.wq_b = linear(c.hidden_size if q_norm else c.q_lora_rank, heads * width, std)
        self.wk = linear(c.hidden_size, width, std)
        self.k_norm = nn.LayerNorm(width, eps=c.indexer.indexer_norm_eps)
        self.rope_last = c.indexer.indexer_rope_last  # HY-V4's: the last R dims rotated
        self.weights_proj = linear(c.hidden_size, heads, std)
        self.weight_scale = (heads * width) ** -0.5  # folded into the head weights
        # Mistral Large 4's learned per-head query scale (learned_query_scale), or None
        self.softmax_scaling = LogPositionScale(heads) if c.scalings.learned_query_scale else None

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor):
        """(q_index [T, H_I, D_I], weights [T, H_I], k_index [T, D_I]) of the module doc; cos, sin [T, R].
        ``q_resid`` None with ``q_input_norm`` (the queries then read ``x``)."""
        num_tokens, R = x.shape[0], self.rope_dim
        q_in = q_resid if self.q_input_norm is None else self.q_input_norm(x)
        q = self.wq_b(q_in).view(num_tokens, self.n_heads, self.head_dim)  # [T, H_I, D_I]
        k = self.k_norm(self.wk(x))  # [T, D_I]
        if R and self.rope_last:
            q = torch.cat([q[..., :-R], apply_rotary_emb(q[..., -R:], cos[:, None, :], sin[:, None, :])], dim=-1)
            k = torch.cat([k[..., :-R], apply_rotary_emb(k[..., -R:], cos, sin)], dim=-1)
        elif R:
            q = torch.cat([apply_rotary_emb(q[..., :R], cos[:, None, :], sin[:, None, :]), q[..., R:]], dim=-1)
            k = torch.cat([apply_rotary_emb(k[..., :R], cos, sin), k[..., R:]], dim=-1)
        dtype = acc_dtype(self.weights_proj.weight.dtype)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).to(dtype) * self.weight_scale
        return q, weights, k  # [T, H_I, D_I], [T, H_I], [T, D_I]

    def scaled_queries(self, q: torch.Tensor, log_positions: torch.Tensor | None) -> torch.Tensor:
        """q_index [T, H_I, D_I] times the learned per-head factors (Mistral Large 4's; a factor per head
        commutes with the rotation, and may be negative, so it is not folded into the relu'd weights)."""
        return q if self.softmax_scaling is None else self.softmax_scaling(q, log_positions)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_WQ_B = re.compile(r"\.self_attn\.indexer\.wq_b\.weight$")
_WK_NORM = re.compile(r"\.self_attn\.indexer\.(wk\.weight|k_norm\.weight|k_norm\.bias)$")


def convert_interleaved(config: MLAConfig, target: str, tensor: torch.Tensor) -> torch.Tensor:
    """An indexer tensor of an interleaved-RoPE checkpoint (GLM-5) with its first R rows (of each head for
    ``wq_b``) as halves; other tensors, and a NoPE layer's (no rotation), unchanged."""
    layer = _LAYER.match(target)
    interleaved = config.is_sparse and config.indexer.indexer_rope_interleave
    if not interleaved or (layer and not config.uses_rope(int(layer.group(1)))):
        return tensor
    R, D = config.qk_rope_head_dim, config.indexer.index_head_dim
    order = deinterleave_index(R)
    if config.indexer.indexer_rope_last:  # HY-V4's rotated dims are the last R
        order = torch.cat([torch.arange(D - R), D - R + order])
    else:
        order = torch.cat([order, torch.arange(R, D)])
    if _WQ_B.search(target):
        heads = tensor.view(-1, D, tensor.shape[-1])  # [H_I, D_I, Q]
        return heads[:, order].reshape(tensor.shape)
    if _WK_NORM.search(target):
        return tensor[order]
    return tensor
