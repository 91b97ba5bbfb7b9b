"""Tests of mla_ops.ops: each op family against its torch reference, opcheck, the GPU kernels."""
