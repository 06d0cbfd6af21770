"""RMSNorm, computed in float32 as the reference implementations do, then cast back."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """``weight * x / rms(x)``; ``offset`` 1.0 is Gemma's ``(1 + weight)`` form."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim, device=device))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)
