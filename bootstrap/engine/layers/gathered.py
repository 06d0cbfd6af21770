"""Attention over keys and values gathered from the paged pool (``layers.attention``'s third way):
a layer's pool (``LayerCache``), the cached tokens of each request read through its slots and
dequantized from an e4m3 pool.

Continued prompt chunks with no window and no soft-cap go request by request under SDPA's
lower-right causal bias over exactly each request's context: its flash kernel, no mask tensor,
nothing repeated per query head. Anything else goes in one padded call under a boolean mask.
Why not one masked call for all: on Hopper SDPA gives a masked call to cuDNN, which builds a plan
for each new shape (~0.2 s on an H100), and a chunk's shape rarely repeats while prompts differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from bootstrap.engine.layers.fp8 import FP8


@dataclass(frozen=True)
class LayerCache:
    """One layer's keys and values ``[blocks, tpb, KVH, D]`` and, for an e4m3 pool, their scales."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    @property
    def quantized(self) -> bool:
        return self.k.dtype == FP8

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.k_scale, self.v_scale) if self.quantized else None


def lower_right(
    tokens: torch.Tensor,
    cache: LayerCache,
    kv_slots: torch.Tensor,
    lengths: tuple[tuple[int, int], ...],
    scaling: float | None,
) -> torch.Tensor:
    """``[n, H, D]``: the group's tokens ``[n, H, D]`` (request by request, ``lengths``' query
    tokens each), each request's against the first ``context`` of its ``kv_slots`` row.
    ``lengths``: (context, query tokens) per request."""
    outputs, start = [], 0
    for row, (context, count) in enumerate(lengths):
        q = tokens[start : start + count].transpose(0, 1).unsqueeze(0)  # [1, H, count, D]
        slots = kv_slots[row, :context][None]
        k, v = gather(cache.k, cache.k_scale, slots, q.dtype), gather(cache.v, cache.v_scale, slots, q.dtype)
        bias = causal_lower_right(count, context)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]
        )
        outputs.append(out[0].transpose(0, 1))
        start += count
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """SDPA under a boolean mask, keys and values repeated per query head (SDPA's efficient
    kernel takes a mask but not grouped heads). With a soft-cap (Gemma 2), which SDPA does not
    offer: the scores in memory, capped by tanh."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / softcap) * softcap
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
    return torch.matmul(weights.to(q.dtype), v)


def gather(cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, KVH, K, D]``: the cached tokens at ``slots [B, K]``, in position order, dequantized."""
    flat = cache.view(-1, *cache.shape[2:])
    return dequantized(flat[slots].transpose(1, 2), scale, dtype)


def gather_blocks(cache: torch.Tensor, scale: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, KVH, W * tpb, D]``: whole blocks of every row, in position order, dequantized."""
    rows, width = tables.shape
    blocks = cache.index_select(0, tables.reshape(-1))  # [B * W, tpb, KVH, D]
    return dequantized(blocks.view(rows, width * cache.shape[1], *cache.shape[2:]).transpose(1, 2), scale, dtype)


def dequantized(kv: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return kv.to(dtype) * scale.to(dtype) if kv.dtype == FP8 else kv.to(dtype)
