"""Engines that run mla-ops as their attention (DESIGN §13). Nothing inside the package imports them."""
