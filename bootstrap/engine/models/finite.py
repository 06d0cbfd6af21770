"""Weights that are NaN or inf refused where they are read: one reduction over what was just read
(``torch.aminmax``: NaN propagates into both ends, an infinity is one of them), while the bytes
are still in the reader's cache; e4m3 has no infinity, its NaN is every exponent and mantissa bit."""

from __future__ import annotations

import torch

from bootstrap.engine.models.files import ModelSourceError

FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_finite(values: torch.Tensor) -> bool:
    """Every element of ``values`` a finite number (integer tensors always are)."""
    if not values.dtype.is_floating_point or values.numel() == 0:
        return True
    if values.dtype == torch.float8_e4m3fn:
        return not bool((values.view(torch.uint8) & 0x7F).eq(0x7F).any())
    if values.dtype in FP8_TYPES:
        return bool(values.float().isfinite().all())
    low, high = torch.aminmax(values)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def check_finite(values: torch.Tensor, file: object, name: str) -> None:
    """``ModelSourceError`` naming tensor ``name`` of ``file`` when ``values`` (some or all of it)
    hold NaN or inf."""
    if not is_finite(values):
        raise ModelSourceError(f"{file}: tensor {name!r} is not finite (it holds NaN or inf); weights must be finite")
