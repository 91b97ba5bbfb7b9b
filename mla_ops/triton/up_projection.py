"""Triton kernel: up-projection of a chunk's gathered latent rows to per-head keys and values.

latent           [W, L]        workspace rows (may be a strided view of the [W, L+R] workspace)
kv_b_proj_weight [N*(P+V), L]
cu_seq_lens      [n+1] int32   rows [0, cu_seq_lens[-1]) are live; the count stays on the device
out              [W, N*(P+V)]  rows [0, cu_seq_lens[-1]) written, fp32 accumulation (out=)

``out[:M] = latent[:M] @ kv_b_proj_weight.T`` with ``M = cu_seq_lens[-1]`` (oracle:
``up_project_reference`` in ``mla_ops/up_projection.py``): the persistent rows GEMM of
``rows_gemm.py`` with one weight, so empty chunks of a fixed-capacity loop cost only a launch.
"""

from __future__ import annotations

from .rows_gemm import rows_gemm


def up_project(latent, kv_b_proj_weight, cu_seq_lens, out) -> None:
    """``out[:M] = latent[:M] @ kv_b_proj_weight.T``, M = cu_seq_lens[-1] read on the device."""
    rows_gemm(latent.unsqueeze(1), kv_b_proj_weight.unsqueeze(0), out.unsqueeze(1), cu_seq_lens)
