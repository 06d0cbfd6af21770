"""Rotary position embeddings with the config's scaling: none, ``linear``, ``llama3`` and ``yarn``.

Frequencies follow transformers' ``modeling_rope_utils`` exactly (float32, ``cat(freqs, freqs)``,
``rotate_half``; yarn's ``attention_factor`` multiplies cos and sin). ``rope_scaling_problem`` names
a scaling this module does not implement, so the loader can keep such a model on the transformers
path instead of computing it wrongly: ``dynamic`` and ``longrope`` pick their frequencies from the
longest sequence of each forward, so there a token's result depends on what it is batched with.

``max_position_embeddings`` is config.json's; ``original_max_position_embeddings`` is its top-level
field, which transformers prefers over the scaling's own for llama3 and yarn. Yarn needs
``max_position_embeddings`` where its scaling gives no ``original_max_position_embeddings`` or no ``factor``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from bootstrap.engine.kernels import fused

SCALINGS = ("default", "linear", "llama3", "yarn")
REFUSED = {
    "dynamic": "frequencies recomputed from the longest sequence in the batch",
    "longrope": "short or long factors chosen by the longest sequence in the batch",
}


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_scaling_problem(scaling: Mapping[str, Any] | None) -> str | None:
    if scaling and any(isinstance(value, Mapping) for value in scaling.values()):
        return f"rope parameters per layer type ({', '.join(scaling)})"
    kind = rope_type(scaling)
    if kind not in SCALINGS:
        why = f"{REFUSED[kind]}; " if kind in REFUSED else ""
        return f"rope scaling {kind!r} ({why}implemented: {', '.join(SCALINGS)})"
    partial = (scaling or {}).get("partial_rotary_factor", 1.0)
    return None if partial == 1.0 else f"partial_rotary_factor {partial}"


def inverse_frequencies(
    head_dim: int,
    theta: float,
    scaling: Mapping[str, Any] | None,
    *,
    max_position_embeddings: int | None = None,
    original_max_position_embeddings: int | None = None,
) -> torch.Tensor:
    kind, scaling = rope_type(scaling), scaling or {}
    if kind == "yarn":
        original = _original(scaling, max_position_embeddings, original_max_position_embeddings)
        return _yarn(head_dim, theta, scaling, _yarn_factor(scaling, max_position_embeddings, original), original)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, scaling, _original(scaling, max_position_embeddings, original_max_position_embeddings))
    return inv_freq


def attention_scaling(
    scaling: Mapping[str, Any] | None,
    *,
    max_position_embeddings: int | None = None,
    original_max_position_embeddings: int | None = None,
) -> float:
    """The factor on cos and sin: yarn's ``attention_factor`` (given, or from ``factor`` and
    ``mscale``/``mscale_all_dim``), 1.0 for the other scalings."""
    if scaling is None or rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    original = _original(scaling, max_position_embeddings, original_max_position_embeddings)
    factor = _yarn_factor(scaling, max_position_embeddings, original)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
    return _mscale(factor)


def _original(scaling: Mapping[str, Any], max_positions: int | None, top_level: int | None) -> int:
    """The pretraining length: config.json's top-level field, the scaling's, else max_position_embeddings."""
    for value in (top_level, scaling.get("original_max_position_embeddings"), max_positions):
        if value is not None:
            return value
    raise ValueError(
        f"rope scaling {rope_type(scaling)!r} needs original_max_position_embeddings or max_position_embeddings"
    )


def _yarn_factor(scaling: Mapping[str, Any], max_positions: int | None, original: int) -> float:
    if scaling.get("factor") is not None:
        return scaling["factor"]
    if max_positions is None:
        raise ValueError("rope scaling 'yarn' without a factor needs max_position_embeddings")
    return max_positions / original


def _mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3(inv_freq: torch.Tensor, scaling: Mapping[str, Any], original: int) -> torch.Tensor:
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(original)
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(head_dim: int, theta: float, scaling: Mapping[str, Any], factor: float, original: int) -> torch.Tensor:
    """Interpolated (``/ factor``) below the ``beta_slow`` rotations over ``original`` positions,
    extrapolated (unchanged) above ``beta_fast``, a linear ramp over the dimensions between."""

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class Rotary(torch.nn.Module):
    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: Mapping[str, Any] | None,
        *,
        max_position_embeddings: int | None = None,
        original_max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.positions = {
            "max_position_embeddings": max_position_embeddings,
            "original_max_position_embeddings": original_max_position_embeddings,
        }
        self.attention_scaling = attention_scaling(scaling, **self.positions)
        self.register_buffer("inv_freq", self._frequencies(), persistent=False)

    def _frequencies(self) -> torch.Tensor:
        return inverse_frequencies(self.head_dim, self.theta, self.scaling, **self.positions)

    def reset(self, device: torch.device) -> None:
        """Recompute the frequencies, in float32, on ``device`` (after a build on the meta device)."""
        self.inv_freq = self._frequencies().to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[T, head_dim]`` for ``positions [T]``, times the attention scaling."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, head_dim]`` rotated by ``cos, sin [T, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotate_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, H, D]`` and ``k [T, KVH, D]`` rotated: in place by one Triton kernel on CUDA
    (``layers.fused``, the same roundings), else by ``apply_rotary``."""
    if fused.usable(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
        fused.rotary_(q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
