"""Argument checks of the public functions: errors name the argument, what was expected and what
arrived, and run on shapes and host values only (before any kernel)."""

from __future__ import annotations

import numbers

import torch


def check_tensor(x, name: str, ndim: int, shape_doc: str, device: torch.device, device_of: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_doc}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {shape_doc}, got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device} (the device of {device_of}), got {x.device}")


def check_k_scale(k_scale, kv_cache: torch.Tensor, device: torch.device) -> None:
    """``k_scale``: required for a float8_e4m3fn cache; a positive float or a one-element float32
    tensor on ``device``; ignored for other cache dtypes."""
    if kv_cache.dtype == torch.float8_e4m3fn and k_scale is None:
        raise ValueError("k_scale is required for a float8_e4m3fn kv_cache (dequantized = stored * k_scale)")
    if isinstance(k_scale, torch.Tensor):
        if k_scale.numel() != 1 or k_scale.dtype != torch.float32:
            raise ValueError(
                f"k_scale must be a float or a one-element float32 tensor, got {k_scale.numel()} "
                f"elements of {k_scale.dtype}"
            )
        if k_scale.device != device:
            raise ValueError(f"k_scale must be on {device}, got {k_scale.device}")
    elif k_scale is not None:
        if isinstance(k_scale, bool) or not isinstance(k_scale, numbers.Real):
            raise TypeError(f"k_scale must be a float or a one-element float32 tensor, got {type(k_scale).__name__}")
        if not k_scale > 0:
            raise ValueError(f"k_scale must be positive, got {k_scale}")
