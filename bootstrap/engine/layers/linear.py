"""Linear layers that say how the checkpoint fills them, for one rank of ``Shard``.

``FusedLinear`` holds several checkpoint matrices stacked by output rows (q, k and v; gate and
up): one GEMM instead of several. Under tensor parallelism it is column-parallel: each part
keeps this rank's rows of its checkpoint matrix (its heads, its slice of the MLP), so the fused
output is this rank's and needs no collective. ``RowLinear`` is row-parallel: it keeps this
rank's input columns, multiplies the rank's activations, and sums the ranks' partial outputs
with one all-reduce (the bias added once, after it). One rank (``Shard()``) is the plain layer.

``checkpoint_index`` names the part of a checkpoint tensor this rank reads, so the loader reads
only that slice from the file, straight into its place. Every product goes through ``project``:
one row of half-precision input on CUDA takes ``gemv``'s kernel, the rest ``F.linear``; an FP8
weight (``layers.fp8``) takes ``fp8_gemm`` on CUDA and is dequantized elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bootstrap.engine.kernels import fp8_gemm, gemv
from bootstrap.engine.layers.fp8 import dequantized, is_fp8

Index = tuple[slice, ...]


def _product(module: torch.nn.Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ module.weight.T (+ bias)``, an FP8 weight with its scales (module docstring)."""
    weight = module.weight
    if not is_fp8(weight):
        return project(x, weight, bias)
    if fp8_gemm.usable(x, weight):
        return fp8_gemm.linear(x, weight, module.weight_scale, module.fp8_block, bias)
    return F.linear(x, dequantized(module, x.dtype), bias)


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: ``gemv.linear`` where ``gemv.usable`` says, else ``F.linear``."""
    if gemv.usable(x, weight):
        return gemv.linear(x, weight, bias)
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class Shard:
    """This rank's place among ``size`` tensor-parallel ranks."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside 0..{self.size - 1}")

    def local(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what} ({n}) does not split over {self.size} tensor-parallel ranks")
        return n // self.size

    def span(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` rows or columns."""
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)


class FusedLinear(torch.nn.Linear):
    def __init__(
        self,
        in_features: int,
        parts: dict[str, int],
        bias: bool = False,
        device: torch.device | str | None = None,
        shard: Shard = Shard(),
    ) -> None:
        """``parts``: each checkpoint matrix's full number of output rows; this rank keeps its share."""
        local = {name: shard.local(rows, name) for name, rows in parts.items()}
        super().__init__(in_features, sum(local.values()), bias=bias, device=device)
        self.shard = shard
        self.parts: dict[str, slice] = {}
        start = 0
        for name, rows in local.items():
            self.parts[name] = slice(start, start + rows)
            start += rows

    def checkpoint_index(self, part: str, kind: str, shape: list[int]) -> Index:
        """This rank's rows of the checkpoint's ``part`` weight, bias or scales of ``shape`` (a
        part's single per-tensor scale: all of it)."""
        if kind == "weight_scale" and math.prod(shape) == 1:
            return ()
        return (self.shard.span(shape[0]),)

    def part_target(self, part: str, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The rows of the weight (``kind`` "weight"), bias or scales that this rank's slice of
        the checkpoint's ``part`` fills, the slice being of ``shape``."""
        target = getattr(self, kind, None)
        rows = self.parts[part]
        if kind == "weight_scale":
            return self._scale_rows(part, target, shape)
        if target is None or shape[0] != rows.stop - rows.start or tuple(shape[1:]) != tuple(target.shape[1:]):
            raise ValueError(
                f"{part}.{kind}: checkpoint shape {tuple(shape)} does not fit rows {rows} of "
                f"{tuple(target.shape) if target is not None else 'no bias'}"
            )
        return target[rows]

    def _scale_rows(self, part: str, target: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        """The scales of ``part``: its rows' (one per row, or a per-tensor one filling them all),
        or with blocks its block rows (the part's rows a whole number of blocks)."""
        rows = self.parts[part]
        block = getattr(self, "fp8_block", None)
        if target is None:
            raise ValueError(f"{part}: a checkpoint scale for a projection that is not FP8 here")
        if block is not None:
            if rows.start % block[0] or rows.stop % block[0]:
                raise ValueError(f"{part}: rows {rows} are not whole blocks of {block[0]} (weight_block_size)")
            rows = slice(rows.start // block[0], rows.stop // block[0])
        elif math.prod(shape) == 1:
            return target[rows]
        if shape[0] != rows.stop - rows.start or tuple(shape[1:]) != tuple(target.shape[1:]):
            raise ValueError(f"{part}.weight_scale: checkpoint shape {tuple(shape)} does not fit rows {rows}")
        return target[rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _product(self, x, self.bias)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split([s.stop - s.start for s in self.parts.values()], dim=-1))


class RowLinear(torch.nn.Linear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: torch.device | str | None = None,
        shard: Shard = Shard(),
    ) -> None:
        """``in_features``: the full input width; this rank keeps its share of the columns."""
        super().__init__(shard.local(in_features, "input features"), out_features, bias=bias, device=device)
        self.shard = shard

    def checkpoint_index(self, part: None, kind: str, shape: list[int]) -> Index:
        """This rank's input columns of the weight, of block scales its column blocks (whole
        blocks on every rank: ``make_fp8`` sized them so); row and per-tensor scales whole."""
        block = getattr(self, "fp8_block", None)
        if kind == "weight_scale" and (block is None or math.prod(shape) == 1):
            return ()
        if kind == "weight_scale" and self.shard.size > 1:
            columns = self.shard.local(shape[1], "weight_scale column blocks")
            if self.in_features != columns * block[1]:
                raise ValueError(
                    f"weight_scale: {self.in_features} input columns per rank are not whole blocks of {block[1]}"
                )
        return (slice(None), self.shard.span(shape[1])) if kind in ("weight", "weight_scale") else (slice(None),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return _product(self, x, self.bias)
        out = _product(self, x, None) if is_fp8(self.weight) else F.linear(x, self.weight)
        torch.distributed.all_reduce(out)
        return out if self.bias is None else out + self.bias


class HeadLinear(torch.nn.Linear):
    """The output head: whole on every rank, its product through ``project``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias)
