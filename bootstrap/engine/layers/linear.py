"""A linear layer holding several checkpoint matrices stacked by output rows (q, k and v; gate
and up): one GEMM instead of several. Each part declares its rows, so the loader copies a
checkpoint tensor straight into its slice of the fused weight."""

from __future__ import annotations

import torch


class FusedLinear(torch.nn.Linear):
    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False,
                 device: torch.device | str | None = None) -> None:  # fmt: skip
        super().__init__(in_features, sum(parts.values()), bias=bias, device=device)
        self.parts: dict[str, slice] = {}
        start = 0
        for name, rows in parts.items():
            self.parts[name] = slice(start, start + rows)
            start += rows

    def load_part(self, part: str, kind: str, tensor: torch.Tensor) -> None:
        """Copy the checkpoint's ``part`` weight (``kind`` "weight") or bias into its rows."""
        target = self.weight if kind == "weight" else self.bias
        rows = self.parts[part]
        if target is None or tensor.shape[0] != rows.stop - rows.start or tensor.shape[1:] != target.shape[1:]:
            raise ValueError(f"{part}.{kind}: checkpoint shape {tuple(tensor.shape)} does not fit rows {rows} of "
                             f"{tuple(target.shape) if target is not None else 'no bias'}")  # fmt: skip
        with torch.no_grad():
            target[rows].copy_(tensor)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split([s.stop - s.start for s in self.parts.values()], dim=-1))
