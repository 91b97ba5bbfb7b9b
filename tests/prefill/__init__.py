"""Tests of mla_ops.prefill: mla_prefill / run_prefill against the dense reference, validation, compile."""
