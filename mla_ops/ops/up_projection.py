"""Up-projection of a chunk's gathered latent rows to per-head keys and values.

latent           [W, L]        workspace rows (a view of the [W, L+R] workspace)
kv_b_proj_weight [N*(P+V), L]
cu_seq_lens      [n+1] int32   the chunk's workspace offsets: rows [0, cu_seq_lens[-1]) are live
out              [W, N*(P+V)]  rows [0, cu_seq_lens[-1]) written (out=)

The row count is a device value, so a fixed-capacity chunk loop only pays for live rows: a
kernel stops at ``cu_seq_lens[-1]``, and chunks past the device count cost nothing. (The eager
host path knows its counts and calls ``torch.mm`` on exactly the live rows instead.)
"""

from __future__ import annotations

import torch


def up_project_reference(latent, kv_b_proj_weight, cu_seq_lens, out) -> None:
    rows = int(cu_seq_lens[-1])  # host read: CPU / oracle path
    if rows:
        torch.mm(latent.narrow(0, 0, rows), kv_b_proj_weight.t(), out=out.narrow(0, 0, rows))


@torch.library.custom_op("mla_ops::up_project", mutates_args=("out",))
def _up_project(
    latent: torch.Tensor, kv_b_proj_weight: torch.Tensor, cu_seq_lens: torch.Tensor, out: torch.Tensor
) -> None:
    up_project_reference(latent, kv_b_proj_weight, cu_seq_lens, out)


@_up_project.register_fake
def _(latent, kv_b_proj_weight, cu_seq_lens, out) -> None:
    return None
