"""The packed chunk schedule as fixed-capacity device tensors, for compiled and captured code.

context_lens [B] int32 (on the device)    workspace_size W, max_chunks K: static ints
-> starts [K, B] int32, seq_lens [K, B] int32, cu_seq_lens [K, B+1] int32, num_chunks [] int32

Row ``k`` describes chunk ``k`` over the whole batch: request r takes ``seq_lens[k, r]`` rows from
context offset ``starts[k, r]`` into workspace rows ``cu_seq_lens[k, r] ..``; requests with no rows
in the chunk have ``seq_len 0``. It is the host planner's ``"packed"`` schedule
(``split_alignment=1``) spread over all B requests: chunk k is rows ``[k*W, (k+1)*W)`` of the
concatenated context stream. Everything is broadcast arithmetic on one cumsum (no host sync), so
Inductor fuses it into a kernel or two. Chunks past ``num_chunks`` are empty (all ``seq_len 0``):
kernels do nothing for them. ``num_chunks > K`` means the capacity was too small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import check_int32, check_int32_size


@dataclass(frozen=True)
class DeviceSchedule:
    starts: torch.Tensor  # [K, B] int32
    seq_lens: torch.Tensor  # [K, B] int32
    cu_seq_lens: torch.Tensor  # [K, B+1] int32
    num_chunks: torch.Tensor  # [] int32: chunks the batch needs (may exceed max_chunks)
    workspace_size: int

    @property
    def max_chunks(self) -> int:
        return self.starts.shape[0]

    @property
    def overflow(self) -> torch.Tensor:
        """Device bool: the batch needs more chunks than the capacity holds."""
        return self.num_chunks > self.max_chunks


def device_plan_tensors(context_lens: torch.Tensor, workspace_size: int, max_chunks: int):
    lens = context_lens.long()
    cu = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0))  # [B+1] stream offsets
    total = cu[-1:]
    begin = torch.arange(max_chunks, device=lens.device).unsqueeze(1) * workspace_size  # [K, 1]
    end = torch.minimum(torch.maximum(total, begin), begin + workspace_size)  # empty past the total
    lo = torch.maximum(cu[:-1], begin)  # [K, B]
    hi = torch.minimum(cu[1:], end)
    seq_lens = (hi - lo).clamp(min=0)
    starts = torch.where(seq_lens > 0, lo - cu[:-1], torch.zeros_like(lo))
    cu_seq_lens = torch.minimum(torch.maximum(cu, begin), end) - begin  # [K, B+1]
    num_chunks = (cu[-1] + workspace_size - 1) // workspace_size
    return starts.int(), seq_lens.int(), cu_seq_lens.int(), num_chunks.int()


@torch.library.custom_op("mla_ops::plan_context_chunks_device", mutates_args=())
def _plan_context_chunks_device(
    context_lens: torch.Tensor, workspace_size: int, max_chunks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return device_plan_tensors(context_lens, workspace_size, max_chunks)


@_plan_context_chunks_device.register_fake
def _(context_lens, workspace_size, max_chunks):
    batch = context_lens.shape[0]
    new = lambda *shape: context_lens.new_empty(shape, dtype=torch.int32)  # noqa: E731
    return new(max_chunks, batch), new(max_chunks, batch), new(max_chunks, batch + 1), new()


def plan_context_chunks_device(context_lens: torch.Tensor, workspace_size: int, max_chunks: int) -> DeviceSchedule:
    """The packed schedule of ``context_lens`` in ``max_chunks`` fixed slots (see module doc)."""
    check_int32(context_lens, "context_lens", 1, "[B]")
    check_int32_size(workspace_size, "workspace_size")  # compared with int32 lengths
    check_int32_size(max_chunks, "max_chunks")
    starts, seq_lens, cu_seq_lens, num_chunks = torch.ops.mla_ops.plan_context_chunks_device(
        context_lens, workspace_size, max_chunks
    )
    return DeviceSchedule(starts, seq_lens, cu_seq_lens, num_chunks, workspace_size)
