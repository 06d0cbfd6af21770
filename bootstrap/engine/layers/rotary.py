"""Rotary position embeddings with the config's scaling: none, ``linear`` and ``llama3``.

Frequencies follow the reference implementations exactly (float32, ``cat(freqs, freqs)``,
``rotate_half``); ``rope_scaling_problem`` names a scaling this module does not implement, so
the loader can keep such a model on the transformers path instead of computing it wrongly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

SCALINGS = ("default", "linear", "llama3")


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_scaling_problem(scaling: Mapping[str, Any] | None) -> str | None:
    kind = rope_type(scaling)
    return None if kind in SCALINGS else f"rope scaling {kind!r} (implemented: {', '.join(SCALINGS)})"


def inverse_frequencies(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[index]
    if kind == "llama3":
        return _llama3(inv_freq, scaling)  # type: ignore[arg-type]
    return inv_freq


def _llama3(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary(torch.nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False)

    def reset(self, device: torch.device) -> None:
        """Recompute the frequencies, in float32, on ``device`` (after a build on the meta device)."""
        self.inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling).to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[T, head_dim]`` for ``positions [T]``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, head_dim]`` rotated by ``cos, sin [T, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
