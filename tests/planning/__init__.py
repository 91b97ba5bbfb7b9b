"""Tests of mla_ops.planning: the host and device chunk planners, routing, plan_prefill."""
