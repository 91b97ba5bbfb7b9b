"""Tests of mla_ops.models: the MLA layer and model, MoE, checkpoints against transformers."""
