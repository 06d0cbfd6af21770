"""Paged attention: ``attend``, called by the engine's own model code with a step's metadata, and
``paged_attention``, which ``register`` gives transformers' ``AttentionInterface`` as
``"bootstrap_paged"`` for every other model (metadata from a thread-local, ``use_metadata``;
with no mask function for that name, transformers builds no mask). A step is a ragged batch
``[1, total_tokens]``. Each layer writes the new keys and values to their slots, then attends
per group of requests (``AttentionMetadata``) the first of three ways that applies, one result:

- one-token queries where Triton runs (``kernel="triton"``): the paged decode kernel
  (``kernels.paged_kv``) reads each row's blocks in place, copying no context;
- fresh prompt chunks, no soft-cap, no window shorter than the chunk: their own keys and values
  under a causal flag (SDPA's flash kernel, no mask);
- anything else: cached keys and values gathered through the block tables (``layers.gathered``),
  per request under a lower-right causal bias, or in one masked call (windows, soft-caps).
Decode steps replayed as CUDA graphs use ``DecodeMetadata`` instead (``_attend_decode``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from bootstrap.engine.kernels.paged_kv import paged_decode, write_kv
from bootstrap.engine.kv_cache import PagedKVCache
from bootstrap.engine.layers import gathered
from bootstrap.engine.layers.fp8 import to_fp8

ATTN_IMPLEMENTATION = "bootstrap_paged"

_local = threading.local()


@dataclass
class AttentionGroup:
    """Requests attended together in one padded call: ``[b, Qmax]`` queries, ``[b, K]`` keys.

    ``query_starts[i]`` is where request ``i``'s new tokens begin among the step's ``T`` tokens.
    Every derived tensor comes from device operations of static shape on the block tables, the
    lengths and three integers (``num_tokens``, ``max_query_len``, ``kv_blocks``).
    """

    block_tables: torch.Tensor  # [b, W] long: block ids, padded with any valid block id
    context_lens: torch.Tensor  # [b] long: tokens cached per request after this step
    query_lens: torch.Tensor  # [b] long: new tokens per request in this step
    query_starts: torch.Tensor  # [b] long
    num_tokens: int  # sum of query_lens
    max_query_len: int
    kv_blocks: int  # block-table columns gathered per request (<= W)
    tokens_per_block: int
    fresh: bool = False  # no member has cached tokens before this step: its keys are the step's own
    lengths: tuple[tuple[int, int], ...] = ()  # (context, query tokens) per request, on the host; () unknown
    kernel: str = "torch"  # "triton": a group of one-token queries runs the paged decode kernel
    token_ids: torch.Tensor = field(init=False)  # [n]: the group's tokens among the T
    rows: torch.Tensor = field(init=False)  # [n]: row of each of those tokens in [b * Qmax]
    query_index: torch.Tensor = field(init=False)  # [b, Qmax]: token feeding each padded row
    query_pos: torch.Tensor = field(init=False)  # [b, Qmax]: position of each padded row
    kv_slots: torch.Tensor = field(init=False)  # [b, kv_blocks * tpb]: slots to gather
    _masks: dict[int | None, torch.Tensor] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        lens, device = self.query_lens, self.query_lens.device
        rows = torch.arange(self.max_query_len, device=device).unsqueeze(0)
        clamped = torch.minimum(rows, (lens - 1).unsqueeze(1))  # padded rows repeat the last token
        self.query_index = self.query_starts.unsqueeze(1) + clamped
        self.query_pos = (self.context_lens - lens).unsqueeze(1) + clamped
        owner = torch.repeat_interleave(torch.arange(lens.shape[0], device=device), lens, output_size=self.num_tokens)
        local = torch.arange(self.num_tokens, device=device) - (torch.cumsum(lens, 0) - lens)[owner]
        self.rows = owner * self.max_query_len + local
        self.token_ids = self.query_starts[owner] + local
        tables = self.block_tables[:, : self.kv_blocks]
        offsets = torch.arange(self.tokens_per_block, device=device)
        self.kv_slots = (tables.unsqueeze(-1) * self.tokens_per_block + offsets).reshape(tables.shape[0], -1)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """``[b, 1, Qmax, K]`` bool: causal over each request's own tokens, within the window."""
        if sliding_window not in self._masks:
            kv_pos = torch.arange(self.kv_slots.shape[1], device=self.kv_slots.device)
            q_pos = self.query_pos.unsqueeze(-1)
            allowed = kv_pos <= q_pos
            if sliding_window is not None:
                allowed &= kv_pos > q_pos - sliding_window
            self._masks[sliding_window] = allowed.unsqueeze(1)
        return self._masks[sliding_window]


@dataclass
class AttentionMetadata:
    """What one forward step needs: where the new tokens go, and the groups to attend.

    Decode tokens and prefill chunks go in separate groups, so one-token queries are not padded
    to the length of a prompt chunk. A single group always covers all ``T`` tokens in order.
    """

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [T] long: flat cache slot of each new token
    groups: list[AttentionGroup]

    @classmethod
    def single(
        cls,
        kv_cache: PagedKVCache,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        query_lens: torch.Tensor,
        max_query_len: int,
        kv_blocks: int,
        kernel: str = "torch",
        lengths: tuple[tuple[int, int], ...] = (),
    ) -> AttentionMetadata:
        """All requests in one group, their tokens back to back in request order."""
        starts = torch.cumsum(query_lens, 0) - query_lens
        group = AttentionGroup(
            block_tables,
            context_lens,
            query_lens,
            starts,
            slot_mapping.shape[0],
            max_query_len,
            kv_blocks,
            kv_cache.tokens_per_block,
            kernel=kernel,
            lengths=lengths,
        )
        return cls(kv_cache, slot_mapping, [group])


@dataclass
class DecodeMetadata:
    """A decode step of static shape: ``B`` rows of one token, ``W`` block-table columns each."""

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [B] long: slot each row's new token is written to
    write_rows: torch.Tensor  # [B] long: row whose key and value go to that slot
    block_tables: torch.Tensor  # [B, W] long: valid block ids; columns past a row's length are masked
    context_lens: torch.Tensor  # [B] long: tokens cached per row after this step
    kernel: str = "torch"  # "triton": one paged kernel (bootstrap.engine.kernels.paged_kv), no gather
    _masks: dict[int | None, torch.Tensor] = field(init=False, default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """``[B, 1, 1, W * tpb]`` bool: positions below the context length, within the window."""
        if sliding_window not in self._masks:
            width = self.block_tables.shape[1] * self.kv_cache.tokens_per_block
            kv_pos = torch.arange(width, device=self.context_lens.device)
            lens = self.context_lens.unsqueeze(1)
            allowed = kv_pos < lens
            if sliding_window is not None:
                allowed &= kv_pos >= lens - sliding_window
            self._masks[sliding_window] = allowed[:, None, None, :]
        return self._masks[sliding_window]


@contextmanager
def use_metadata(metadata: AttentionMetadata | DecodeMetadata) -> Iterator[AttentionMetadata]:
    """Make ``metadata`` the one ``paged_attention`` reads in this thread, for one forward."""
    previous = getattr(_local, "metadata", None)
    _local.metadata = metadata
    try:
        yield metadata
    finally:
        _local.metadata = previous


def current_metadata() -> AttentionMetadata | DecodeMetadata:
    metadata = getattr(_local, "metadata", None)
    if metadata is None:
        raise RuntimeError(
            f"attention '{ATTN_IMPLEMENTATION}' was called outside a step: run the model through "
            "ModelRunner (or inside use_metadata(...))"
        )
    return metadata


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, H, T, D]``, ``key/value [1, KVH, T, D]``,
    the step's metadata from the thread-local ``use_metadata`` set.

    Returns ``[1, T, H, D]``, as transformers' own attention functions do.
    """
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"attention sinks (s_aux) are not supported by '{ATTN_IMPLEMENTATION}'")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(
            f"{type(module).__name__} has no layer_idx; '{ATTN_IMPLEMENTATION}' needs it to find its cache"
        )
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    return attend(current_metadata(), layer, q, k, v, scaling, sliding_window, softcap).unsqueeze(0), None


def attend(
    meta: AttentionMetadata | DecodeMetadata,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One layer's paged attention over a step: ``query [T, H, D]``, ``key/value [T, KVH, D]``
    (written to the layer's cache first), output ``[T, H, D]``. The engine's own model code
    calls this with the step's metadata as an argument."""
    pool = meta.kv_cache
    cache = gathered.LayerCache(pool.k_cache(layer), pool.v_cache(layer), pool.k_scale(layer), pool.v_scale(layer))
    if isinstance(meta, DecodeMetadata):
        if meta.kernel == "triton":
            write_kv(key, value, meta.write_rows, meta.slot_mapping, cache.k, cache.v, cache.scales)
        else:
            _write(
                cache, key.index_select(0, meta.write_rows), value.index_select(0, meta.write_rows), meta.slot_mapping
            )
        return _attend_decode(query, cache, meta, scaling, sliding_window, softcap)
    _write(cache, key, value, meta.slot_mapping)
    if len(meta.groups) == 1:
        return _attend(query, (key, value), cache, meta.groups[0], scaling, sliding_window, softcap)
    out = torch.empty_like(query)
    for group in meta.groups:
        part = _attend(query, (key, value), cache, group, scaling, sliding_window, softcap)
        out.index_copy_(0, group.token_ids, part)
    return out


def _attend(
    tokens: torch.Tensor,
    new_kv: tuple[torch.Tensor, torch.Tensor],
    cache: gathered.LayerCache,
    group: AttentionGroup,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Attention output ``[n, H, D]`` for the group's tokens, in the order of ``group.token_ids``,
    by the first of the module docstring's three ways that applies to the group."""
    if group.max_query_len == 1 and group.kernel == "triton":
        tables = group.block_tables[:, : group.kv_blocks]
        return paged_decode(
            tokens.index_select(0, group.token_ids),
            cache.k,
            cache.v,
            tables,
            group.context_lens,
            scaling,
            sliding_window,
            softcap,
            scales=cache.scales,
        )
    if group.fresh and softcap is None and (sliding_window is None or sliding_window >= group.max_query_len):
        if cache.quantized:  # the chunk's own keys as the pool holds them, as every later read sees them
            new_kv = tuple(
                gathered.dequantized(to_fp8(part, s), s, part.dtype) for part, s in zip(new_kv, cache.scales)
            )
        return _attend_fresh(tokens, new_kv, group, scaling)
    unwindowed = sliding_window is None or all(context <= sliding_window for context, _ in group.lengths)
    if softcap is None and group.lengths and unwindowed:  # each request under a lower-right causal bias
        return gathered.lower_right(
            tokens.index_select(0, group.token_ids), cache, group.kv_slots, group.lengths, scaling
        )
    q = _padded(tokens, group)
    k = gathered.gather(cache.k, cache.k_scale, group.kv_slots, q.dtype)
    v = gathered.gather(cache.v, cache.v_scale, group.kv_slots, q.dtype)
    return _unpad(gathered.masked(q, k, v, group.mask(sliding_window), scaling, softcap), group)


def _attend_fresh(
    tokens: torch.Tensor, new_kv: tuple[torch.Tensor, torch.Tensor], group: AttentionGroup, scaling: float | None
) -> torch.Tensor:
    """Prompts with nothing cached before this step: keys and values are the step's own, padded
    like the queries (a padded row repeats its request's last token), and a causal flag is the
    whole mask. A real row ``i`` sees keys ``0..i``, all real; padded rows are dropped."""
    q = _padded(tokens, group)
    k, v = (part[group.query_index].transpose(1, 2).to(q.dtype) for part in new_kv)  # [b, KVH, Qmax, D]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=k.shape[1] != q.shape[1])
    return _unpad(out, group)


def _padded(tokens: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """``[b, H, Qmax, D]``: the group's queries, a padded row repeating its request's last token."""
    return tokens[group.query_index].transpose(1, 2)


def _unpad(out: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """``[b, H, Qmax, D]`` padded output to ``[n, H, D]``: the group's real rows, in token order."""
    batch, heads, q_max, head_dim = out.shape
    return out.transpose(1, 2).reshape(batch * q_max, heads, head_dim).index_select(0, group.rows)


def _attend_decode(
    tokens: torch.Tensor,
    cache: gathered.LayerCache,
    meta: DecodeMetadata,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """``[B, H, D]``: one query token per row against the row's blocks, every tensor a view of
    the runner's static buffers and no host-side value read, so a CUDA graph can capture it
    (``bootstrap.engine.step.graphs``). With the Triton kernel, only the blocks each row's context
    fills are read; otherwise whole blocks of a fixed number of table columns are gathered, the
    positions at or past each row's length (or outside its window) masked, and one grouped-query
    SDPA runs with a KV head's query heads as its query rows (keys and values never repeated per
    query head). Padding rows repeat the last real row and write its keys and values
    (``write_rows``), so two writes to one slot always carry the same bits."""
    rows, heads, head_dim = tokens.shape
    if meta.kernel == "triton":
        return paged_decode(
            tokens,
            cache.k,
            cache.v,
            meta.block_tables,
            meta.context_lens,
            scaling,
            sliding_window,
            softcap,
            scales=cache.scales,
        )
    kv_heads = cache.k.shape[2]
    q = tokens.reshape(rows, kv_heads, heads // kv_heads, head_dim)  # query heads grouped by KV head
    k = gathered.gather_blocks(cache.k, cache.k_scale, meta.block_tables, q.dtype)
    v = gathered.gather_blocks(cache.v, cache.v_scale, meta.block_tables, q.dtype)
    return gathered.masked(q, k, v, meta.mask(sliding_window), scaling, softcap).reshape(rows, heads, head_dim)


def _write(cache: gathered.LayerCache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Store the step's keys and values ``[T, KVH, D]`` at their flat slots (an e4m3 pool: divided
    by its scales and saturated, written as bytes, since torch has no e4m3 ``index_copy_`` on the CPU)."""
    for part, new, scale in ((cache.k, key, cache.k_scale), (cache.v, value, cache.v_scale)):
        flat = part.view(-1, *part.shape[2:])
        if cache.quantized:
            flat.view(torch.uint8).index_copy_(0, slots, to_fp8(new, scale).view(torch.uint8))
        else:
            flat.index_copy_(0, slots, new.to(flat.dtype))


def register() -> None:
    """Register ``paged_attention`` with transformers as ``"bootstrap_paged"`` (idempotent), for
    the models that run through transformers' classes; imports transformers, so it is called
    only on their way in (the engine's own model code calls ``paged_attention`` directly)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
