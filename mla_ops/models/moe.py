"""DeepSeek's feed-forward blocks: the dense gated MLP and the mixture of experts (V2 and V3 gates).

x [T, H]   E n_routed_experts   k num_experts_per_tok   I moe_intermediate_size   G n_group
gate: router logits [T, E] (float32) -> top-k experts per token: indices [T, k], weights [T, k]
experts.gate_up_proj [E, 2I, H]   experts.down_proj [E, H, I]   (the names and layout of transformers 5)
-> out [T, H] = sum_k weight * expert(x) + shared_experts(x)

Z ``zero_expert_num`` identity experts (LongCat-Flash's zero-computation experts) follow the E routed ones:
the gate scores all E + Z, and a token routed to expert E + z gets ``weight * x``, with no weights at all.

Gates (the reference is transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter):

* V2: softmax scores; ``greedy`` top-k, or ``group_limited_greedy``: keep the ``topk_group`` groups with
  the highest single score, then top-k among them. Weights are the scores times
  ``routed_scaling_factor``; with ``norm_topk_prob`` (and k > 1) they are instead normalised to sum 1,
  as DeepSeek's own V2 code does (transformers' V2 ignores the flag; no release sets it).
* V3 (``noaux_tc``): sigmoid scores; groups ranked by the sum of their two best scores corrected by
  ``e_score_correction_bias`` (a buffer, float32); top-k of the corrected scores in the kept groups;
  weights are the uncorrected scores, normalised if ``norm_topk_prob``, times ``routed_scaling_factor``.
* A.X-K2 (``noaux_tc_zero``, transformers' AXK2TopkRouter): V3's, but the experts of the dropped groups keep a
  score of 0 (not -inf), so one may still be picked over a kept expert whose corrected score is below 0.
* Mistral 4 (``group_top2``, transformers' Mistral4TopkRouter): V3's group-limited top-k with no correction
  bias (softmax scores: groups ranked by the sum of their two best).

HY-V4's routed experts clamp their SwiGLU (``swiglu_limit``): ``silu(min(gate, limit)) * clamp(up, -limit, limit)``
(the shared experts and the dense MLP do not).

Expert compute (``MoE.impl``), both fixed-shape tensor code: no host read, no data-dependent shape,
so a step compiles to one graph and can be captured in a CUDA graph:

* ``"grouped"``: the T*k (token, expert) pairs sorted by expert (a stable argsort), the tokens gathered,
  two grouped GEMMs over per-expert row offsets (``torch._grouped_mm``), scaled and index-added back:
  exactly the useful FLOPs. Under torch.compile (and on CUDA, SM90) the op takes bfloat16 only, with
  H and I multiples of 8; eager on CPU it takes float16, bfloat16 and float32.
* ``"dense"``: every expert on every token in one batched matmul, weighted by the (mostly zero)
  combine matrix [T, E]: E/k times the useful FLOPs, any dtype, any device.
* ``"auto"``: grouped for bfloat16, and eagerly on the CPU for 16/32-bit floats; dense otherwise
  (float32 under torch.compile or on CUDA, float64). ``benchmarks/moe_bench.py`` (CPU, eager, one
  thread): from 64 experts on grouped is 1.5x to 37x faster than dense at 1 to 256 tokens; with 8
  experts dense wins up to 16 float32 tokens (0.10 vs 0.18 ms for one token), grouped above; a
  per-expert masked loop (dense FLOPs, E small GEMMs) is slower than one of the two everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .parts import linear

IMPLS = ("auto", "dense", "grouped")


class FeedForward(nn.Module):
    """The dense gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, std: float):
        super().__init__()
        self.gate_proj = linear(hidden_size, intermediate_size, std)
        self.up_proj = linear(hidden_size, intermediate_size, std)
        self.down_proj = linear(intermediate_size, hidden_size, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [T, I] -> [T, H]


class MoEGate(nn.Module):
    """Router: x [T, H] -> (weights [T, k] float32, indices [T, k] int64). Kept in float32."""

    def __init__(self, config):
        super().__init__()
        c = config
        self.top_k, self.num_experts = c.num_experts_per_tok, c.n_routed_experts + c.zero_expert_num
        self.scoring_func, self.topk_method = c.scoring_func, c.topk_method
        self.n_group, self.topk_group = c.n_group, c.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = c.norm_topk_prob, c.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, c.hidden_size, dtype=torch.float32))
        nn.init.normal_(self.weight, std=c.initializer_range)
        if c.topk_method in ("noaux_tc", "noaux_tc_zero"):
            self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, G] group scores -> [T, E] bool, true for the experts of the topk_group best groups."""
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)  # [T, G]
        per_group = self.num_experts // self.n_group
        return group_mask.bool()[:, :, None].expand(-1, -1, per_group).reshape(group_scores.shape[0], self.num_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, k = x.shape[0], self.top_k
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        scores = logits.softmax(dim=-1, dtype=torch.float32) if self.scoring_func == "softmax" else logits.sigmoid()
        per_group = self.num_experts // self.n_group  # not -1: a step may have no tokens
        grouped = scores.view(num_tokens, self.n_group, per_group)  # [T, G, E/G]
        if self.topk_method in ("noaux_tc", "group_top2", "noaux_tc_zero"):
            biased = self.topk_method != "group_top2"
            choice = scores + self.e_score_correction_bias if biased else scores  # [T, E]
            group_scores = choice.view(num_tokens, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            dropped = 0.0 if self.topk_method == "noaux_tc_zero" else float("-inf")  # A.X-K2's: 0
            choice = choice.masked_fill(~self._group_mask(group_scores), dropped)
            indices = torch.topk(choice, k=k, dim=-1, sorted=False)[1]  # [T, k]
            weights = scores.gather(1, indices)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return weights * self.routed_scaling_factor, indices
        if self.topk_method == "group_limited_greedy":
            scores = scores.masked_fill(~self._group_mask(grouped.max(dim=-1).values), 0.0)
        weights, indices = torch.topk(scores, k=k, dim=-1, sorted=False)
        if k > 1 and self.norm_topk_prob:
            return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), indices
        return weights * self.routed_scaling_factor, indices


class Experts(nn.Module):
    """E gated MLPs stored as two 3-D tensors (checkpoints' per-expert tensors are stacked at load)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, std: float,
                 swiglu_limit: float | None = None):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.swiglu_limit = swiglu_limit  # HY-V4's: gate <= limit, -limit <= up <= limit; None: no clamp
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))  # [E, H, I]
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=std)

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        if self.swiglu_limit is not None:
            gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(-self.swiglu_limit, self.swiglu_limit)
        return F.silu(gate) * up

    def dense(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        num_experts = self.gate_up_proj.shape[0]
        # scatter_add_: MoE.forward parks identity experts' pairs on expert 0 with weight 0
        combine = x.new_zeros(x.shape[0], num_experts).scatter_add_(1, indices, weights.to(x.dtype))  # [T, E]
        h = torch.matmul(x.unsqueeze(0), self.gate_up_proj.transpose(1, 2))  # [E, T, 2I]
        y = torch.matmul(self._act(h), self.down_proj.transpose(1, 2))  # [E, T, H]
        return torch.einsum("eth,te->th", y, combine)  # [T, H]

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        num_tokens, k = indices.shape
        num_experts = self.gate_up_proj.shape[0]
        expert = indices.reshape(-1)  # [T*k]
        order = torch.argsort(expert, stable=True)  # pairs grouped by expert
        token = order // k  # [T*k] token of each sorted pair
        counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device).scatter_add_(
            0, expert, torch.ones_like(expert, dtype=torch.int32))  # [E], no bincount: fixed size
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] end row of each expert's group
        rows = x.index_select(0, token)  # [T*k, H]
        h = torch._grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=offsets)  # [T*k, 2I]
        y = torch._grouped_mm(self._act(h), self.down_proj.transpose(1, 2), offs=offsets)  # [T*k, H]
        y = y * weights.reshape(-1).index_select(0, order).to(y.dtype)[:, None]
        return x.new_zeros(num_tokens, x.shape[1]).index_add_(0, token, y)  # [T, H]


class MoE(nn.Module):
    """Routed experts plus (optionally) shared experts, DeepSeek-V2/V3's feed-forward after the dense layers."""

    def __init__(self, config, impl: str = "auto"):
        super().__init__()
        c = config
        self.gate = MoEGate(c)
        self.experts = Experts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, c.initializer_range,
                               c.swiglu_limit)
        self.shared_experts = None
        if c.n_shared_experts:
            shared = c.shared_expert_intermediate_size or c.moe_intermediate_size  # dots3_note's own size
            self.shared_experts = FeedForward(c.hidden_size, shared * c.n_shared_experts,
                                              c.initializer_range)
        self.zero_expert_num = c.zero_expert_num
        self.impl = impl

    @property
    def impl(self) -> str:
        return self._impl

    @impl.setter
    def impl(self, value: str) -> None:
        if value not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {value!r}")
        self._impl = value

    def resolved_impl(self, x: torch.Tensor) -> str:
        if self._impl != "auto":
            return self._impl
        eager_cpu = x.device.type == "cpu" and x.dtype != torch.float64 and not torch.compiler.is_compiling()
        return "grouped" if x.dtype == torch.bfloat16 or eager_cpu else "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x)  # [T, k] each
        if self.zero_expert_num:  # identity experts: x times their weights; their pairs weigh 0 on expert 0
            identity = indices >= self.experts.gate_up_proj.shape[0]  # [T, k]
            identity_weight = weights.masked_fill(~identity, 0.0).sum(dim=-1, keepdim=True)  # [T, 1]
            weights, indices = weights.masked_fill(identity, 0.0), indices.masked_fill(identity, 0)
        impl = self.resolved_impl(x)
        if impl == "grouped" and x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
            raise ValueError(f"MoE impl 'grouped' compiles for bfloat16 only (torch._grouped_mm), got {x.dtype}")
        routed = self.experts.grouped if impl == "grouped" else self.experts.dense
        out = routed(x, weights, indices)
        if self.zero_expert_num:
            out = out + x * identity_weight.to(x.dtype)
        return out if self.shared_experts is None else out + self.shared_experts(x)
