"""mla-ops as vLLM's MLA attention: a ``vllm.general_plugins`` entry point (``register``), inert unless
``MLA_OPS_VLLM=1``. docs/vllm.md says which requests take which path.

This module imports no vLLM (the plugin's settings and refusals are plain Python); ``register`` imports
vLLM's classes only when the plugin is enabled.
"""

from .plugin import register

__all__ = ["register"]
