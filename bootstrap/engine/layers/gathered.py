"""Attention over keys and values gathered from the paged pool (``layers.attention``'s third way):
a layer's pool (``LayerCache``), the cached tokens of each request read through its slots and
dequantized from an e4m3 pool.

Continued prompt chunks with no window and no soft-cap go request by request, causal from the
lower right over exactly each request's context (``causal_from_lower_right``): flash's own causal
mode, no mask tensor, nothing repeated per query head. Written here rather than taken from
``torch.nn.attention.bias``, whose import pulls in dynamo and sympy (seconds on every start).
Anything else goes in one padded call under a boolean mask. Why not one masked call for all: on
Hopper SDPA gives a masked call to cuDNN, which builds a plan for each new shape (~0.2 s on an
H100), and a chunk's shape rarely repeats while prompts differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

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
        outputs.append(causal_from_lower_right(q, k, v, scaling)[0].transpose(0, 1))
        start += count
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def causal_from_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """SDPA of ``q [B, H, L, D]`` over ``k, v [B, KVH, S, D]`` (``L <= S``) where query ``i`` sees
    keys ``0 .. S - L + i``: the causal diagonal at the lower-right corner. What torch's
    ``CausalBias`` dispatches to: flash's causal mode (lower-right aligned), else the efficient
    kernel's lower-right mask type (no grouped heads), else a boolean mask."""
    count, context, gqa = q.shape[-2], k.shape[-2], k.shape[1] != q.shape[1]
    if count == context:  # both corners coincide
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if q.is_cuda:
        params = SDPAParams(q, k, v, None, 0.0, False, gqa)
        if can_use_flash_attention(params):
            head = q.shape[-1]
            pad = -head % 8  # flash takes head sizes in multiples of 8
            if pad:
                q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]
            return out[..., :head]
        if can_use_efficient_attention(params):
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            out = torch.ops.aten._efficient_attention_forward(
                q, k, v, None, None, None, None, None, 0.0, _LOWER_RIGHT_MASK, False, scale=scale
            )[0]
            return out.transpose(1, 2)
    mask = torch.ones(count, context, dtype=torch.bool, device=q.device).tril(context - count)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


_LOWER_RIGHT_MASK = 2  # the efficient kernel's custom_mask_type for a lower-right causal mask


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
