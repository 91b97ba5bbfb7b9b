"""Lengths -> ``PrefillPlan``: the chunk schedule (host and device form), the per-request routing
and the options that shape them. No kernels."""
