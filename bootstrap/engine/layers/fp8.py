"""FP8 weights in the engine's projections: the weight stored in e4m3 as the checkpoint has it,
and its scales beside it (``weight_scale``: one per output row, or one per block of
``block`` rows x columns), as ``capacity.quantization`` reads the layouts. A checkpoint's
per-tensor scale fills every row of its part; block-wise ``weight_scale_inv`` multiplies, as
compressed-tensors' ``weight_scale`` does. The product dequantizes the weight for the matmul.
"""

from __future__ import annotations

import math

import torch

from bootstrap.engine.kernels.fp8_gemm import FP8, FP8_MAX, MIN_AMAX, dequantize

SCALE_NAMES = ("weight_scale", "weight_scale_inv")  # compressed-tensors; block-wise fp8


def make_fp8(module: torch.nn.Linear, block: tuple[int, int] | None) -> None:
    """Give ``module`` (still on the meta device) an e4m3 weight and its scales."""
    rows, columns = module.weight.shape
    device = module.weight.device
    module.weight = torch.nn.Parameter(torch.empty((rows, columns), dtype=FP8, device=device), requires_grad=False)
    shape = (math.ceil(rows / block[0]), math.ceil(columns / block[1])) if block else (rows, 1)
    scale = torch.empty(shape, dtype=torch.float32, device=device)
    module.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    module.fp8_block = block


def is_fp8(weight: torch.Tensor) -> bool:
    return weight.dtype == FP8


def dequantized(module: torch.nn.Linear, dtype: torch.dtype) -> torch.Tensor:
    """The weight in ``dtype``: e4m3 times its scales, in float32 first (``fp8_gemm.dequantize``)."""
    return dequantize(module.weight, module.weight_scale, module.fp8_block, dtype)


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` in e4m3, saturated at its largest finite value (no NaN for a key past it)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` in e4m3 with one float32 scale per row (the absolute maximum over 448)."""
    scale = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    return (weight.float() / scale).to(FP8), scale
