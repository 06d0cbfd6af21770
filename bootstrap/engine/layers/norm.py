"""RMSNorm, computed in float32 as the reference implementations do, then cast back; with the
residual add folded in when given one (one Triton kernel on CUDA, ``layers.fused``)."""

from __future__ import annotations

import torch

from bootstrap.engine.kernels import fused


class RMSNorm(torch.nn.Module):
    """``weight * x / rms(x)``; ``offset`` 1.0 is Gemma's ``(1 + weight)`` form."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim, device=device))
        self.eps, self.offset = eps, offset

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``, the sum
        rounded to the dtype first (as ``x = x + residual`` in eager code rounds it)."""
        if fused.usable(x):
            out, summed = fused.rms_norm(x, self.weight, self.eps, self.offset, residual)
            return out if residual is None else (out, summed)
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)
