"""How a step is spread over D ranks: ``ContextParallel`` (the group and its layout) and the
``CostModel`` that routes each request between the all-gather and absorbed-queries paths."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import _checks


@dataclass(frozen=True)
class CostModel:
    """Per-request cost of each context path, per rank and layer, in bytes received and FLOPs.

    c context rows, q new tokens, D ranks, H = num_heads / D heads per rank:

    * all-gather: bytes ``c (D-1)/D (L+R) a`` (the other ranks' rows, in the activation dtype the
      workspace holds); FLOPs ``H c (2L(P+V) + q 2(P+R+V))`` (up-projection and attention).
    * absorbed queries: bytes ``q H (D-1) ((L+R) a + (L+1) p)`` (the other ranks' folded queries,
      then their latent partials and LSEs); FLOPs ``H q (2PL + 2LV + c 2(2L+R))`` (fold, attention
      of D*H heads over c/D local rows, unfold).

    A request takes the absorbed-queries path when ``bytes * flops_per_byte + FLOPs`` is smaller
    there. Defaults: DeepSeek-V3 (128 heads, L=512, P=128, R=64, V=128), bf16 activations, float32
    partials, and an H200's balance of dense bf16 FLOP/s over NVLink bytes/s per direction
    (989e12 / 450e9 ~ 2,200). None of it is measured on a multi-GPU machine yet.
    """

    num_heads: int = 128
    latent: int = 512
    nope: int = 128
    rope: int = 64
    value: int = 128
    activation_bytes: int = 2
    partial_bytes: int = 4
    flops_per_byte: float = 2200.0

    def path_costs(self, context_lens, query_lens, world_size: int) -> dict:
        """``{all_gather,absorbed}_{bytes,flops}`` per request (float64 arrays or tensors)."""
        c, q = _as_float64(context_lens), _as_float64(query_lens)
        d, heads = world_size, self.num_heads / world_size
        lat, nope, rope, value = self.latent, self.nope, self.rope, self.value
        return {
            "all_gather_bytes": c * ((d - 1) / d * (lat + rope) * self.activation_bytes),
            "all_gather_flops": heads * c * (2 * lat * (nope + value) + q * (2 * (nope + rope + value))),
            "absorbed_bytes": q * (heads * (d - 1) * ((lat + rope) * self.activation_bytes
                                                     + (lat + 1) * self.partial_bytes)),
            "absorbed_flops": heads * q * (2 * nope * lat + 2 * lat * value + c * (2 * (2 * lat + rope))),
        }

    def prefers_absorbed(self, context_lens, query_lens, world_size: int):
        """Bool per request: the absorbed-queries path costs less (class doc)."""
        k = self.path_costs(context_lens, query_lens, world_size)
        absorbed = k["absorbed_bytes"] * self.flops_per_byte + k["absorbed_flops"]
        return absorbed < k["all_gather_bytes"] * self.flops_per_byte + k["all_gather_flops"]


def _as_float64(x):
    return x.double() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)


@dataclass(frozen=True)
class ContextParallel:
    """How a step is spread over a process group (module doc); pass to ``plan_prefill``.

    group: the ``torch.distributed`` process group of the D ranks (None: the default group).
    interleave: I, consecutive context tokens per rank (vLLM's ``cp_kv_cache_interleave_size``).
    cost_model: per-request choice of path when ``absorb_max_query_len`` is None.
    check: all-gather a checksum of every rank's plan and raise on disagreement; None follows
      ``mla_ops.set_debug``.
    """

    group: Any = None
    interleave: int = 1
    _: dataclasses.KW_ONLY
    cost_model: CostModel = CostModel()
    check: bool | None = None

    def __post_init__(self):
        _checks.check_int32_size(self.interleave, "interleave")  # compared with int32 lengths
        if not isinstance(self.cost_model, CostModel):
            raise TypeError("cost_model must be a mla_ops.parallel.CostModel, got "
                            f"{type(self.cost_model).__name__}")
        if self.check is not None and not isinstance(self.check, bool):
            raise TypeError(f"check must be True, False or None, got {type(self.check).__name__}")

    @property
    def world_size(self) -> int:
        self._require_group()
        return torch.distributed.get_world_size(self.group)

    @property
    def rank(self) -> int:
        self._require_group()
        return torch.distributed.get_rank(self.group)

    @property
    def process_group(self):
        return torch.distributed.group.WORLD if self.group is None else self.group

    def _require_group(self) -> None:
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            raise ValueError("context_parallel needs an initialized torch.distributed process group "
                             "(torch.distributed.init_process_group, e.g. under torchrun)")
