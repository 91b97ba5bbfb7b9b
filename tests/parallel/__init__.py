"""Tests of mla_ops.parallel: context parallel layout, cost model, in-process and multi-process runs."""
